"""Creating a cache store's folder and files: complete before it appears, reserved before it is filled.

A store folder is made complete (locks, ``meta.json``) under a temporary name and renamed into
place, so no process ever sees a half-made store; when several race, the first rename wins. A
process holds the store's ``open.lock`` shared while it has the store open, which keeps eviction
(an exclusive lock) away. The field files are preallocated in full when the first put defines the
layout; a reservation that fails gives its space back. Design note: ``docs/design/cache-store.md``.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastdata.cache._io import DISK_FULL, preallocate, write_json_atomic
from fastdata.cache._layout import (
    LAST_USED,
    LAYOUT_LOCK,
    META_NAME,
    OPEN_LOCK,
    REFUSED,
    VALID_NAME,
    FieldLayout,
    read_meta,
)
from fastdata.errors import CacheError

__all__ = ["O_CLOEXEC", "acquire_open_lock", "allocate_files", "create_store_dir", "mark_refused", "release_files"]

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def acquire_open_lock(path: Path, create: Callable[[], None]) -> int:
    """A descriptor of store ``path``'s ``open.lock`` holding it shared; ``create()`` makes the store
    when it does not exist (or was evicted while this process waited for the lock)."""
    lock_path = path / OPEN_LOCK
    for _ in range(1000):
        try:
            fd = os.open(lock_path, os.O_RDONLY | O_CLOEXEC)
        except FileNotFoundError:
            create()
            if path.is_dir() and not lock_path.exists():
                raise CacheError(f"cache store {path}: no {OPEN_LOCK} (not made by fastdata, or damaged); "
                                 "remove it with `fastdata cache rm`") from None
            continue
        except OSError as e:  # e.g. a store of another user
            raise CacheError(f"cache store {path}: cannot open {OPEN_LOCK}: {e}") from e
        # An evictor holds the exclusive lock only while it renames the store away.
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as e:  # a file system without flock (some FUSE mounts)
            os.close(fd)
            raise CacheError(f"cache store {path}: cannot lock {OPEN_LOCK}: {e} (the cache needs a "
                             "local file system with flock)") from e
        try:
            st = os.stat(lock_path)
            same = (st.st_ino, st.st_dev) == (os.fstat(fd).st_ino, os.fstat(fd).st_dev)
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the store was evicted while we waited: create it anew
    raise CacheError(f"cache store {path}: could not open it (it keeps being removed)")


def create_store_dir(path: Path, meta: dict[str, Any], *, fsync: bool) -> None:
    """Create the store folder ``path`` complete (locks, ``meta.json`` holding ``meta`` and its
    creation time) and rename it into place, so no process ever sees a half-made store; when several
    race, the first rename wins."""
    root = path.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"cache directory {root}: cannot create it: {e}") from e
    tmp = root / f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for name in (OPEN_LOCK, LAYOUT_LOCK, LAST_USED):
            (tmp / name).touch()
        write_json_atomic(tmp / META_NAME, {**meta, "created": time.time()}, fsync=fsync)
        try:
            os.rename(tmp, path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    except OSError as e:
        raise CacheError(f"cache store {path}: cannot create it: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def allocate_files(path: Path, fields: list[FieldLayout], num_samples: int, *, make_room: Callable[[int], None],
                   fsync: bool) -> None:
    """Preallocate the field files and ``valid.bin`` of store ``path`` for ``num_samples`` samples,
    after ``make_room(bytes)`` evicted what must go; on failure nothing is left (CacheError)."""
    n = num_samples
    need = sum(n * f.nbytes for f in fields) + n
    make_room(need)
    files = [(f.file, n * f.nbytes) for f in fields] + [(VALID_NAME, n)]
    for name, nbytes in files:
        file = path / name
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_CLOEXEC, 0o644)
            try:
                preallocate(fd, nbytes)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            release_files(path, fields)  # give the space back
            if e.errno in DISK_FULL:
                raise CacheError(f"cache store {path}: disk full: cannot reserve {need} bytes "
                                 f"({n} samples x {need // n} bytes) for {name}: {e.strerror}") from e
            raise CacheError(f"cache store {path}: cannot create {name}: {e}") from e


def release_files(path: Path, fields: list[FieldLayout]) -> None:
    """Delete the files :func:`allocate_files` made for ``fields`` (a layout that was not written)."""
    for name in [f.file for f in fields] + [VALID_NAME]:
        (path / name).unlink(missing_ok=True)


def mark_refused(path: Path, error: CacheError) -> None:
    """Record in meta.json why the layout could not be allocated: ``Cache.list`` removes such an empty
    store once no process has it open (best effort: the disk may be full)."""
    try:
        meta = dict(read_meta(path))
        meta[REFUSED] = str(error)
        write_json_atomic(path / META_NAME, meta, fsync=False)
    except (OSError, CacheError):
        pass
