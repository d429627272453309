"""WebDataset-style tar shards: deterministic writer, sidecar index, mmap random-access reader.

A shard ``shard-000000.tar`` holds members ``<key>.<field>`` grouped by sample (see
:mod:`fastdata.shards._keys` for the key splitting rule), readable by ``tar`` and by
``webdataset.WebDataset``. This module is the format's public face: :class:`TarShardReader` and
:func:`iter_tar_stream` live here; the writer (deterministic, byte-identical shards) in
:mod:`._tarwrite`, the sidecar index ``shard-000000.tar.idx`` and its layout in :mod:`._tarindex`,
link resolution and sample grouping in :mod:`._tarmembers`, the header walker in :mod:`._tarfmt`.
Design note: ``docs/design/shard-formats.md``.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Collection, Iterator
from typing import Any, BinaryIO

from fastdata.errors import ShardError
from fastdata.manifest import ShardInfo
from fastdata.shards import _tarfmt
from fastdata.shards._keys import encode_value  # noqa: F401 - the value encoding, importable from here too
from fastdata.shards._tarindex import INDEX_SUFFIX, TarIndex
from fastdata.shards._tarmembers import group_samples, resolve_links
from fastdata.shards._tarwrite import EncodedSample, TarShardWriter, encode_sample, write_tar_shard

__all__ = [
    "INDEX_SUFFIX", "EncodedSample", "TarIndex", "TarShardReader", "TarShardWriter", "encode_sample",
    "iter_tar_stream", "write_tar_shard",
]

_CHECKED_SAMPLES = 3  # samples whose tar headers are compared with the index when a reader opens a shard


class TarShardReader:
    """Random access to a local uncompressed tar shard through a memory map.

    ``index``: a :class:`TarIndex` or the path of a sidecar index file. By default the sidecar
    ``<path>.idx`` is loaded when present, else the index is built by a header scan; either way it
    is loaded on first use and cached; a sidecar's entries for the first, middle and last sample must
    match the tar headers there (a tar rewritten beside an old index is a :class:`ShardError`).
    Picklable: the map is opened lazily in each process (never shared across fork).

    ``expect``: the manifest's :class:`~fastdata.manifest.ShardInfo` of this shard (and ``fields``
    its field names). When the index is loaded the shard's identity is checked against it, cheaply
    (no hashing): byte size; the sha256 the writer recorded in the sidecar index; the sample count;
    the tar headers of the first, middle and last sample against the index (a tar replaced under
    its index); fields the manifest does not list. A mismatch is a :class:`ShardError` naming the
    shard (a full sha256 check is ``verify``'s job).
    """

    def __init__(self, path: str | os.PathLike[str], index: TarIndex | str | os.PathLike[str] | None = None, *,
                 expect: ShardInfo | None = None, fields: Collection[str] | None = None):
        self.path = os.fspath(path)
        self._index: TarIndex | None = index if isinstance(index, TarIndex) else None
        self._index_path = None if index is None or isinstance(index, TarIndex) else os.fspath(index)
        self._expect = expect
        self._fields = None if fields is None else frozenset(fields)
        self._mm: mmap.mmap | None = None
        self._pid: int | None = None

    @property
    def index(self) -> TarIndex:
        """The shard's :class:`TarIndex` (sidecar or header scan), checked against the file size."""
        if self._index is None:
            sidecar = self._index_path or self.path + INDEX_SUFFIX
            if self._index_path is None and not os.path.exists(sidecar):
                index = TarIndex.build(self.path)
            else:
                index = TarIndex.load(sidecar)
            try:
                size = os.path.getsize(self.path)
            except OSError as e:
                raise ShardError(f"{self.path}: cannot open shard: {e}") from e
            if index.tar_size != size:
                raise ShardError(f"{self.path}: index {sidecar} is for a {index.tar_size}-byte tar but the shard "
                                 f"has {size} bytes; the shard was changed or truncated (rebuild the index)")
            scanned = self._index_path is None and not os.path.exists(sidecar)
            if self._expect is not None or self._fields is not None:
                self._check_identity(index, sidecar, size, scanned=scanned)
            elif not scanned:  # no manifest: still refuse a sidecar left beside a rewritten same-size tar
                self._check_headers(index, sidecar, f"the tar was changed after {sidecar} was written "
                                                    "(delete it: a header scan rebuilds the index)")
            self._index = index
        return self._index

    def _check_identity(self, index: TarIndex, sidecar: str, size: int, *, scanned: bool) -> None:
        """The shard is the one the manifest describes (see the class docstring); ShardError if not."""
        expect = self._expect
        replaced = "the shard was replaced or changed after the manifest was written (run verify)"
        if expect is not None:
            if size != expect.bytes:
                raise ShardError(f"{self.path}: has {size} bytes but the manifest says {expect.bytes}; {replaced}")
            if index.sha256 is not None and index.sha256 != expect.sha256:
                raise ShardError(f"{self.path}: its index {sidecar} was written for a tar with sha256 {index.sha256} "
                                 f"but the manifest says {expect.sha256}; {replaced}")
            if len(index) != expect.num_samples:
                raise ShardError(f"{self.path}: has {len(index)} samples but the manifest says "
                                 f"{expect.num_samples}; {replaced}")
        if self._fields is not None:
            unknown = sorted({f for m in index.members for f, _, _ in m} - self._fields)
            if unknown:
                raise ShardError(f"{self.path}: holds fields {unknown} that the manifest does not list "
                                 f"(manifest fields: {sorted(self._fields)}); {replaced}")
        if not scanned:  # a header scan is the file's own truth
            self._check_headers(index, sidecar, replaced)

    def _check_headers(self, index: TarIndex, sidecar: str, replaced: str) -> None:
        """The tar headers of the first, middle and last sample name the members the index expects.

        A member that is a link reads its target's data, after the target's header: on a mismatch
        the index is compared with a full header scan, which decides.
        """
        if not len(index):
            return
        with open(self.path, "rb") as f:
            n = len(index)
            for i in sorted({0, n // 2, n - 1})[:_CHECKED_SAMPLES]:
                fld, start, stop = index.members[i][0]
                if start < _tarfmt.BLOCK:
                    raise ShardError(f"{self.path}: index {sidecar} places sample {i} at byte offset {start}; {replaced}")
                f.seek(start - _tarfmt.BLOCK)
                name, hsize, typ = _tarfmt.parse_header(f.read(_tarfmt.BLOCK), start - _tarfmt.BLOCK, self.path)
                want = f"{index.keys[i]}.{fld}"
                same_name = name == want or (want.isascii() and len(want) > 100 and name == want[:100]) \
                    or not want.isascii()
                if typ not in _tarfmt._REGULAR or not same_name or hsize not in (stop - start, 0):
                    if TarIndex.build(self.path) == index:  # links: the headers before their targets' data
                        return
                    raise ShardError(f"{self.path}: the tar header at byte offset {start - _tarfmt.BLOCK} is for "
                                     f"{name!r} ({hsize} bytes) but index {sidecar} expects {want!r} "
                                     f"({stop - start} bytes) there; {replaced}")

    def __len__(self) -> int:
        return len(self.index)

    @property
    def keys(self) -> tuple[str, ...]:
        """Sample keys in shard order."""
        return self.index.keys

    def _map(self) -> mmap.mmap:
        if self._mm is None or self._pid != os.getpid():
            index = self.index
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != index.tar_size:
                    raise ShardError(f"{self.path}: shard has {size} bytes but its index expects "
                                     f"{index.tar_size}; it was changed or truncated")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
            self._pid = os.getpid()
        return self._mm  # type: ignore[return-value]

    def read(self, i: int, fields: Collection[str] | None = None) -> dict[str, Any]:
        """Sample ``i`` as ``{"__key__": key, field: bytes}`` (only ``fields`` when given)."""
        index = self.index
        n = len(index.keys)
        if isinstance(fields, str):
            fields = (fields,)
        if not 0 <= i < n:
            raise IndexError(f"{self.path}: sample index {i} out of range for {n} samples")
        mm = self._map()
        out: dict[str, Any] = {"__key__": index.keys[i]}
        for fld, a, b in index.members[i]:
            if fields is None or fld in fields:
                out[fld] = mm[a:b]
        return out

    def iter_range(self, start: int = 0, stop: int | None = None,
                   fields: Collection[str] | None = None) -> Iterator[dict[str, Any]]:
        """Samples ``start..stop-1`` in order (same values as :meth:`read`)."""
        index = self.index
        n = len(index.keys)
        stop = n if stop is None else stop
        if isinstance(fields, str):
            fields = (fields,)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"{self.path}: range {start}:{stop} out of bounds for {n} samples")
        if start == stop:
            return
        mm = self._map()
        keys, members = index.keys, index.members
        for i in range(start, stop):
            out: dict[str, Any] = {"__key__": keys[i]}
            if fields is None:
                for fld, a, b in members[i]:
                    out[fld] = mm[a:b]
            else:
                for fld, a, b in members[i]:
                    if fld in fields:
                        out[fld] = mm[a:b]
            yield out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.iter_range()

    def close(self) -> None:
        """Close the memory map (reopened on next use; safe to call twice)."""
        if self._mm is not None and self._pid == os.getpid():
            self._mm.close()
        self._mm = None
        self._pid = None

    def __enter__(self) -> TarShardReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "index": self._index, "index_path": self._index_path, "expect": self._expect,
                "fields": self._fields}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._index = state["index"]
        self._index_path = state["index_path"]
        self._expect = state.get("expect")
        self._fields = state.get("fields")
        self._mm = None
        self._pid = None

    def __repr__(self) -> str:
        return f"TarShardReader({self.path!r})"


def iter_tar_stream(fileobj: BinaryIO, name: str, skipped: list[tuple[str, str]] | None = None,
                    ) -> Iterator[dict[str, Any]]:
    """Samples of a tar stream (e.g. gzip or remote), grouped by consecutive key.

    ``name`` is used in error messages. A key that reappears non-consecutively, a truncated
    stream or a corrupt header raise ShardError naming ``name`` and the (uncompressed) byte offset.
    Members that give no data are appended to ``skipped`` as ``(member, reason)`` (see
    :meth:`TarIndex.build`; a hardlink reads its target when that was among the last 64 MiB).
    """
    skipped = [] if skipped is None else skipped
    header, payload = _tarfmt.stream_source(fileobj, name)
    sample: dict[str, Any] | None = None
    members = resolve_links(_tarfmt.walk(header, payload, name, want_data=True), skipped, stream=True)
    for key, fld, _, _, data in group_samples(members, name, skipped):
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key}
        sample[fld] = data
    if sample is not None:
        yield sample
