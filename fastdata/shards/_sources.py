"""Input enumeration for ``fastdata shard``: what SRC holds, as a sorted list of samples.

:func:`list_source` tells the kind of SRC (an image folder, tar or HDF5 shards, a fastdata output
folder, a ``.npz``) and hands it to that kind's lister (``_src_images``, ``_src_shards``,
``_src_npz``), which returns a :class:`Listing` without reading sample data. Worker processes then
read samples by reference through :class:`SourceReader` (readers open lazily, per process). A
folder holding ``.fastdata-progress`` but no manifest (an unfinished conversion) is refused;
compressed tar shards are refused. Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastdata.errors import SourceError
from fastdata.io import local_path
from fastdata.manifest import MANIFEST_NAME
from fastdata.shards._formats import HDF5, TAR, shard_format
from fastdata.shards._listing import NEWEST_KEPT, PROGRESS_DIR, Listing, not_a_file
from fastdata.shards._src_images import list_images
from fastdata.shards._src_npz import list_npz, npz_members
from fastdata.shards._src_shards import list_hdf5, list_manifest_folder, list_tar
from fastdata.shards._tarindex import INDEX_SUFFIX

__all__ = ["NEWEST_KEPT", "PROGRESS_DIR", "Listing", "SampleUnreadable", "SourceError", "SourceReader", "list_source"]

_TAR_SUFFIXES = TAR.source_suffixes
_H5_SUFFIXES = HDF5.source_suffixes
_COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


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
            return list_npz(path)
        if name.endswith(_TAR_SUFFIXES):
            return list_tar(path, [path], [None])
        if name.endswith(_H5_SUFFIXES):
            return list_hdf5(path, [path])
        if name.endswith(_COMPRESSED_TAR):
            raise SourceError(f"SRC {src}: compressed tar shards are not supported; decompress them first")
        raise SourceError(f"SRC {src}: unsupported file type (expected a folder, .tar, .h5/.hdf5 or .npz)")
    if not path.is_dir():
        raise SourceError(f"SRC {src}: not a regular file or folder")
    if (path / MANIFEST_NAME).is_file():
        return list_manifest_folder(path)
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
        return list_images(path)
    listing = list_tar(path, [path / n for n in tars], [None] * len(tars)) if tars else \
        list_hdf5(path, [path / n for n in h5s])
    sidecars = {n + INDEX_SUFFIX for n in tars}
    others = [n for n in names if n not in tars and n not in h5s and n not in sidecars]
    others += sorted(e.name + "/" for e in entries if e.is_dir())
    kind = "tar" if tars else "HDF5"
    unread = [{"source": e.name, "reason": not_a_file(e)} for e in entries if not e.is_file() and not e.is_dir()]
    listing.skipped[:0] = [{"source": n, "reason": f"not read: SRC is a folder of {kind} shards (only its "
                            "top-level shard files are read)"} for n in others] + sorted(unread, key=lambda s: s["source"])
    return listing


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
            for m in npz_members(Path(path)):
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
