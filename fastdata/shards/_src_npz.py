"""SRC kind ``npz``: a ``.npz`` whose arrays share their first axis, one sample per row.

One field ``<name>.npy`` per array; keys from a string array ``__key__`` if present, else the
zero-padded row number. Array headers are read without loading the arrays; arrays stored
uncompressed are memory-mapped when read. Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastdata.errors import SourceError
from fastdata.manifest import FieldInfo
from fastdata.shards._fields import dtype_spelling
from fastdata.shards._keys import check_field, check_key
from fastdata.shards._listing import Listing, file_items, set_stamp
from fastdata.shards._tarfmt import member_bytes

__all__ = ["NpyMember", "list_npz", "npz_members"]


@dataclass(frozen=True)
class NpyMember:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    offset: int | None  # byte offset of the raw array data in the .npz (stored, not compressed)


def npz_members(path: Path) -> list[NpyMember]:
    """Array headers of a ``.npz`` without loading the arrays."""
    out = []
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, fortran, dtype = read(f)
                    header_len = f.tell()
                offset = None
                if info.compress_type == zipfile.ZIP_STORED:
                    raw.seek(info.header_offset)
                    local = raw.read(30)
                    name_len, extra_len = struct.unpack("<HH", local[26:30])
                    offset = info.header_offset + 30 + name_len + extra_len + header_len
                out.append(NpyMember(info.filename[:-4], tuple(shape), np.dtype(dtype), fortran, offset))
    except (OSError, ValueError, zipfile.BadZipFile, struct.error) as e:
        raise SourceError(f"SRC {path}: not a readable .npz: {e}") from e
    return out


def list_npz(path: Path) -> Listing:
    members = npz_members(path)
    arrays = [m for m in members if m.name != "__key__"]
    if not arrays:
        raise SourceError(f"SRC {path}: the .npz holds no arrays")
    for m in members:
        if m.dtype.hasobject:
            raise SourceError(f"SRC {path}: array {m.name!r} has dtype object; only plain arrays are supported")
        if not m.shape:
            raise SourceError(f"SRC {path}: array {m.name!r} is 0-dimensional; arrays need a sample axis")
    n = arrays[0].shape[0]
    for m in members:
        if m.shape[0] != n:
            raise SourceError(f"SRC {path}: arrays must share their first axis, but {arrays[0].name!r} has "
                              f"{n} rows and {m.name!r} has {m.shape[0]}")
    if n == 0:
        raise SourceError(f"SRC {path}: the arrays have no rows (empty)")
    fields = []
    for m in arrays:
        try:
            check_field(m.name + ".npy")
        except ValueError as e:
            raise SourceError(f"SRC {path}: array name {m.name!r} cannot be a field: {e}") from None
        fields.append(FieldInfo(m.name + ".npy", "array", dtype_spelling(m.dtype), m.shape[1:]))
    key_member = next((m for m in members if m.name == "__key__"), None)
    if key_member is not None:
        if key_member.dtype.kind not in "US" or len(key_member.shape) != 1:
            raise SourceError(f"SRC {path}: array '__key__' must be a 1-D string array, "
                              f"got {key_member.dtype} {key_member.shape}")
        with np.load(path, allow_pickle=False) as z:
            raw_keys = z["__key__"]
        keys = []
        for i, k in enumerate(raw_keys.tolist()):
            try:
                keys.append(k.decode("utf-8") if isinstance(k, bytes) else str(k))
            except UnicodeDecodeError:
                raise SourceError(f"SRC {path}: __key__[{i}] {k!r} is not UTF-8 text") from None
        for k in keys:
            try:
                check_key(k)
            except ValueError as e:
                raise SourceError(f"SRC {path}: __key__: {e}") from None
    else:
        width = max(6, len(str(n - 1)))
        keys = [f"{i:0{width}d}" for i in range(n)]
    data = [(m.name, 128 + m.dtype.itemsize * int(np.prod(m.shape[1:], dtype=np.int64))) for m in arrays]
    sizes = [sum(member_bytes(f"{k}.{name}.npy", size) for name, size in data) for k in keys]
    listing = Listing(kind="npz", root=str(path), files=(str(path),), indexes=(None,), keys=keys,
                      refs=[(0, i) for i in range(n)], sizes=sizes, image_sizes=[0] * n,
                      data_sizes=[sum(size - 128 for _, size in data)] * n, image_data_sizes=[0] * n,
                      fields=tuple(sorted(fields, key=lambda f: f.name)))
    listing.extra["arrays"] = [m.name for m in arrays]
    set_stamp(listing, file_items(path.parent, [path]))
    return listing
