"""Low-level tar format: deterministic member headers and a header walker.

The walker parses 512-byte headers itself (ustar, GNU longname ``L``/longlink ``K``, PAX ``x``
and global ``g`` headers) instead of going through Python's ``tarfile``, so an index can be
built from a memory map without touching member data, and streams can be read with precise
byte offsets in every error.
"""
from __future__ import annotations

import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple

from fastdata.errors import ShardError

BLOCK = 512
RECORD = 20 * BLOCK  # tarfile pads archives to whole records; we do the same for `tar`/tarfile parity
ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\x00", b"7")
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, fifos
_KIND = {b"1": "hardlink", b"2": "symlink", b"3": "character device", b"4": "block device", b"5": "directory",
         b"6": "fifo"}


class Member(NamedTuple):
    """One archive member as :func:`walk` reports it.

    ``kind``: ``"file"`` (regular: ``data_offset``/``size`` locate its data, ``data`` holds it when
    asked for), ``"hardlink"``/``"symlink"`` (``link`` is the target name as archived), or
    ``"directory"``, ``"fifo"``, ``"character device"``, ``"block device"``, ``"other (type 'X')"``
    (no data). ``offset`` is the byte offset of the member's (first) header.
    """

    name: str
    offset: int
    data_offset: int
    size: int
    data: bytes | None
    kind: str
    link: str = ""


def pad(size: int) -> int:
    """Bytes of zero padding after ``size`` bytes of member data."""
    return -size % BLOCK


def member_header(name: str, size: int) -> bytes:
    """Deterministic PAX-format header(s) for a regular file: mtime 0, uid/gid 0, mode 0o444."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def end_of_archive(size: int) -> bytes:
    """Two zero blocks plus padding to a whole record, for an archive of ``size`` bytes so far."""
    total = size + 2 * BLOCK
    return bytes(2 * BLOCK + (-total % RECORD))


def member_bytes(name: str, data_len: int) -> int:
    """Tar bytes of member ``name`` as fastdata writes it: header(s) + data + padding.

    A name that is not ASCII or is over 100 characters gets a PAX extended header first (its own
    header block plus the ``path`` record, padded to whole blocks), as ``tarfile`` writes it.
    """
    header = 512
    if len(name) > 100 or not name.isascii():
        raw = name.encode("utf-8", "surrogateescape")
        record = len(raw) + len(" path=\n")
        record += len(str(record + len(str(record))))  # the record's length, counting its own digits
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes from the file system
            record += len("21 hdrcharset=BINARY\n")
        header += 512 + record + (-record % 512)
    return header + data_len + (-data_len % 512)


def _nti(field: bytes) -> int:
    """Number from a header field: octal text or GNU base-256."""
    if field and field[0] in (0o200, 0o377):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    text = field.split(b"\x00", 1)[0].strip()
    return int(text, 8) if text else 0


def _nts(field: bytes) -> str:
    return field.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def parse_header(buf: bytes, offset: int, shard: str) -> tuple[str, int, bytes]:
    """``(name, size, typeflag)`` of one 512-byte header; ShardError on a bad checksum/field."""
    try:
        stored = _nti(buf[148:156])
        size = _nti(buf[124:136])
    except ValueError as e:
        raise ShardError(f"{shard}: corrupt tar header at byte offset {offset}: {e}") from e
    unsigned = sum(buf) - sum(buf[148:156]) + 256
    if stored != unsigned:
        signed = sum(b - 256 if b > 127 else b for b in buf) - sum(
            b - 256 if b > 127 else b for b in buf[148:156]) + 256
        if stored != signed:
            raise ShardError(f"{shard}: bad tar header checksum at byte offset {offset} "
                             f"(stored {stored}, computed {unsigned}); the shard is corrupt")
    if size < 0:
        raise ShardError(f"{shard}: negative member size in tar header at byte offset {offset}")
    name = _nts(buf[0:100])
    typ = buf[156:157]
    if typ == b"\x00" and name.endswith("/"):
        typ = b"5"  # V7 directory
    prefix = buf[345:500]
    if buf[257:262] == b"ustar" and typ not in (b"L", b"K", b"S") and prefix[0]:
        if buf[257:263] == b"ustar\x00":  # POSIX ustar; GNU headers keep atime/ctime there
            name = _nts(prefix) + "/" + name
    return name, size, typ


def parse_pax(data: bytes, offset: int, shard: str) -> dict[str, str]:
    """Records of a PAX extended header (``"<len> key=value\\n"``)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError as e:
            raise ShardError(f"{shard}: corrupt PAX header at byte offset {offset}") from e
        if space < 0 or length <= 0 or pos + length > len(data):
            raise ShardError(f"{shard}: corrupt PAX header at byte offset {offset}")
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


# A source gives the walker headers and member payloads.
#   header(pos) -> up to 512 bytes ("" at end of file)
#   payload(pos, size, want) -> the ``size`` data bytes at ``pos`` when ``want`` else None;
#                               consumes the block padding; ShardError when the file ends early.
HeaderFn = Callable[[int], bytes]
PayloadFn = Callable[[int, int, bool], "bytes | None"]


def walk(header: HeaderFn, payload: PayloadFn, shard: str, *, want_data: bool) -> Iterator[Member]:
    """Yield a :class:`Member` for every member (regular, link or other), in archive order.

    ``data`` is None unless ``want_data`` (regular members only). Stops at the first zero block. A
    non-empty file that ends without one was cut at a member boundary (tar writers end archives
    with zero blocks): that is a ShardError, not a silently shorter shard.
    """
    pos = 0
    long_name: str | None = None
    long_link: str | None = None
    pax: dict[str, str] = {}
    while True:
        buf = header(pos)
        if not buf:
            if pos == 0:
                return
            raise ShardError(f"{shard}: truncated tar: ends at byte offset {pos} without the end-of-archive "
                             "zero blocks; members after it are missing")
        if len(buf) < BLOCK:
            raise ShardError(f"{shard}: truncated tar: header at byte offset {pos} is cut off "
                             f"after {len(buf)} of {BLOCK} bytes")
        if buf == ZERO_BLOCK:
            _check_end(header, pos, shard)
            return
        name, size, typ = parse_header(buf, pos, shard)
        start = pos + BLOCK
        if typ in (b"L", b"K", b"x", b"X", b"g"):
            data = payload(start, size, True)
            assert data is not None
            if typ == b"L":
                long_name = _nts(data)
            elif typ == b"K":
                long_link = _nts(data)
            elif typ in (b"x", b"X"):
                pax = parse_pax(data, pos, shard)
            pos = start + size + pad(size)
            continue
        if typ == b"S" or any(k.startswith("GNU.sparse.") for k in pax):  # PAX sparse: GNU tar --format=posix -S
            sparse = pax.get("GNU.sparse.name", name)  # the data is a sparse map + fragments, not the file
            raise ShardError(f"{shard}: GNU sparse member {sparse!r} at byte offset {pos} is not supported")
        if "path" in pax:
            name = pax["path"]
        elif long_name is not None:
            name = long_name
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError as e:
                raise ShardError(f"{shard}: bad PAX size {pax['size']!r} at byte offset {pos}") from e
        link = pax.get("linkpath", long_link if long_link is not None else _nts(buf[157:257]))
        long_name, long_link, pax = None, None, {}
        if typ in _NO_DATA:
            yield Member(name, pos, start, 0, None, _KIND[typ], link if typ in (b"1", b"2") else "")
            pos = start
            continue
        data = payload(start, size, want_data and typ in _REGULAR)
        if typ in _REGULAR:
            yield Member(name, pos, start, size, data, "file")
        else:  # unknown type: data is skipped, the member is reported
            yield Member(name, pos, start, size, None, f"other (type {typ.decode('latin-1')!r})")
        pos = start + size + pad(size)


_COMPRESSED = ((b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
               (b"\x04\x22\x4d\x18", "lz4"), (b"\x1f\x8b", "gzip"))


def compression(first: bytes) -> str | None:
    """The compression a file's first block shows by its magic number, when it is no tar header."""
    kind = next((name for magic, name in _COMPRESSED if first.startswith(magic)), None)
    if kind is None:
        return None
    try:
        parse_header(first.ljust(BLOCK, b"\0"), 0, "")
    except ShardError:
        return kind
    return None  # a tar whose first member's name starts like a magic number


def _check_end(header: HeaderFn, pos: int, shard: str) -> None:
    """After the first zero block at ``pos``: only zero blocks (record padding) or bytes that are no
    tar header may follow. A valid header after them is a second archive appended with ``cat a.tar
    b.tar``, whose members tar and webdataset silently leave out: a ShardError, not a shorter shard."""
    end = pos
    while True:
        pos += BLOCK
        try:
            buf = header(pos)
        except ShardError:  # e.g. bytes after a gzip stream's end: every member was read, as before
            return
        if len(buf) < BLOCK:
            return
        if buf == ZERO_BLOCK:
            continue
        try:
            name = parse_header(buf, pos, shard)[0]
        except (ShardError, ValueError):
            return  # trailing bytes that are no header: ignored, as tar ignores them
        raise ShardError(f"{shard}: holds another tar archive after the end of the first (a header for {name!r} "
                         f"at byte offset {pos}, after the end-of-archive zero blocks at byte offset {end}): "
                         "concatenated tars (cat a.tar b.tar) are not read past their first end; "
                         "merge them with tar --concatenate or write one tar per shard")


def mmap_source(mm: bytes | memoryview, shard: str) -> tuple[HeaderFn, PayloadFn]:
    """Header/payload functions over an in-memory (mmap) tar."""
    end = len(mm)

    def header(pos: int) -> bytes:
        return mm[pos:pos + BLOCK]

    def payload(pos: int, size: int, want: bool) -> bytes | None:
        if pos + size > end:
            raise ShardError(f"{shard}: truncated tar: member data at byte offset {pos} needs {size} "
                             f"bytes but the file ends at byte offset {end}")
        return bytes(mm[pos:pos + size]) if want else None

    return header, payload


def stream_source(fileobj: BinaryIO, shard: str) -> tuple[HeaderFn, PayloadFn]:
    """Header/payload functions over a sequential stream (offsets are in the uncompressed stream)."""
    state = {"pos": 0}

    def read(n: int, what: str) -> bytes:
        chunks = []
        left = n
        while left:
            try:
                chunk = fileobj.read(min(left, 16 << 20))
            except (OSError, EOFError, ValueError, zlib.error) as e:  # zlib.error: a corrupt .tar.gz
                raise ShardError(f"{shard}: cannot read {what} at byte offset {state['pos']}: {e}") from e
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
            state["pos"] += len(chunk)
        return b"".join(chunks)

    def header(pos: int) -> bytes:
        block = read(BLOCK, "tar header")
        if pos == 0:  # a compressed file under a plain tar's name: say so, not "truncated tar" or "bad checksum"
            packed = "gzip" if block[:2] == b"\x1f\x8b" else compression(block)
            if packed is not None:
                raise ShardError(f"{shard}: is {packed}-compressed, not a tar; streaming reads .tar and, by their "
                                 "name, .tar.gz/.tgz files")
        return block

    def payload(pos: int, size: int, want: bool) -> bytes | None:
        data = read(size, "member data")
        if len(data) < size:
            raise ShardError(f"{shard}: truncated tar: member data at byte offset {pos} needs {size} "
                             f"bytes but the stream ends at byte offset {pos + len(data)}")
        read(pad(size), "padding")
        return data if want else None

    return header, payload
