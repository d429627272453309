"""Writing tar shards: deterministic members, the sidecar index, an atomic rename into place.

The same samples give byte-identical shards: mtime 0, uid/gid 0, empty user/group names, mode
0o444, PAX format, a sample's fields in sorted order, samples in the given order (member headers
in :mod:`fastdata.shards._tarfmt`). A shard is written under ``<name>.tmp``, hashed on the way,
and renamed (with its index) only when complete.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from fastdata.manifest import ShardInfo
from fastdata.shards import _tarfmt
from fastdata.shards._keys import check_key, encode_value, is_meta, member_name
from fastdata.shards._tarindex import INDEX_SUFFIX, TarIndex

__all__ = ["EncodedSample", "TarShardWriter", "encode_sample", "write_tar_shard"]


class _HashingFile:
    """Write-through file wrapper that hashes and counts what is written."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.pos = 0

    def write(self, data: bytes | memoryview) -> None:
        self.raw.write(data)
        self.sha.update(data)
        self.pos += len(data)


class EncodedSample(NamedTuple):
    """A sample ready to append: key, ``(field, header, data)`` per member, total tar bytes."""

    key: str
    members: tuple[tuple[str, bytes, bytes], ...]
    size: int


def encode_sample(sample: dict[str, Any]) -> EncodedSample:
    """Validate the key and encode a sample's fields (sorted) into tar members."""
    if not isinstance(sample, dict) or "__key__" not in sample:
        raise ValueError(f"a sample must be a dict with a '__key__', got {type(sample).__name__}")
    key = check_key(sample["__key__"])
    members = []
    size = 0
    for fld, value in sorted(sample.items()):
        if is_meta(fld):
            continue
        data = encode_value(fld, value, key=key)
        header = _tarfmt.member_header(member_name(key, fld), len(data))
        members.append((fld, header, data))
        size += len(header) + len(data) + _tarfmt.pad(len(data))
    if not members:
        raise ValueError(f"sample {key!r} has no fields")
    return EncodedSample(key, tuple(members), size)


class TarShardWriter:
    """Incremental writer of one tar shard: ``add(sample)`` ..., then ``close() -> ShardInfo``.

    Writes ``path + ".tmp"`` and renames it (and the sidecar index) into place on close; ``abort()``
    removes the temporary file. Used by :func:`write_tar_shard` and :class:`fastdata.ShardWriter`.
    """

    def __init__(self, path: str | os.PathLike[str], *, index: bool = True):
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._index = index
        self._raw: BinaryIO | None = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._out = _HashingFile(self._raw)
        self._keys: list[str] = []
        self._seen: set[str] = set()
        self._members: list[list[tuple[str, int, int]]] = []

    @property
    def num_samples(self) -> int:
        """Samples added so far."""
        return len(self._keys)

    @property
    def bytes_written(self) -> int:
        """Bytes of the archive so far (without the end-of-archive blocks)."""
        return self._out.pos

    def add(self, sample: dict[str, Any] | EncodedSample) -> int:
        """Append one sample; returns the bytes it added. ValueError on bad/duplicate keys."""
        if self._raw is None:
            raise ValueError(f"{self.path}: writer is closed")
        enc = sample if isinstance(sample, EncodedSample) else encode_sample(sample)
        key = enc.key
        if key in self._seen:
            raise ValueError(f"duplicate key {key!r} in shard {self.path}")
        start = self._out.pos
        members = []
        for fld, header, data in enc.members:
            self._out.write(header)
            members.append((fld, self._out.pos, len(data)))
            self._out.write(data)
            padding = _tarfmt.pad(len(data))
            if padding:
                self._out.write(bytes(padding))
        self._seen.add(key)
        self._keys.append(key)
        self._members.append(members)
        return self._out.pos - start

    def close(self) -> ShardInfo:
        """Finish the archive, write the sidecar index, rename into place; return its ShardInfo."""
        if self._raw is None:
            raise ValueError(f"{self.path}: writer is closed")
        try:
            self._out.write(_tarfmt.end_of_archive(self._out.pos))
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            self._raw = None
            index_name = None
            if self._index:
                index_name = self.path.name + INDEX_SUFFIX
                TarIndex(self._keys, self._members, self._out.pos, self._out.sha.hexdigest()).save(
                    self.path.with_name(index_name))
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return ShardInfo(name=self.path.name, num_samples=len(self._keys), bytes=self._out.pos,
                         sha256=self._out.sha.hexdigest(), index=index_name)

    def abort(self) -> None:
        """Drop the partial shard (safe to call twice)."""
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TarShardWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.abort()


def write_tar_shard(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]]) -> ShardInfo:
    """Write ``samples`` as one deterministic tar shard plus its sidecar index (atomic)."""
    writer = TarShardWriter(path)
    try:
        for sample in samples:
            writer.add(sample)
    except BaseException:
        writer.abort()
        raise
    return writer.close()
