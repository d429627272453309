"""Walk nested batches: find the tensors in them and rebuild the same structure around new tensors.

Containers understood: dict (and other mappings), list, tuple, namedtuple and dataclass instances.
Everything else is a leaf; only ``torch.Tensor`` leaves are mapped, other leaves are returned as the
very same objects. Traversal order is deterministic (mapping order, sequence order, field order), so
``tensor_leaves`` and ``map_tensors`` visit tensors in the same order.

A *path* is the tuple of keys leading to a value: mapping keys, sequence indices, and field names for
namedtuples and dataclasses. ``batch["img"][0]`` has the path ``("img", 0)``.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import torch

Path = tuple[Any, ...]
LeafFn = Callable[[torch.Tensor, Path], Any]

__all__ = ["HOLDS_TENSORS", "Path", "format_path", "held_tensors", "keys_matcher", "map_tensors", "tensor_leaves"]

# A leaf object that keeps tensors the walk cannot see (``fastdata.gpu.ImageBatch``: images of several
# sizes) lists them through a method of this name, so that the prefetcher protects their memory too.
HOLDS_TENSORS = "__fastdata_tensors__"


def format_path(path: Path) -> str:
    """``("img", 0)`` -> ``batch['img'][0]``, for error messages."""
    return "batch" + "".join(f".{p}" if isinstance(p, _FieldName) else f"[{p!r}]" for p in path)


class _FieldName(str):
    """A path component that names an attribute (namedtuple/dataclass field), printed as ``.name``."""

    __slots__ = ()


def keys_matcher(keys: Iterable[Any] | None) -> Callable[[Path], bool] | None:
    """A predicate that is true for paths containing any of ``keys`` (None -> no predicate)."""
    if keys is None:
        return None
    wanted = frozenset(keys)
    if not wanted:
        return None
    return lambda path: any(p in wanted for p in path)


def map_tensors(obj: Any, fn: LeafFn, *, skip: Callable[[Path], bool] | None = None) -> Any:
    """Return ``obj`` with every tensor ``t`` at path ``p`` replaced by ``fn(t, p)``.

    Subtrees whose path satisfies ``skip`` are returned unchanged. Containers with a changed child are
    rebuilt with their own type (namedtuples via their fields, dataclasses via a shallow copy, so frozen
    and ``init=False`` fields work); containers whose children are all unchanged and non-tensor
    leaves are returned as the same objects.
    """
    return _map(obj, fn, skip, ())


def tensor_leaves(obj: Any, *, skip: Callable[[Path], bool] | None = None) -> list[tuple[Path, torch.Tensor]]:
    """The ``(path, tensor)`` pairs of ``obj`` in ``map_tensors`` order."""
    found: list[tuple[Path, torch.Tensor]] = []
    _walk(obj, found, skip, ())
    return found


def held_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``: its tensor leaves, then those of leaf objects with a ``HOLDS_TENSORS``
    method (not mapped by ``map_tensors``: only their memory is looked after)."""
    found: list[tuple[Path, torch.Tensor]] = []
    _walk(obj, found, None, (), deep=True)
    return [t for _, t in found]


# Leaf types that can never hold a tensor: checked first (by exact type), so that the common batch
# entries (keys, labels, lists of strings) cost one set lookup instead of a chain of isinstance checks.
_ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})


def _atoms_only(seq: Any) -> bool:
    return all(type(v) in _ATOMS for v in seq)


def _map(obj: Any, fn: LeafFn, skip: Callable[[Path], bool] | None, path: Path) -> Any:
    if type(obj) in _ATOMS:
        return obj
    if isinstance(obj, torch.Tensor):
        return fn(obj, path)
    if type(obj) is list and _atoms_only(obj):
        return obj
    if isinstance(obj, Mapping):
        new = {k: _child(v, fn, skip, (*path, k)) for k, v in obj.items()}
        if _unchanged(obj.values(), new.values()):
            return obj
        return new if type(obj) is dict else _rebuild_mapping(obj, new)
    if isinstance(obj, (list, tuple)):
        named = isinstance(obj, tuple) and hasattr(obj, "_fields")
        keys = [_FieldName(n) for n in obj._fields] if named else range(len(obj))
        items = [_child(v, fn, skip, (*path, k)) for k, v in zip(keys, obj)]
        if _unchanged(obj, items):
            return obj
        if type(obj) is list:
            return items
        if type(obj) is tuple:
            return tuple(items)
        return type(obj)(*items) if named else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        values = [_child(getattr(obj, f.name), fn, skip, (*path, _FieldName(f.name))) for f in fields]
        if _unchanged((getattr(obj, f.name) for f in fields), values):
            return obj
        new = copy.copy(obj)
        for f, value in zip(fields, values):
            object.__setattr__(new, f.name, value)
        return new
    return obj


def _unchanged(old: Iterable[Any], new: Iterable[Any]) -> bool:
    return all(a is b for a, b in zip(old, new))


def _child(value: Any, fn: LeafFn, skip: Callable[[Path], bool] | None, path: Path) -> Any:
    if skip is not None and skip(path):
        return value
    return _map(value, fn, skip, path)


def _rebuild_mapping(obj: Mapping, items: dict) -> Any:
    if isinstance(obj, MutableMapping):
        new = copy.copy(obj)  # keeps subclass state such as a defaultdict's factory
        for k, v in items.items():
            new[k] = v
        return new
    try:
        return type(obj)(items)
    except TypeError:
        return items


def _walk(obj: Any, found: list, skip: Callable[[Path], bool] | None, path: Path, deep: bool = False) -> None:
    if type(obj) in _ATOMS:
        return
    if isinstance(obj, torch.Tensor):
        found.append((path, obj))
        return
    if type(obj) is list and _atoms_only(obj):
        return
    if isinstance(obj, Mapping):
        children: Iterable[tuple[Any, Any]] = obj.items()
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        children = zip([_FieldName(n) for n in obj._fields], obj)
    elif isinstance(obj, (list, tuple)):
        children = enumerate(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = ((_FieldName(f.name), getattr(obj, f.name)) for f in dataclasses.fields(obj))
    else:
        hook = getattr(type(obj), HOLDS_TENSORS, None) if deep else None
        if hook is not None:
            found.extend(((*path, i), t) for i, t in enumerate(hook(obj)) if isinstance(t, torch.Tensor))
        return
    for key, value in children:
        child = (*path, key)
        if skip is None or not skip(child):
            _walk(value, found, skip, child, deep)
