"""Input enumeration for ``fastdata shard``: what SRC holds, as a sorted list of samples.

Planning needs every sample's key, a small picklable reference to read it later, and an
estimate of its stored size, without reading sample data. Worker processes then read samples
by reference through :class:`SourceReader` (readers open lazily per process).

Source kinds (:func:`list_source`):

- ``images``: a folder with one subfolder per class (searched recursively, symlinks followed);
  classes are the sorted subfolder names and ``cls`` is the class's index. Key =
  ``<class>/<path below the class without extension>``; dots in the file name become ``_``
  (a key's last component cannot hold a dot). Field = the lower-cased extension (``jpg``,
  ``jpeg``, ``png`` ...). A folder of images without subfolders gives unlabelled samples. Hidden
  entries are ignored; other files, and images beside class folders, are listed as skipped.
- ``tar``: a ``.tar`` file or a folder of ``*.tar`` shards (top level; webdataset-written ones
  included), in name order; samples in file order, fields passed through byte for byte. The
  folder's other files and subfolders are listed as skipped; compressed shards are refused.
- ``hdf5``: a ``.h5``/``.hdf5`` file or a folder of them, in fastdata's documented layout.
- A folder holding ``manifest.json`` (a fastdata output): its shards, in manifest order, and its
  class names (``extra.source.classes``) for the new manifest. One
  holding ``.fastdata-progress`` instead (an unfinished conversion) is refused.
- ``npz``: a ``.npz`` whose arrays share their first axis; one field ``<name>.npy`` per array,
  keys from a string array ``__key__`` if present, else the zero-padded row number.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import stat
import struct
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastdata.errors import SourceError
from fastdata.io import local_path
from fastdata.manifest import MANIFEST_NAME, FieldInfo, Manifest
from fastdata.shards._fields import dtype_spelling
from fastdata.shards._formats import HDF5, TAR, shard_format
from fastdata.shards._images import IMAGE_EXTENSIONS
from fastdata.shards._keys import check_field, check_key
from fastdata.shards._tarfmt import member_bytes

__all__ = ["Listing", "SourceError", "SourceReader", "list_source"]

_TAR_SUFFIXES = TAR.source_suffixes
_H5_SUFFIXES = HDF5.source_suffixes
_COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
PROGRESS_DIR = ".fastdata-progress"  # a conversion's records in DEST until its manifest is written


@dataclass
class Listing:
    """Everything planning needs about SRC. Per-sample lists are parallel."""

    kind: str  # "images" | "tar" | "hdf5" | "npz"
    root: str  # SRC, absolute
    files: tuple[str, ...] = ()  # absolute paths of shard/npz files (refs index into this)
    indexes: tuple[str | None, ...] = ()  # sidecar index per tar file (None: default/scan)
    keys: list[str] = field(default_factory=list)
    refs: list[tuple] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # estimated tar bytes of the sample as is
    image_sizes: list[int] = field(default_factory=list)  # ... of its image fields
    # the sample's data bytes as HDF5 holds them (no tar headers, ints as int64), and of its image fields
    data_sizes: list[int] = field(default_factory=list)
    image_data_sizes: list[int] = field(default_factory=list)
    field_counts: dict[str, int] = field(default_factory=dict)  # samples holding each field (tar SRC)
    fields: tuple[FieldInfo, ...] = ()
    skipped: list[dict[str, str]] = field(default_factory=list)
    stamp: str = ""  # sha256 over input names, sizes and mtimes (part of the plan fingerprint)
    # what a refused rerun compares to name what changed: {"count", "bytes", "names" (sha256 of the input
    # names), "newest_mtime_ns", "stamp"}, and the few newest inputs as (mtime_ns, name), newest first
    inputs: dict[str, Any] = field(default_factory=dict)
    newest: list[tuple[int, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def origin(self, ref: tuple) -> str:
        """Where a sample comes from, for messages and ``manifest.skipped``."""
        if self.kind == "images":
            return ref[0]
        return f"{os.path.basename(self.files[ref[0]])}[{ref[1]}]"


def list_source(src: str | os.PathLike[str]) -> Listing:
    """Enumerate SRC (see the module docstring); :class:`SourceError` naming the problem."""
    text = os.fspath(src)
    local = local_path(text) if isinstance(text, str) else text
    path = Path(os.path.abspath(local))
    if not path.exists():
        raise SourceError(f"SRC {src}: no such file or directory")
    if path.is_file():
        name = path.name.lower()
        if name.endswith(".npz"):
            return _list_npz(path)
        if name.endswith(_TAR_SUFFIXES):
            return _list_tar(path, [path], [None])
        if name.endswith(_H5_SUFFIXES):
            return _list_hdf5(path, [path])
        if name.endswith(_COMPRESSED_TAR):
            raise SourceError(f"SRC {src}: compressed tar shards are not supported; decompress them first")
        raise SourceError(f"SRC {src}: unsupported file type (expected a folder, .tar, .h5/.hdf5 or .npz)")
    if not path.is_dir():
        raise SourceError(f"SRC {src}: not a regular file or folder")
    if (path / MANIFEST_NAME).is_file():
        return _list_manifest_folder(path)
    if (path / PROGRESS_DIR).is_dir():  # its shards are not all there: never read them as a tar folder
        raise SourceError(f"SRC {src}: a conversion into this folder did not finish (no {MANIFEST_NAME}, "
                          f"records in {PROGRESS_DIR}); rerun that conversion to complete it first")
    entries = [e for e in os.scandir(path) if not e.name.startswith(".")]
    names = sorted(e.name for e in entries if e.is_file())
    tars = [n for n in names if n.lower().endswith(_TAR_SUFFIXES)]
    h5s = [n for n in names if n.lower().endswith(_H5_SUFFIXES)]
    if tars and h5s:
        raise SourceError(f"SRC {src}: holds both tar ({tars[0]}) and HDF5 ({h5s[0]}) shards; use one kind")
    compressed = [n for n in names if n.lower().endswith(_COMPRESSED_TAR)]
    if compressed:
        raise SourceError(f"SRC {src}: compressed tar shards ({compressed[0]}) are not supported; "
                          "decompress them first")
    if not (tars or h5s):
        return _list_images(path)
    listing = _list_tar(path, [path / n for n in tars], [None] * len(tars)) if tars else \
        _list_hdf5(path, [path / n for n in h5s])
    sidecars = {n + ".idx" for n in tars}
    others = [n for n in names if n not in tars and n not in h5s and n not in sidecars]
    others += sorted(e.name + "/" for e in entries if e.is_dir())
    kind = "tar" if tars else "HDF5"
    unread = [{"source": e.name, "reason": _not_a_file(e)} for e in entries if not e.is_file() and not e.is_dir()]
    listing.skipped[:0] = [{"source": n, "reason": f"not read: SRC is a folder of {kind} shards (only its "
                            "top-level shard files are read)"} for n in others] + sorted(unread, key=lambda s: s["source"])
    return listing


def _not_a_file(entry: os.DirEntry) -> str:
    """Why a folder entry that is neither a file nor a folder is not read (a shard on a disk that is
    not mounted must not vanish without a word)."""
    try:
        mode = entry.stat().st_mode
    except OSError as e:
        link = f" to {os.readlink(entry.path)!r}" if entry.is_symlink() else ""
        return f"cannot read: broken symlink{link} ({e.strerror})" if link else f"cannot read: {e.strerror}"
    return f"not read: not a regular file ({_file_kind(mode)})"


def _stamp(items: Sequence[tuple[str, int, int]]) -> str:
    h = hashlib.sha256()
    for name, size, mtime in items:
        h.update(f"{name}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


NEWEST_KEPT = 5  # inputs a listing keeps as the newest (Listing.newest), to name them


def _set_stamp(listing: Listing, items: Sequence[tuple[str, int, int]]) -> None:
    """``listing.stamp`` and the summary of the inputs ``(name, size, mtime_ns)`` a refused rerun compares."""
    listing.stamp = _stamp(items)
    names = hashlib.sha256()
    for name, _, _ in items:
        names.update(name.encode("utf-8", "surrogateescape") + b"\0")
    listing.newest = heapq.nlargest(NEWEST_KEPT, ((mtime, name) for name, _, mtime in items))
    listing.inputs = {"count": len(items), "bytes": sum(size for _, size, _ in items), "names": names.hexdigest(),
                      "newest_mtime_ns": listing.newest[0][0] if listing.newest else 0, "stamp": listing.stamp}


def _file_items(root: Path, files: Sequence[Path]) -> list[tuple[str, int, int]]:
    items = []
    for f in files:
        st = f.stat()
        items.append((os.path.relpath(f, root) if f != root else f.name, st.st_size, st.st_mtime_ns))
    return items


# ---------------------------------------------------------------------------------------- images

def _walk_files(top: Path, prefix: str = "", _seen: set[tuple[int, int]] | None = None,
                ) -> Iterator[tuple[str, os.stat_result | OSError]]:
    """``(path relative to top, stat or the error)`` of non-hidden files below ``top``, sorted.

    Symlinks are followed (each real folder once, so link cycles end); a broken one yields its
    OSError (the input is then skipped).
    """
    seen = set() if _seen is None else _seen
    try:
        st_top = top.stat()
        if (st_top.st_dev, st_top.st_ino) in seen:
            return
        seen.add((st_top.st_dev, st_top.st_ino))
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        raise SourceError(f"SRC {top}: cannot list folder: {e.strerror}") from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        rel = prefix + entry.name
        try:
            if entry.is_dir():
                yield from _walk_files(Path(entry.path), rel + "/", seen)
                continue
            st: os.stat_result | OSError = entry.stat()
        except OSError as e:
            st = e
        yield rel, st


def _image_key(rel: str) -> tuple[str, str]:
    """``(key, field)`` for an image file path relative to SRC."""
    directory, _, base = rel.rpartition("/")
    stem, dot, ext = base.rpartition(".")
    if not dot:  # no extension
        stem, ext = base, ""
    key_base = stem.replace(".", "_")
    return (f"{directory}/{key_base}" if directory else key_base), ext.lower()


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return f"file type {stat.S_IFMT(mode):o}"


def _list_images(root: Path) -> Listing:
    entries = sorted(os.scandir(root), key=lambda e: e.name)
    classes = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    top_files = [e.name for e in entries if e.is_file() and not e.name.startswith(".")]
    if classes:  # a class folder that cannot be read would shift the labels of the classes after it
        for e in entries:
            if not (e.name.startswith(".") or e.is_dir() or e.is_file()):
                reason = _not_a_file(e)
                if reason.startswith("cannot read"):
                    raise SourceError(f"{root / e.name}: {reason}; it may be a class folder, and leaving it out "
                                      "would shift the labels (cls) of the classes after it: fix or remove it")
                top_files.append(e.name)
        top_files.sort()
    listing = Listing(kind="images", root=str(root))
    stamps: list[tuple[str, int, int]] = []
    exts: set[str] = set()
    candidates: list[tuple[str, int | None, os.stat_result | OSError]] = []
    if classes:
        listing.extra["classes"] = classes
        for name in top_files:
            listing.skipped.append({"source": name, "reason": "file beside the class folders (not in a class)"})
        for cls, cname in enumerate(classes):
            found = [(rel, cls, st) for rel, st in _walk_files(root / cname, cname + "/")]
            if not any(_image_key(rel)[1] in IMAGE_EXTENSIONS for rel, _, _ in found):
                listing.skipped.append({"source": cname + "/", "reason": f"class folder without image files "
                                        f"(its class index {cls} is kept: classes are the sorted subfolders)"})
            candidates.extend(found)
    else:
        candidates = [(rel, None, st) for rel, st in _walk_files(root)]
    for rel, cls, st in candidates:
        key, ext = _image_key(rel)
        if ext not in IMAGE_EXTENSIONS:
            listing.skipped.append({"source": rel, "reason": f"not an image file (extension {ext or 'none'!r})"})
            continue
        if isinstance(st, OSError):
            listing.skipped.append({"source": rel, "reason": f"cannot read file: {st.strerror}"})
            continue
        if not stat.S_ISREG(st.st_mode):  # a fifo would block the reader forever
            listing.skipped.append({"source": rel, "reason": f"not a regular file ({_file_kind(st.st_mode)})"})
            continue
        try:
            check_key(key)
        except ValueError as e:
            raise SourceError(f"{root / rel}: {e}") from None
        stamps.append((rel, st.st_size, st.st_mtime_ns))
        exts.add(ext)
        listing.keys.append(key)
        listing.refs.append((rel, cls, ext))
        image = member_bytes(f"{key}.{ext}", st.st_size)
        listing.image_sizes.append(image)
        listing.sizes.append(image + (member_bytes(f"{key}.cls", len(str(cls))) if cls is not None else 0))
        listing.image_data_sizes.append(st.st_size)
        listing.data_sizes.append(st.st_size + (8 if cls is not None else 0))
    if not listing.keys:
        what = "is empty" if not candidates and not top_files else "holds no image files"
        raise SourceError(f"SRC {root}: {what} (expected class subfolders of images "
                          f"with extensions {', '.join(sorted(IMAGE_EXTENSIONS))})")
    fields = [FieldInfo(ext, "bytes") for ext in sorted(exts)]
    if classes:
        fields.append(FieldInfo("cls", "int"))
    listing.fields = tuple(sorted(fields, key=lambda f: f.name))
    _set_stamp(listing, stamps)
    return listing


# ------------------------------------------------------------------------------------ tar / hdf5

def _list_manifest_folder(root: Path) -> Listing:
    """A fastdata output folder: each shard checked against its manifest as a dataset checks it
    (size, sample count, identity, fields; ShardError naming it), so a replaced or swapped shard is
    not converted into a new folder with fresh checksums."""
    manifest = Manifest.load(root)
    files = [root / s.name for s in manifest.shards]
    if not files:
        raise SourceError(f"SRC {root}: {MANIFEST_NAME} lists no shards")
    if manifest.format == "tar":
        indexes = [None if s.index is None else str(root / s.index) for s in manifest.shards]
        listing = _list_tar(root, files, indexes, manifest)
    else:
        listing = _list_hdf5(root, files, manifest)
    source = manifest.extra.get("source")
    classes = source.get("classes") if isinstance(source, dict) else None
    if isinstance(classes, list) and all(isinstance(c, str) for c in classes):
        listing.extra["classes"] = classes  # the names of the 'cls' labels go on into the new manifest
    return listing


def _list_tar(root: Path, files: Sequence[Path], indexes: Sequence[str | None],
              manifest: Manifest | None = None) -> Listing:
    from fastdata.shards.tar import TarShardReader

    listing = Listing(kind="tar", root=str(root), files=tuple(map(str, files)), indexes=tuple(indexes))
    names: set[str] = set()
    for i, (path, index) in enumerate(zip(files, indexes)):
        expect = None if manifest is None else manifest.shards[i]
        fields = None if manifest is None else [f.name for f in manifest.fields]
        idx = TarShardReader(path, index=index, expect=expect, fields=fields).index  # ShardError names the shard
        where = os.path.relpath(path, root) if Path(path) != root else Path(path).name
        listing.skipped.extend({"source": f"{where}:{name}", "reason": reason}
                               for name, reason in idx.skipped)
        for j, (key, members) in enumerate(zip(idx.keys, idx.members)):
            _check_source_key(key, path, j)
            listing.keys.append(key)
            listing.refs.append((i, j))
            total = image = data = image_data = 0
            for fld, a, b in members:
                size = member_bytes(f"{key}.{fld}", b - a)
                total += size
                data += b - a
                if fld.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS:
                    image += size
                    image_data += b - a
                names.add(fld)
                listing.field_counts[fld] = listing.field_counts.get(fld, 0) + 1
            listing.sizes.append(total)
            listing.image_sizes.append(image)
            listing.data_sizes.append(data)
            listing.image_data_sizes.append(image_data)
    if not listing.keys:
        raise SourceError(f"SRC {root}: the tar shards hold no samples")
    listing.fields = tuple(FieldInfo(n, "bytes") for n in sorted(names))
    _set_stamp(listing, _file_items(root, files))
    return listing


def _list_hdf5(root: Path, files: Sequence[Path], manifest: Manifest | None = None) -> Listing:
    import h5py

    from fastdata.shards.hdf5 import HDF5ShardReader

    listing = Listing(kind="hdf5", root=str(root), files=tuple(map(str, files)), indexes=(None,) * len(files))
    merged: dict[str, FieldInfo] = {}
    for i, path in enumerate(files):
        expect = None if manifest is None else manifest.shards[i]
        fields = None if manifest is None else manifest.fields
        with HDF5ShardReader(path, expect=expect, fields=fields) as reader:  # ShardError names dataset/shard
            keys, kinds = reader.keys, reader.fields
        infos = []
        with h5py.File(path, "r") as f:
            for name, kind in sorted(kinds.items()):
                ds = f[name]
                fixed = kind == "array" and h5py.check_vlen_dtype(ds.dtype) is None
                infos.append(FieldInfo(name, kind, _dtype_name(ds.dtype) if fixed else None,
                                       tuple(ds.shape[1:]) if fixed else None))
        # vlen data lives in the file's heap, not in the datasets: estimate from the file size
        stored = os.path.getsize(path) // max(1, len(keys))
        per_sample = stored + 1024 * len(infos)
        for info in infos:
            merged[info.name] = merge_field(merged.get(info.name), info, path)
        for j, key in enumerate(keys):
            _check_source_key(key, path, j)
            listing.keys.append(key)
            listing.refs.append((i, j))
            listing.sizes.append(per_sample)
            listing.image_sizes.append(0)
            listing.data_sizes.append(stored)
            listing.image_data_sizes.append(0)
        if set(merged) != {x.name for x in infos}:
            raise SourceError(f"{path}: has fields {sorted(x.name for x in infos)} but earlier HDF5 files have "
                              f"{sorted(merged)}; every file of SRC needs the same fields")
    if not listing.keys:
        raise SourceError(f"SRC {root}: the HDF5 shards hold no samples")
    listing.fields = tuple(merged[n] for n in sorted(merged))
    _set_stamp(listing, _file_items(root, files))
    return listing


def _check_source_key(key: str, path: Path, i: int) -> None:
    """Refuse, before anything is written, a key that fastdata's writers would reject."""
    try:
        check_key(key)
    except ValueError as e:
        raise SourceError(f"{path}: sample {i}: {e}") from None


def merge_field(prev: FieldInfo | None, info: FieldInfo, where: object) -> FieldInfo:
    """Combine two descriptions of one field; dtype/shape become None where they differ."""
    if prev is None:
        return info
    if prev.kind != info.kind:
        raise SourceError(f"{where}: field {info.name!r} is {info.kind!r} here but {prev.kind!r} elsewhere")
    return FieldInfo(info.name, info.kind, prev.dtype if prev.dtype == info.dtype else None,
                     prev.shape if prev.shape == info.shape else None)


def _dtype_name(dt: np.dtype) -> str | None:
    """Same spelling as :func:`fastdata.shards._fields.value_info` (``uint8``, ``>i4``, ``<U2``)."""
    return dtype_spelling(dt)


# ------------------------------------------------------------------------------------------- npz

@dataclass(frozen=True)
class _NpyMember:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    offset: int | None  # byte offset of the raw array data in the .npz (stored, not compressed)


def _npz_members(path: Path) -> list[_NpyMember]:
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
                out.append(_NpyMember(info.filename[:-4], tuple(shape), np.dtype(dtype), fortran, offset))
    except (OSError, ValueError, zipfile.BadZipFile, struct.error) as e:
        raise SourceError(f"SRC {path}: not a readable .npz: {e}") from e
    return out


def _list_npz(path: Path) -> Listing:
    members = _npz_members(path)
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
        fields.append(FieldInfo(m.name + ".npy", "array", _dtype_name(m.dtype), m.shape[1:]))
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
    _set_stamp(listing, _file_items(path.parent, [path]))
    return listing


# ---------------------------------------------------------------------------------------- reading

class SampleUnreadable(SourceError):
    """One input could not be read (e.g. a file vanished); the sample is skipped with this reason."""


class SourceReader:
    """Reads samples by reference in any process (readers opened lazily, per process)."""

    def __init__(self, kind: str, root: str, files: Sequence[str], indexes: Sequence[str | None]):
        self.kind = kind
        self.root = root
        self.files = tuple(files)
        self.indexes = tuple(indexes)
        self._readers: dict[int, Any] = {}
        self._npz: dict[str, np.ndarray] | None = None

    @classmethod
    def of(cls, listing: Listing) -> SourceReader:
        return cls(listing.kind, listing.root, listing.files, listing.indexes)

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self.kind, "root": self.root, "files": self.files, "indexes": self.indexes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def location(self, origin: str) -> str:
        """An origin from :meth:`read` as a path a user can find (``/data/wds-0003.tar[17]``)."""
        base = self.root if os.path.isdir(self.root) else os.path.dirname(self.root)
        return os.path.join(base, origin)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._npz = None

    def read(self, items: Sequence[tuple[str, tuple]]) -> Iterator[tuple[str, dict[str, Any] | SampleUnreadable]]:
        """``(origin, sample or SampleUnreadable)`` for each ``(key, ref)`` in order.

        Consecutive references into one shard are read as ranges (contiguous HDF5 slices).
        """
        if self.kind == "images":
            for key, (rel, cls, ext) in items:
                yield rel, self._image(key, rel, cls, ext)
            return
        if self.kind == "npz":
            arrays = self._arrays()
            for key, (_, i) in items:
                sample: dict[str, Any] = {"__key__": key}
                for name, arr in arrays.items():
                    sample[name + ".npy"] = np.array(arr[i])  # a private, contiguous ndarray (0-d too)
                yield f"{os.path.basename(self.files[0])}[{i}]", sample
            return
        start = 0
        while start < len(items):
            file_i, first = items[start][1]
            stop = start + 1
            while stop < len(items) and items[stop][1] == (file_i, first + stop - start):
                stop += 1
            reader = self._reader(file_i)
            name = os.path.basename(self.files[file_i])
            # HDF5 readers return text/json as their bytes; give writers values of the field's kind
            decode = {f: k for f, k in reader.fields.items() if k in ("text", "json")} if self.kind == "hdf5" else {}
            for j, sample in enumerate(reader.iter_range(first, first + stop - start)):
                key = items[start + j][0]
                if sample["__key__"] != key:
                    raise SourceError(f"{self.files[file_i]}: sample {first + j} has key {sample['__key__']!r}, "
                                      f"expected {key!r}; the shard changed during conversion")
                try:
                    for fld, kind in decode.items():
                        text = bytes(sample[fld]).decode("utf-8")
                        sample[fld] = text if kind == "text" else json.loads(text)
                except ValueError as e:  # UnicodeDecodeError, JSONDecodeError: this sample is skipped, named
                    yield f"{name}[{first + j}]", SampleUnreadable(f"field {fld!r} of sample {key!r} is not valid "
                                                                   f"{kind} ({type(e).__name__}: {e})")
                    continue
                yield f"{name}[{first + j}]", sample
            start = stop

    def _image(self, key: str, rel: str, cls: int | None, ext: str) -> dict[str, Any] | SampleUnreadable:
        try:
            with open(os.path.join(self.root, rel), "rb") as f:
                data = f.read()
        except OSError as e:
            return SampleUnreadable(f"cannot read file: {e.strerror or e}")
        sample: dict[str, Any] = {"__key__": key, ext: data}
        if cls is not None:
            sample["cls"] = cls
        return sample

    def _reader(self, i: int) -> Any:
        reader = self._readers.get(i)
        if reader is None:
            reader = shard_format(self.kind).open(self.files[i], index=self.indexes[i])
            self._readers[i] = reader
        return reader

    def _arrays(self) -> dict[str, np.ndarray]:
        if self._npz is None:
            path = self.files[0]
            arrays: dict[str, np.ndarray] = {}
            for m in _npz_members(Path(path)):
                if m.name == "__key__":
                    continue
                if m.offset is not None:
                    arrays[m.name] = np.memmap(path, dtype=m.dtype, mode="r", offset=m.offset, shape=m.shape,
                                               order="F" if m.fortran else "C")
                else:
                    with np.load(path, allow_pickle=False) as z:
                        arrays[m.name] = z[m.name]
            self._npz = arrays
        return self._npz
