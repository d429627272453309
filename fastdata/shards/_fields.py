"""Inference of :class:`~fastdata.manifest.FieldInfo` (kind, dtype, shape) from sample values."""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import numpy as np

from fastdata._util import IMAGE_SUFFIXES
from fastdata.manifest import FieldInfo
from fastdata.shards._keys import check_field, is_meta

__all__ = ["FieldTracker", "dtype_spelling", "missing_fields", "required_fields", "value_info"]


def required_fields(fields: Iterable[str]) -> tuple[frozenset[str], ...]:
    """What every sample of a data set with ``fields`` must hold: one name from each group.

    Every non-image field is a group of its own. Image fields sharing a base name (the field name
    without its last suffix: ``jpg``/``png``/``jpeg`` share ``""``, ``seg.png`` has ``"seg"``) form
    one group: an image stored in one of several formats (an image folder of JPEGs and PNGs).
    """
    groups: dict[str, set[str]] = {}
    alone: list[frozenset[str]] = []
    for name in sorted(set(fields)):
        base, _, ext = name.rpartition(".")
        if ext.lower() in IMAGE_SUFFIXES:
            groups.setdefault(base, set()).add(name)
        else:
            alone.append(frozenset((name,)))
    return tuple(sorted([*alone, *(frozenset(g) for g in groups.values())], key=sorted))


def missing_fields(have: Collection[str], required: Iterable[frozenset[str]]) -> list[str]:
    """The required groups ``have`` lacks, as names (alternatives joined by ``|``); empty when complete."""
    return ["|".join(sorted(group)) for group in required if group.isdisjoint(have)]


def dtype_spelling(dtype: np.dtype) -> str | None:
    """The manifest's name of ``dtype``, one ``np.dtype()`` reads back as it: ``uint8``, ``>i4``, ``<U2``.

    The NumPy name where it parses back (native byte order), else ``dtype.str``; None for a dtype no
    string spells (structured: ``.str`` drops the fields), recorded like a dtype that varies. Names such
    as ``str64``/``void96``/``bytes24`` (``.name`` of unicode, void and bytes dtypes) do not parse.
    """
    for spelling in ((dtype.name,) if dtype.byteorder in "=|" else ()) + (dtype.str,):
        try:
            if np.dtype(spelling) == dtype:
                return spelling
        except TypeError:
            pass
    return None


def value_info(field: str, value: Any, *, key: str = "") -> tuple[str, str | None, tuple[int, ...] | None]:
    """``(kind, dtype, shape)`` of one value; TypeError naming key and field for unsupported types."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", None, None
    if isinstance(value, str):
        return "text", None, None
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        return "int", None, None
    if isinstance(value, (float, np.floating)):
        return "float", None, None
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"field {field!r} of sample {key!r}: object arrays cannot be stored")
        return "array", dtype_spelling(value.dtype), value.shape
    if isinstance(value, (dict, list)):
        return "json", None, None
    raise TypeError(f"field {field!r} of sample {key!r} has unsupported type {type(value).__name__}")


class FieldTracker:
    """Accumulates field kinds/dtypes/shapes over samples; picklable and mergeable across workers.

    A field whose kind changes between samples is a ValueError naming the key; an array field
    whose dtype or shape varies gets ``dtype``/``shape`` None.
    """

    def __init__(self) -> None:
        self._info: dict[str, tuple[str, str | None, tuple[int, ...] | None]] = {}

    def add(self, sample: Mapping[str, Any]) -> None:
        """Record the fields of one sample; on a ValueError/TypeError nothing of it is recorded."""
        key = str(sample.get("__key__", ""))
        infos = [(check_field(name, key), value_info(name, value, key=key))
                 for name, value in sample.items() if not is_meta(name)]
        for name, info in infos:
            self._check(name, info, key)
        for name, info in infos:
            self._merge(name, info)

    def merge(self, other: FieldTracker) -> None:
        """Add the fields another tracker has seen (ValueError when a field's kind differs)."""
        for name, info in other._info.items():
            self._check(name, info, "")
        for name, info in other._info.items():
            self._merge(name, info)

    def _check(self, name: str, info: tuple[str, str | None, tuple[int, ...] | None], key: str) -> None:
        prev = self._info.get(name)
        if prev is not None and prev[0] != info[0]:
            where = f"sample {key!r}" if key else "a merged shard"
            raise ValueError(f"field {name!r} of {where} is {info[0]!r} but earlier samples had {prev[0]!r}")

    def _merge(self, name: str, info: tuple[str, str | None, tuple[int, ...] | None]) -> None:
        prev = self._info.get(name)
        if prev is None:
            self._info[name] = info
            return
        if prev != info:
            self._info[name] = (prev[0], prev[1] if prev[1] == info[1] else None,
                                prev[2] if prev[2] == info[2] else None)

    def fields(self) -> tuple[FieldInfo, ...]:
        """The fields seen so far, sorted by name."""
        return tuple(FieldInfo(name, kind, dtype, shape)
                     for name, (kind, dtype, shape) in sorted(self._info.items()))
