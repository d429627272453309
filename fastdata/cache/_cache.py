"""Preprocessing cache: compute the deterministic part of a transform once, read it memory-mapped after.

A :class:`Cache` is a directory of *stores*. A store holds, for one dataset and one deterministic
transform, every sample's outputs as fixed-shape arrays in preallocated files, plus one valid byte
per sample (the layout and the crash-safety argument: ``docs/design/cache-store.md``).

The store key combines the fingerprint the dataset passes (manifest fingerprint, i.e. the shard
checksums, plus the deterministic transform's fingerprint), the number of samples and
:data:`CACHE_FORMAT_VERSION`; change any of them and a new store is used, so nothing stale is
ever served. Stores are filled lazily by whichever processes read the data, or ahead of time with
``ShardedDataset.build_cache`` (``fastdata cache build``). With ``max_bytes`` the directory is kept under a size limit
by evicting whole stores, least recently used first, never one that a process has open.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np

from fastdata._util import byte_limit
from fastdata.cache._io import disk_usage, try_lock
from fastdata.cache._layout import (
    CACHE_FORMAT_VERSION,
    LAST_USED,
    OPEN_LOCK,
    REFUSED,
    VALID_NAME,
    FieldLayout,
    parse_fields,
    read_meta,
)
from fastdata.cache._store import Store
from fastdata.errors import CacheError
from fastdata.io import is_url, local_path

__all__ = ["CACHE_FORMAT_VERSION", "Cache", "FieldLayout", "Store", "StoreInfo", "store_key"]

# Leftovers of a crashed store creation older than this are deleted by list()/evict(); a live
# creation lives for milliseconds.
_STALE_TMP_S = 600.0


@dataclass(frozen=True)
class StoreInfo:
    """What :meth:`Cache.list` reports about one store."""

    path: Path
    key: str
    fingerprint: str
    format_version: int
    num_samples: int
    num_valid: int
    size_bytes: int  # on disk (allocated blocks)
    last_used: float  # seconds since the epoch
    fields: tuple[FieldLayout, ...] | None
    in_use: bool  # open in some process right now
    problem: str | None = None  # why the store cannot be opened (damaged metadata), None when it can

    @property
    def fill_ratio(self) -> float:
        return self.num_valid / self.num_samples if self.num_samples else 0.0

    @property
    def sample_nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields) if self.fields else 0


def _as_int(value: Any) -> int:
    """An integer of meta.json for listing; 0 when a damaged store holds something else there."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _files_problem(path: Path, num_samples: int, fields: list[FieldLayout], valid: np.ndarray | None) -> str | None:
    """Why the store's files do not match its layout (what opening it would refuse), or None: cheap
    checks of the file sizes and of the valid map's bytes, so that a damaged store is listed as such."""
    for f in fields:
        try:
            size = os.stat(path / f.file).st_size
        except OSError as e:
            return f"cache store {path}: cannot stat {f.file} (field {f.name!r}): {e.strerror}"
        if size != num_samples * f.nbytes:
            return (f"cache store {path}: {f.file} has {size} bytes, expected {num_samples * f.nbytes} "
                    f"({num_samples} samples x {f.nbytes} bytes of field {f.name!r})")
    if valid is not None and len(valid) != num_samples:
        return f"cache store {path}: {VALID_NAME} has {len(valid)} bytes, expected {num_samples}"
    if valid is not None and len(valid) and int(valid.max()) > 1:
        bad = int(np.flatnonzero(valid > 1)[0])
        return f"cache store {path}: {VALID_NAME} holds byte {int(valid[bad])} for sample {bad} (only 0 and 1 are written)"
    return None


def store_key(fingerprint: str, num_samples: int) -> str:
    """Directory name of the store for ``fingerprint`` and ``num_samples`` in this cache format."""
    digest = hashlib.sha256(f"fastdata-cache\n{CACHE_FORMAT_VERSION}\n{num_samples}\n{fingerprint}".encode())
    return f"v{CACHE_FORMAT_VERSION}-{digest.hexdigest()[:40]}"


def _is_store_dir(name: str) -> bool:
    head, _, digest = name.partition("-")
    return head[:1] == "v" and head[1:].isdigit() and len(digest) == 40 and all(c in "0123456789abcdef" for c in digest)


class Cache:
    """A cache directory of memory-mapped stores.

    Args:
        directory: where stores live (created on first use). Local disk: locks are per host.
        max_bytes: size limit of the directory (bytes, or a size such as ``"500GB"``); creating a store first
            evicts least recently used stores that are not open anywhere. None: no limit.
        fsync: flush each sample's data to disk before marking it valid, so that a power loss can
            never expose a half-written sample (a process crash never can, even without it).
            Costs one disk flush per sample while filling; reading is unaffected.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int | str | None = None,
                 fsync: bool = False) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"directory must be a non-empty path, got {directory!r}")
        if max_bytes is not None:  # "500GB" as RemoteShards(max_bytes=) and `--max-bytes` take it
            try:
                max_bytes = byte_limit(max_bytes, name="max_bytes")
            except ValueError:
                raise ValueError(f"max_bytes must be a positive int, a size such as '500GB', or None, "
                                 f"got {max_bytes!r}") from None
        if not isinstance(fsync, bool):
            raise ValueError(f"fsync must be a bool, got {fsync!r}")
        text = os.fspath(directory)
        if is_url(text):
            raise ValueError(f"directory must be a local path (the cache is memory-mapped), got the URL {text!r}")
        self.directory = Path(local_path(text)).absolute()
        self.max_bytes = max_bytes
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"Cache({str(self.directory)!r}, max_bytes={self.max_bytes!r}, fsync={self.fsync!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cache):
            return NotImplemented
        return (self.directory, self.max_bytes, self.fsync) == (other.directory, other.max_bytes, other.fsync)

    def __hash__(self) -> int:
        return hash((self.directory, self.max_bytes, self.fsync))

    def open_store(self, *, fingerprint: str, num_samples: int) -> Store:
        """Open (creating if needed) the store for ``fingerprint`` with ``num_samples`` samples.

        ``fingerprint`` must identify the source data and the deterministic transform exactly;
        the cache adds its own format version. The store is held open (safe from eviction)
        until :meth:`Store.close`, in this process and in every process it is pickled to.
        """
        if not isinstance(fingerprint, str) or not fingerprint or "\0" in fingerprint:
            raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        store = Store(self, store_key(fingerprint, int(num_samples)), fingerprint=fingerprint,
                      num_samples=int(num_samples))
        store._ensure_open()
        return store

    # ----- housekeeping --------------------------------------------------------------------
    def _store_dirs(self) -> list[Path]:
        try:
            entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except NotADirectoryError as e:
            raise CacheError(f"cache directory {self.directory}: not a directory") from e
        except OSError as e:
            raise CacheError(f"cache directory {self.directory}: cannot list it: {e.strerror}") from e
        out = []
        now = time.time()
        for e in entries:
            if e.name.startswith(".trash-"):
                shutil.rmtree(e.path, ignore_errors=True)  # an evictor died before finishing
            elif e.name.startswith(".tmp-"):
                try:
                    if now - e.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
                        shutil.rmtree(e.path, ignore_errors=True)
                except FileNotFoundError:
                    pass
            elif _is_store_dir(e.name) and e.is_dir(follow_symlinks=False):
                out.append(Path(e.path))
        return out

    def _info(self, path: Path) -> StoreInfo | None:
        try:
            meta = read_meta(path)
            fields = parse_fields(path, meta)
        except CacheError as e:
            if not path.exists():
                return None
            try:
                meta = read_meta(path)  # the layout is damaged, the rest may still say what the store was
            except CacheError:
                meta = {}
            if not isinstance(meta, dict):
                meta = {}
            fields, problem = None, str(e)
        else:
            problem = None
            # its first put was refused (larger than max_bytes or the disk): it holds nothing; unless some
            # process has it open (and may try again), it goes
            if fields is None and meta.get(REFUSED) is not None and self._delete(path):
                return None
        num_samples = _as_int(meta.get("num_samples"))
        num_valid = 0
        if fields is not None:
            try:
                valid = np.fromfile(path / VALID_NAME, dtype=np.uint8)
                num_valid = int(np.count_nonzero(valid))
            except (OSError, ValueError) as e:
                valid, problem = None, f"cache store {path}: cannot read {VALID_NAME}: {e}"
            if problem is None:
                problem = _files_problem(path, num_samples, fields, valid)
            if problem is not None and not path.exists():  # evicted or removed while we looked
                return None
        try:
            last_used = os.stat(path / LAST_USED).st_mtime
        except FileNotFoundError:
            last_used = 0.0
        return StoreInfo(
            path=path, key=path.name, fingerprint=str(meta.get("fingerprint", "")),
            format_version=_as_int(meta.get("cache_format")), num_samples=num_samples, num_valid=num_valid,
            size_bytes=disk_usage(path), last_used=last_used,
            fields=tuple(fields) if fields is not None else None, in_use=self._in_use(path), problem=problem,
        )

    @staticmethod
    def _in_use(path: Path) -> bool:
        try:
            fd = os.open(path / OPEN_LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return not try_lock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)  # also drops our probe lock

    def list(self) -> list[StoreInfo]:
        """All stores, most recently used first. A store whose first put was refused (larger than
        ``max_bytes`` or the disk) holds nothing: unless a process has it open, it is removed, not listed."""
        infos = [i for i in (self._info(p) for p in self._store_dirs()) if i is not None]
        return sorted(infos, key=lambda i: i.last_used, reverse=True)

    def info(self, key: str) -> StoreInfo:
        """The :class:`StoreInfo` of the store with this key (``Store.key``)."""
        info = self._info(self.directory / key) if _is_store_dir(key) else None
        if info is None:
            raise CacheError(f"cache directory {self.directory}: no store {key!r}")
        return info

    def total_bytes(self) -> int:
        """Disk space all stores take."""
        return sum(disk_usage(p) for p in self._store_dirs())

    def _delete(self, path: Path) -> bool:
        """Delete one store unless some process has it open. True when it is gone."""
        trash = self.directory / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(path / OPEN_LOCK, os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # damaged (no process can have it open) or already gone
        try:
            if fd is not None and not try_lock(fd, fcntl.LOCK_EX):
                return False
            try:
                os.rename(path, trash)  # atomic: openers now see no store (or a new one)
            except FileNotFoundError:
                return True
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def remove(self, fingerprint_or_prefix: str) -> list[StoreInfo]:
        """Remove the stores whose fingerprint or key starts with ``fingerprint_or_prefix``.

        Raises CacheError when nothing matches, when the prefix matches several different
        fingerprints (give more characters), or when a matching store is open in a process.
        """
        prefix = fingerprint_or_prefix
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"fingerprint_or_prefix must be a non-empty str, got {prefix!r}")
        matches = [i for i in self.list() if i.fingerprint.startswith(prefix) or i.key.startswith(prefix)]
        if not matches:
            raise CacheError(f"cache directory {self.directory}: no store matches {prefix!r}")
        fingerprints = sorted({i.fingerprint for i in matches})
        if len(fingerprints) > 1:
            raise CacheError(f"cache directory {self.directory}: {prefix!r} matches {len(fingerprints)} "
                             f"fingerprints ({', '.join(f[:16] for f in fingerprints)}); give a longer prefix")
        removed = []
        for info in matches:
            if not self._delete(info.path):
                raise CacheError(f"cache store {info.path}: it is open in a running process; close it first")
            removed.append(info)
        return removed

    def evict(self) -> list[StoreInfo]:
        """Delete least recently used stores (not open anywhere) until the total is <= max_bytes.

        Returns the removed stores. Does nothing without ``max_bytes``.
        """
        return self._evict(reserve=0, keep=None)

    def _evict(self, *, reserve: int, keep: str | None) -> list[StoreInfo]:
        if self.max_bytes is None:
            return []
        infos = self.list()
        total = sum(i.size_bytes for i in infos) + reserve
        removed = []
        for info in sorted(infos, key=lambda i: i.last_used):
            if total <= self.max_bytes:
                break
            if info.key == keep or info.in_use:
                continue
            if self._delete(info.path):
                total -= info.size_bytes
                removed.append(info)
        return removed

    def make_room(self, nbytes: int, *, keep: str) -> None:
        """Called before a store allocates ``nbytes``: evict so that it fits under max_bytes."""
        if self.max_bytes is None:
            return
        if nbytes > self.max_bytes:
            raise CacheError(f"cache directory {self.directory}: a store of {nbytes} bytes does not fit in "
                             f"max_bytes={self.max_bytes}")
        self._evict(reserve=nbytes, keep=keep)
        used = sum(disk_usage(p) for p in self._store_dirs() if p.name != keep)
        if used + nbytes > self.max_bytes:
            raise CacheError(f"cache directory {self.directory}: {nbytes} bytes for a new store do not fit in "
                             f"max_bytes={self.max_bytes}: {used} bytes are held by stores open in running processes")
