"""What a cache store's folder holds: the file names, ``meta.json`` and the field layout.

A store folder (``<cache dir>/<key>/``) holds ``meta.json`` (format version, key, fingerprint,
sample count, and ``fields``: null until the first put defines the layout), one preallocated
``field-NNN.bin`` per field (row ``i`` = sample ``i``), ``valid.bin`` (byte ``i`` is 1 once sample
``i`` is completely written), the locks ``open.lock`` and ``layout.lock``, and ``last_used`` (its
mtime orders eviction). A layout read from ``meta.json`` is checked before any file is mapped.
Design note: ``docs/design/cache-store.md``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fastdata.errors import CacheError

__all__ = ["CACHE_FORMAT_VERSION", "LAST_USED", "LAYOUT_LOCK", "META_NAME", "OPEN_LOCK", "REFUSED", "VALID_NAME",
           "FieldLayout", "StoreOwner", "parse_fields", "read_meta"]

CACHE_FORMAT_VERSION = 1
META_NAME = "meta.json"
VALID_NAME = "valid.bin"
OPEN_LOCK = "open.lock"
LAYOUT_LOCK = "layout.lock"
LAST_USED = "last_used"
REFUSED = "refused"  # meta.json key: why the first put could not allocate the store (it holds nothing)


class StoreOwner(Protocol):
    """What a store needs from the :class:`~fastdata.cache.Cache` that opened it."""

    directory: Path
    fsync: bool

    def make_room(self, nbytes: int, *, keep: str) -> None:
        """Evict other stores so that ``nbytes`` more fit under the cache's byte limit."""


@dataclass(frozen=True)
class FieldLayout:
    """Shape and dtype of one cached field; every sample of a store has the same."""

    name: str
    dtype: str  # numpy dtype string, e.g. "|u1", "<f4"
    shape: tuple[int, ...]
    file: str

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "file": self.file}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FieldLayout:
        return cls(str(d["name"]), str(d["dtype"]), tuple(int(s) for s in d["shape"]), str(d["file"]))


def read_meta(path: Path) -> dict[str, Any]:
    """The ``meta.json`` of the store directory ``path``; CacheError naming the file if unreadable."""
    file = path / META_NAME
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CacheError(f"cache store {path}: cannot read {META_NAME}: {e}") from e
    if not isinstance(meta, dict):
        raise CacheError(f"cache store {path}: {META_NAME} is not a JSON object")
    return meta


def parse_fields(path: Path, meta: Mapping[str, Any]) -> list[FieldLayout] | None:
    raw = meta.get("fields")
    if raw is None:
        return None
    try:
        fields = [FieldLayout.from_json(d) for d in raw]
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"cache store {path}: {META_NAME} has a malformed 'fields' entry: {e}") from e
    problem = _layout_problem(fields)
    if problem is not None:
        raise CacheError(f"cache store {path}: {META_NAME} has a malformed 'fields' entry: {problem} "
                         "(a corrupt store; remove it with `fastdata cache rm`)")
    return fields


def _layout_problem(fields: list[FieldLayout]) -> str | None:
    """What is wrong with a layout read from meta.json (None: it is one ``_create_layout`` writes)."""
    if not fields:
        return "no fields"
    if len({f.name for f in fields}) != len(fields):
        return f"a field is listed twice ({[f.name for f in fields]})"
    for k, f in enumerate(fields):
        if f.file != f"field-{k:03d}.bin":  # never a path outside the store
            return f"field {f.name!r} has file {f.file!r}, expected 'field-{k:03d}.bin'"
        try:
            dtype = np.dtype(f.dtype)
        except TypeError as e:
            return f"field {f.name!r} has dtype {f.dtype!r}: {e}"
        if dtype.kind not in "biufc":
            return f"field {f.name!r} has dtype {f.dtype!r}, not a numeric or bool dtype"
        if any(s < 0 for s in f.shape) or f.nbytes < 1:
            return f"field {f.name!r} has shape {list(f.shape)} ({f.nbytes} bytes per sample)"
    return None
