"""Which part of a DataLoader's worker arguments cannot be pickled (spawn and forkserver workers).

A ``spawn`` or ``forkserver`` worker receives the dataset, ``collate_fn`` and ``worker_init_fn`` by
pickling. A lambda or a function defined inside another function anywhere in them (a
``sample_transform``, a ``decode=`` entry, a collate) made ``iter()`` fail with pickle's bare
``Can't pickle <function <lambda> at 0x...>`` or ``Can't pickle local object 'f.<locals>.g'``,
which names neither the argument nor what to do. :func:`explain` looks for the innermost part that
pickle refuses (only once starting a worker has failed: it costs nothing otherwise) and
:class:`WorkerPickleError` names it by the argument it came from.
"""
from __future__ import annotations

import copyreg
import functools
import io
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

from fastdata.errors import FastdataError

__all__ = ["WorkerPickleError", "explain", "find_unpicklable", "main_without_file"]

_DEPTH = 8  # attribute/item levels searched below each argument
# internal attribute paths of a ShardedDataset, as the user passed them
_USER_NAMES = (("dataset._samples.decoder.decode", "dataset.decode"), ("dataset._samples.cache", "dataset.cache"))
_NEWOBJ = (getattr(copyreg, "__newobj__", None), getattr(copyreg, "__newobj_ex__", None))  # the plain object protocol


class WorkerPickleError(FastdataError, pickle.PicklingError):
    """A worker argument (dataset, ``collate_fn``, ``worker_init_fn``) cannot be pickled for
    ``spawn``/``forkserver`` worker processes; names the part and what to do."""


def _pickles(obj: Any) -> BaseException | None:
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except RecursionError:
        raise
    except Exception as e:  # noqa: BLE001 - pickle raises TypeError, AttributeError, PicklingError, ... from user objects
        return e
    return None


def _children(obj: Any) -> list[tuple[str, Any]]:
    """(path suffix, part) of what pickling ``obj`` pickles in turn (empty: pickled as a whole)."""
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        return []  # pickled by reference: the object itself is the culprit
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()] + [(f".keys()[{i}]", k) for i, k in enumerate(obj)]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"{{{i}}}", v) for i, v in enumerate(obj)]
    if isinstance(obj, functools.partial):
        return ([(".func", obj.func)] + [(f".args[{i}]", a) for i, a in enumerate(obj.args)]
                + [(f".keywords[{k!r}]", v) for k, v in obj.keywords.items()])
    if isinstance(obj, types.MethodType):
        return [(".__self__", obj.__self__)]
    try:
        reduced = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - the object refuses to be pickled: it is the culprit
        return []
    if isinstance(reduced, str) or not isinstance(reduced, tuple):
        return []
    out: list[tuple[str, Any]] = []
    func, args = reduced[0], reduced[1] if len(reduced) > 1 else ()
    if func not in _NEWOBJ:
        out.append((".__reduce__()[0]", func))
    state = reduced[2] if len(reduced) > 2 else None
    if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
        state = {**(state[0] or {}), **(state[1] or {})}  # (__dict__, slots)
    if isinstance(state, dict):
        out += [(f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]", v) for k, v in state.items()]
    elif state is not None:
        out.append((".__getstate__()", state))
    out += [(f".__reduce__()[1][{i}]", a) for i, a in enumerate(args or ()) if not isinstance(a, type)]
    return out


def find_unpicklable(obj: Any, path: str, test: Callable[[Any], Any] = _pickles) -> tuple[str, Any, Any] | None:
    """``(path, part, pickle's error)`` of the innermost part of ``obj`` that pickle refuses; None when
    ``obj`` pickles (plain :mod:`pickle`, as spawn and forkserver workers need). ``test``: another
    check of a part (None: the part is fine)."""
    error = test(obj)
    if error is None:
        return None
    seen = {id(obj)}
    for _ in range(_DEPTH):
        for suffix, child in _children(obj):
            if id(child) in seen:
                continue
            child_error = test(child)
            if child_error is not None:
                seen.add(id(child))
                obj, path, error = child, path + suffix, child_error
                break
        else:
            break
    for internal, user in _USER_NAMES:
        if path == internal or path.startswith(internal) and not path[len(internal)].isalnum():
            path = user + path[len(internal):]
    return path, obj, error


_LOADER_REMEDY = "multiprocessing_context='fork' (Linux) or decode_threads=N (no worker processes)"


def explain(method: str, parts: list[tuple[str, Any]], error: BaseException, *,
            remedy: str = _LOADER_REMEDY) -> WorkerPickleError | None:
    """The error to raise instead of pickle's ``error`` when starting ``method`` workers failed, or None
    when none of ``parts`` (``(name, object)``: the dataset, collate_fn, worker_init_fn) is the cause.
    ``remedy``: the ways around worker processes the message offers."""
    for name, obj in parts:
        try:
            found = find_unpicklable(obj, name)
        except RecursionError:
            continue
        if found is None:
            continue
        path, part, why = found
        what = repr(part)
        if len(what) > 120:
            what = what[:117] + "..."
        hint = ("define it at module level (lambdas and functions defined inside other functions cannot be "
                "pickled), or make it a class instance with __call__"
                if isinstance(part, types.FunctionType) or "<locals>" in type(part).__qualname__
                else "make it picklable")
        names = ", ".join(name for name, _ in parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1][0]
        return WorkerPickleError(
            f"{method} worker processes receive the {names} by pickling, and "
            f"{path} ({what}) cannot be pickled: {type(why).__name__}: {why}. To fix it: {hint}; or use "
            f"{remedy}")
    return None


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, noting the first function or class of module ``__main__`` it meets."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: Any = None

    def persistent_id(self, obj: Any) -> None:
        if (self.found is None and isinstance(obj, (types.FunctionType, type))
                and getattr(obj, "__module__", None) == "__main__"):
            self.found = obj


def _main_reference(obj: Any) -> Any:
    """The first function or class of module ``__main__`` that pickling ``obj`` refers to, or None."""
    finder = _MainFinder()
    try:
        finder.dump(obj)
    except Exception:  # noqa: BLE001 - not picklable at all: starting the workers says so (see explain)
        return finder.found
    return finder.found


def main_without_file(method: str, parts: list[tuple[str, Any]], *,
                      remedy: str = _LOADER_REMEDY) -> WorkerPickleError | None:
    """The error to raise before starting ``method`` workers when one of ``parts`` refers to a function or
    class of a ``__main__`` module that has no file (a notebook, ``python -c``, an interactive session):
    it pickles here, but a worker cannot import it, so each worker died while starting (its
    ``AttributeError: Can't get attribute ...`` only on the parent's stderr, not in a notebook) and the
    loop got torch's "DataLoader worker (pid(s) ...) exited unexpectedly". None otherwise (also when
    ``__main__`` has a file: a worker imports it again)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__file__", None) or getattr(getattr(main, "__spec__", None), "name", None):
        return None
    for name, obj in parts:
        found = find_unpicklable(obj, name, _main_reference)
        if found is not None:
            path, _, ref = found
            kind = "class" if isinstance(ref, type) else "function"
            return WorkerPickleError(
                f"{path} uses the {kind} {ref.__qualname__!r} defined in __main__ without a file (a "
                f"notebook, python -c, an interactive session): {method} worker processes receive it by name and "
                "cannot import it from there (each would die while starting). Move it into a .py module and "
                f"import it from there; or use {remedy}")
    return None
