"""What planning knows about a conversion's SRC: the :class:`Listing`, and the helpers every source kind shares.

A listing holds every sample's key, a small picklable reference to read it later, and estimates of
its stored size (as tar bytes and as HDF5 data), without reading sample data; plus the input stamp
(names, sizes, mtimes) a rerun compares. Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import hashlib
import heapq
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdata.errors import SourceError
from fastdata.manifest import FieldInfo
from fastdata.shards._keys import check_key

__all__ = ["NEWEST_KEPT", "PROGRESS_DIR", "Listing", "check_source_key", "file_items", "file_kind", "not_a_file",
           "set_stamp"]

PROGRESS_DIR = ".fastdata-progress"  # a conversion's records in DEST until its manifest is written
NEWEST_KEPT = 5  # inputs a listing keeps as the newest (Listing.newest), to name them


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


def not_a_file(entry: os.DirEntry) -> str:
    """Why a folder entry that is neither a file nor a folder is not read (a shard on a disk that is
    not mounted must not vanish without a word)."""
    try:
        mode = entry.stat().st_mode
    except OSError as e:
        link = f" to {os.readlink(entry.path)!r}" if entry.is_symlink() else ""
        return f"cannot read: broken symlink{link} ({e.strerror})" if link else f"cannot read: {e.strerror}"
    return f"not read: not a regular file ({file_kind(mode)})"


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return f"file type {stat.S_IFMT(mode):o}"


def _stamp(items: Sequence[tuple[str, int, int]]) -> str:
    h = hashlib.sha256()
    for name, size, mtime in items:
        h.update(f"{name}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def set_stamp(listing: Listing, items: Sequence[tuple[str, int, int]]) -> None:
    """``listing.stamp`` and the summary of the inputs ``(name, size, mtime_ns)`` a refused rerun compares."""
    listing.stamp = _stamp(items)
    names = hashlib.sha256()
    for name, _, _ in items:
        names.update(name.encode("utf-8", "surrogateescape") + b"\0")
    listing.newest = heapq.nlargest(NEWEST_KEPT, ((mtime, name) for name, _, mtime in items))
    listing.inputs = {"count": len(items), "bytes": sum(size for _, size, _ in items), "names": names.hexdigest(),
                      "newest_mtime_ns": listing.newest[0][0] if listing.newest else 0, "stamp": listing.stamp}


def file_items(root: Path, files: Sequence[Path]) -> list[tuple[str, int, int]]:
    items = []
    for f in files:
        st = f.stat()
        items.append((os.path.relpath(f, root) if f != root else f.name, st.st_size, st.st_mtime_ns))
    return items


def check_source_key(key: str, path: Path, i: int) -> None:
    """Refuse, before anything is written, a key that fastdata's writers would reject."""
    try:
        check_key(key)
    except ValueError as e:
        raise SourceError(f"{path}: sample {i}: {e}") from None
