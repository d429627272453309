"""The sidecar index of a tar shard (``shard-000000.tar.idx``): where each sample's members lie.

Little-endian, loads with a few ``np.frombuffer`` calls: magic ``b"FDTARIDX"``; header
``<IIQQQQQQ32s``: version (2), crc32 of the tar's sha256 and the body, tar size, samples ``n``,
members ``m``, fields ``f``, key blob bytes, field blob bytes, the raw sha256 of the tar (32 zero
bytes when unknown, e.g. an index built by a header scan); version 1 has no sha256 (header
``<IIQQQQQQ``, crc32 of the body only) and is still read. Body: int64 ``sample_start[n+1]`` (sample i
owns members ``sample_start[i]:sample_start[i+1]``), int64 ``member_offset[m]`` and
``member_size[m]`` (byte offset and size of each member's DATA in the tar), int64 ``key_end[n]``,
int64 ``field_end[f]``, int32 ``member_field[m]`` (into the sorted field-name table), then the
UTF-8 key blob and field-name blob (name j is ``blob[end[j-1]:end[j]]``). Foreign shards get the
same index by a header scan (:meth:`TarIndex.build`). Design note: ``docs/design/shard-formats.md``.
"""
from __future__ import annotations

import mmap
import os
import struct
import zlib
from collections.abc import Sequence

import numpy as np

from fastdata.errors import ShardError
from fastdata.shards import _tarfmt
from fastdata.shards._tarmembers import group_samples, resolve_links

__all__ = ["INDEX_SUFFIX", "TarIndex"]

INDEX_SUFFIX = ".idx"
_INDEX_VERSION = 2
_INDEX_MAGIC = b"FDTARIDX"
# version, crc32 of the body, tar size, samples, members, fields, key blob bytes, field blob bytes
_INDEX_HEAD_V1 = struct.Struct("<IIQQQQQQ")
# ... plus the tar's sha256 (raw, zeros when unknown); the crc32 covers it and the body
_INDEX_HEAD = struct.Struct("<IIQQQQQQ32s")


class TarIndex:
    """Per sample: key, and per field the (offset, size) of the member's data in the tar.

    Attributes: ``keys`` (tuple of str), ``members`` (``members[i]`` is a tuple of
    ``(field, start, stop)`` byte ranges of sample i's member data, in archive order) and
    ``tar_size`` (bytes of the indexed tar, checked against the file before reading) and ``sha256``
    (hex digest of the tar, recorded by the writer in the sidecar; None when unknown).
    ``skipped`` lists ``(member name, reason)`` of the members that give no sample data: names
    that are not ``<key>.<field>``, symlinks out of the archive or to nothing, devices, fifos
    (only filled by :meth:`build`; directories are not listed). Hardlinks, and symlinks to a
    member of the archive, read their target's data.
    """

    __slots__ = ("keys", "members", "tar_size", "skipped", "sha256")

    def __init__(self, keys: Sequence[str], members: Sequence[Sequence[tuple[str, int, int]]], tar_size: int,
                 sha256: str | None = None):
        if len(keys) != len(members):
            raise ValueError(f"TarIndex needs one member list per key, got {len(keys)} keys, {len(members)} lists")
        self.keys: tuple[str, ...] = tuple(keys)
        # members[i] = ((field, start, stop), ...) with stop = start + size: the hot-path form
        self.members: tuple[tuple[tuple[str, int, int], ...], ...] = tuple(
            tuple((f, int(off), int(off) + int(size)) for f, off, size in m) for m in members)
        self.tar_size = int(tar_size)
        self.skipped: tuple[tuple[str, str], ...] = ()
        if sha256 is not None and (len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256)):
            raise ValueError(f"TarIndex sha256 must be 64 lowercase hex characters, got {sha256!r}")
        self.sha256 = sha256

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TarIndex):
            return NotImplemented
        return (self.keys, self.members, self.tar_size) == (other.keys, other.members, other.tar_size)

    def __repr__(self) -> str:
        return f"TarIndex({len(self)} samples, tar_size={self.tar_size})"

    def fields(self, i: int) -> dict[str, tuple[int, int]]:
        """``{field: (data_offset, size)}`` of sample ``i``."""
        return {f: (a, b - a) for f, a, b in self.members[i]}

    @classmethod
    def build(cls, path: str | os.PathLike[str]) -> TarIndex:
        """Index an uncompressed local tar by parsing its headers from a memory map (data is not read)."""
        shard = os.fspath(path)
        with open(shard, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return cls([], [], 0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                if mm[:2] == b"\x1f\x8b":
                    raise ShardError(f"{shard}: is gzip-compressed; random access needs an uncompressed tar "
                                     "(stream it with iter_tar_stream(gzip.open(path), path))")
                packed = _tarfmt.compression(mm[:_tarfmt.BLOCK])
                if packed is not None:
                    raise ShardError(f"{shard}: is {packed}-compressed; random access needs an uncompressed tar "
                                     "(decompress it first)")
                header, payload = _tarfmt.mmap_source(mm, shard)
                members = list(_tarfmt.walk(header, payload, shard, want_data=False))
                keys: list[str] = []
                groups: list[list[tuple[str, int, int]]] = []
                skipped: list[tuple[str, str]] = []
                for key, fld, offset, sz, _ in group_samples(resolve_links(members, skipped), shard, skipped):
                    if not keys or keys[-1] != key:
                        keys.append(key)
                        groups.append([])
                    groups[-1].append((fld, offset, sz))
        index = cls(keys, groups, size)
        index.skipped = tuple(skipped)
        return index

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the sidecar index (deterministic bytes) atomically."""
        path = os.fspath(path)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(self.to_bytes())
        os.replace(tmp, path)

    def to_bytes(self) -> bytes:
        """The sidecar file contents (layout in the module docstring)."""
        field_names = sorted({f for m in self.members for f, _, _ in m})
        field_id = {f: j for j, f in enumerate(field_names)}
        flat = [x for m in self.members for x in m]
        key_blob, key_end = _blob(self.keys)
        field_blob, field_end = _blob(field_names)
        start = np.zeros(len(self.members) + 1, "<i8")
        np.cumsum([len(m) for m in self.members], out=start[1:])
        offset = np.array([a for _, a, _ in flat], "<i8")
        body = b"".join([
            start.tobytes(),
            offset.tobytes(),
            (np.array([b for _, _, b in flat], "<i8") - offset).tobytes(),
            key_end.tobytes(),
            field_end.tobytes(),
            np.array([field_id[f] for f, _, _ in flat], "<i4").tobytes(),
            key_blob,
            field_blob,
        ])
        sha = bytes.fromhex(self.sha256) if self.sha256 is not None else bytes(32)
        head = _INDEX_MAGIC + _INDEX_HEAD.pack(_INDEX_VERSION, zlib.crc32(body, zlib.crc32(sha)), self.tar_size,
                                               len(self.keys), len(flat), len(field_names), len(key_blob),
                                               len(field_blob), sha)
        return head + body

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TarIndex:
        """Read a sidecar index written by :meth:`save`; ShardError naming the file if it is bad."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ShardError(f"{path}: cannot read tar index: {e}") from e
        try:
            return cls._parse(data)
        except (ValueError, IndexError, UnicodeDecodeError, struct.error) as e:
            raise ShardError(f"{path}: not a valid fastdata tar index: {e}") from e

    @classmethod
    def _parse(cls, data: bytes) -> TarIndex:
        if data[:len(_INDEX_MAGIC)] != _INDEX_MAGIC:
            raise ValueError("bad magic")
        version = _INDEX_HEAD_V1.unpack_from(data, len(_INDEX_MAGIC))[0]
        if version == 1:
            _, crc, tar_size, n, m, nf, kb, fb = _INDEX_HEAD_V1.unpack_from(data, len(_INDEX_MAGIC))
            sha, head = b"", _INDEX_HEAD_V1.size
        elif version == 2:
            _, crc, tar_size, n, m, nf, kb, fb, sha = _INDEX_HEAD.unpack_from(data, len(_INDEX_MAGIC))
            head = _INDEX_HEAD.size
        else:
            raise ValueError(f"unsupported version {version}")
        body = memoryview(data)[len(_INDEX_MAGIC) + head:]
        if len(body) != 8 * (n + 1 + 2 * m + n + nf) + 4 * m + kb + fb or zlib.crc32(body, zlib.crc32(sha)) != crc:
            raise ValueError("truncated or corrupt (size or checksum mismatch)")
        pos = 0

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(body, dtype, count, pos)
            pos += arr.nbytes
            return arr

        start, offset, size = take("<i8", n + 1), take("<i8", m), take("<i8", m)
        key_end, field_end, field_id = take("<i8", n), take("<i8", nf), take("<i4", m)
        keys = _unblob(body[pos:pos + kb], key_end)
        names = _unblob(body[pos + kb:pos + kb + fb], field_end)
        flat = list(zip([names[j] for j in field_id.tolist()], offset.tolist(), (offset + size).tolist()))
        bounds = start.tolist()
        if bounds[0] != 0 or bounds[-1] != m:
            raise ValueError("inconsistent sample table")
        index = cls.__new__(cls)
        index.keys = tuple(keys)
        index.members = tuple(tuple(flat[a:b]) for a, b in zip(bounds, bounds[1:]))
        index.tar_size = tar_size
        index.skipped = ()
        index.sha256 = sha.hex() if sha.strip(b"\0") else None
        return index


def _blob(names: Sequence[str]) -> tuple[bytes, np.ndarray]:
    encoded = [n.encode("utf-8", "surrogateescape") for n in names]
    ends = np.zeros(len(encoded), "<i8")
    np.cumsum([len(e) for e in encoded], out=ends)
    return b"".join(encoded), ends


def _unblob(blob: memoryview, ends: np.ndarray) -> list[str]:
    raw = bytes(blob)
    if raw.isascii():
        text = raw.decode("ascii")
        bounds = [0, *ends.tolist()]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, prev = [], 0
    for end in ends.tolist():
        out.append(raw[prev:end].decode("utf-8", "surrogateescape"))
        prev = end
    return out
