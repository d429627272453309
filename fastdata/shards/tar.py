"""WebDataset-style tar shards: deterministic writer, sidecar index, mmap random-access reader.

A shard ``shard-000000.tar`` holds members ``<key>.<field>`` grouped by sample (see
:mod:`fastdata.shards._keys` for the key splitting rule), readable by ``tar`` and by
``webdataset.WebDataset``. Writing is deterministic (mtime 0, uid/gid 0, empty user/group
names, mode 0o444, PAX format, a sample's fields in sorted order, samples in the given order),
so the same input gives byte-identical shards.

Sidecar index ``shard-000000.tar.idx`` (little-endian, loads with a few ``np.frombuffer`` calls):
magic ``b"FDTARIDX"``; header ``<IIQQQQQQ32s``: version (2), crc32 of the tar's sha256 and the body,
tar size, samples ``n``, members ``m``, fields ``f``, key blob bytes, field blob bytes, the raw
sha256 of the tar (32 zero bytes when unknown, e.g. an index built by a header scan); version 1
has no sha256 (header ``<IIQQQQQQ``, crc32 of the body only) and is still read. Body: int64 ``sample_start[n+1]``
(sample i owns members ``sample_start[i]:sample_start[i+1]``), int64 ``member_offset[m]`` and
``member_size[m]`` (byte offset and size of each member's DATA in the tar), int64 ``key_end[n]``,
int64 ``field_end[f]``, int32 ``member_field[m]`` (into the sorted field-name table), then the
UTF-8 key blob and field-name blob (name j is ``blob[end[j-1]:end[j]]``). Foreign shards get
the same index by a header scan.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import posixpath
import struct
import warnings
import zlib
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from fastdata.errors import ShardError
from fastdata.manifest import ShardInfo
from fastdata.shards import _tarfmt
from fastdata.shards._keys import check_key, encode_value, is_meta, member_name, split_member_name

__all__ = [
    "INDEX_SUFFIX", "EncodedSample", "TarIndex", "TarShardReader", "TarShardWriter", "encode_sample",
    "iter_tar_stream", "write_tar_shard",
]

INDEX_SUFFIX = ".idx"
_INDEX_VERSION = 2
_INDEX_MAGIC = b"FDTARIDX"
# version, crc32 of the body, tar size, samples, members, fields, key blob bytes, field blob bytes
_INDEX_HEAD_V1 = struct.Struct("<IIQQQQQQ")
# ... plus the tar's sha256 (raw, zeros when unknown); the crc32 covers it and the body
_INDEX_HEAD = struct.Struct("<IIQQQQQQ32s")
_CHECKED_SAMPLES = 3  # samples whose tar headers are compared with the index when a reader opens a shard


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
                for key, fld, offset, sz, _ in _group(_resolve_links(members, skipped), shard, skipped):
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


_LINK_HOPS = 16  # symlink chains longer than this are reported, not followed
_STREAM_LINK_BYTES = 64 << 20  # data of the latest regular members kept for hardlinks in a stream


def _link_target(member: _tarfmt.Member) -> str | None:
    """The archive path a link refers to (None: a symlink that leaves the archive)."""
    if member.kind == "hardlink":  # the target's member name as archived
        return _norm(member.link)
    if member.link.startswith("/"):
        return None
    target = posixpath.normpath(posixpath.join(posixpath.dirname(_norm(member.name)), member.link))
    return None if target == ".." or target.startswith("../") else _norm(target)


def _norm(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def _resolve_links(members: Iterable[_tarfmt.Member], skipped: list[tuple[str, str]], *, stream: bool = False,
                   ) -> Iterator[tuple[str, int, int, int, Any]]:
    """``(name, header_offset, data_offset, size, data)`` of every member that has data, in archive order.

    A hardlink (and a symlink to a member of the archive) gives its target's data under its own
    name. Members without data are appended to ``skipped`` as ``(name, reason)``: symlinks that
    leave the archive (refused: never read), links to a member that is not in the archive (in a
    stream: not among the recent members), devices and fifos; directories are structure, not data.
    Random access (``stream=False``) needs the whole member list (a symlink may point forward).
    """
    files: dict[str, tuple[int, int, Any]] = {}
    dirs: set[str] = set()
    kept = 0

    def resolve(m: _tarfmt.Member) -> tuple[int, int, Any] | str:
        seen = m
        for _ in range(_LINK_HOPS):
            target = _link_target(seen)
            if target is None:
                return f"symlink to {seen.link!r} points outside the archive (refused)"
            if target in files:
                return files[target]
            link = links.get(target)
            if link is None:
                if target in dirs:
                    return f"{m.kind} to {m.link!r} names a directory, not a file"
                if stream and m.kind == "hardlink":
                    return (f"hardlink to {m.link!r}: its target is not among the last "
                            f"{_STREAM_LINK_BYTES >> 20} MiB of members read from the stream")
                return f"{m.kind} to {m.link!r}: no such file in the archive"
            seen = link
        return f"{m.kind} to {m.link!r}: more than {_LINK_HOPS} links in a row (a cycle?)"

    links: dict[str, _tarfmt.Member] = {}
    if not stream:
        members = list(members)
        for m in members:
            if m.kind == "file":
                files[_norm(m.name)] = (m.data_offset, m.size, m.data)
            elif m.kind in ("hardlink", "symlink"):
                links[_norm(m.name)] = m
            elif m.kind == "directory":
                dirs.add(_norm(m.name))
    for m in members:
        if m.kind == "file":
            if stream:
                files[_norm(m.name)] = (m.data_offset, m.size, m.data)
                kept += m.size
                while kept > _STREAM_LINK_BYTES and len(files) > 1:
                    old = files.pop(next(iter(files)))
                    kept -= old[1]
            yield m.name, m.offset, m.data_offset, m.size, m.data
        elif m.kind in ("hardlink", "symlink"):
            if stream:
                links[_norm(m.name)] = m
            got = resolve(m)
            if isinstance(got, str):
                skipped.append((m.name, got))
                continue
            yield m.name, m.offset, got[0], got[1], got[2]
        elif m.kind == "directory":
            dirs.add(_norm(m.name))
        else:
            skipped.append((m.name, f"not a regular file ({m.kind})"))


def _group(members: Iterable[tuple[str, int, int, int, Any]], shard: str,
           skipped: list[tuple[str, str]] | None = None) -> Iterator[tuple[str, str, int, int, Any]]:
    """Split member names into (key, field) and enforce that a sample's members are consecutive.

    Members that are not ``<key>.<field>`` are left out and appended to ``skipped``; one warning
    per shard names the first of everything skipped (link problems included).
    """
    seen: set[str] = set()
    current: str | None = None
    fields: set[str] = set()
    skipped = [] if skipped is None else skipped
    for name, header_offset, offset, size, data in members:
        parts = split_member_name(name)
        if parts is None or is_meta(parts[1]) or name.startswith("__"):
            skipped.append((name, "tar member name is not '<key>.<field>'"))
            continue
        key, fld = parts
        if key != current:
            if key in seen:
                raise ShardError(f"{shard}: key {key!r} reappears at byte offset {header_offset} "
                                 "after other keys; members of one sample must be consecutive")
            seen.add(key)
            current, fields = key, set()
        if fld in fields:
            raise ShardError(f"{shard}: duplicate member {name!r} at byte offset {header_offset}")
        fields.add(fld)
        yield key, fld, offset, size, data
    if skipped:
        name, reason = skipped[0]
        warnings.warn(f"{shard}: skipped {len(skipped)} member(s), e.g. {name!r}: {reason}", stacklevel=3)


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
    members = _resolve_links(_tarfmt.walk(header, payload, name, want_data=True), skipped, stream=True)
    for key, fld, _, _, data in _group(members, name, skipped):
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key}
        sample[fld] = data
    if sample is not None:
        yield sample
