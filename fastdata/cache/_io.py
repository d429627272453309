"""Low-level file helpers of the preprocessing cache: preallocation, full pwrites, atomic JSON, locks.

Linux/POSIX only (``fcntl.flock``, ``os.pwrite``); locks are advisory and per host (not over NFS).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any

# errno values that mean "the disk (or the user's quota) is full"
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

_libc: Any = None


def _fallocate_fn() -> Any:
    """libc ``fallocate`` (Linux) or None. Unlike glibc's ``posix_fallocate`` it never falls back to
    writing a byte per block on filesystems without native support (hours for a 100 GB store)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        except (OSError, AttributeError):
            _libc = False
    return _libc.fallocate if _libc else None


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` of disk for ``fd`` so that a full disk fails now, not mid-fill.

    Returns True if the space is really reserved, False if the filesystem cannot reserve it and
    the file was only extended sparsely (``ftruncate``). Raises OSError (e.g. ENOSPC) otherwise.
    """
    fn = _fallocate_fn()
    if fn is not None:
        if fn(fd, 0, 0, nbytes) == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, nbytes)
    return False


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte is written (pwrite may write less than asked)."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:  # pragma: no cover - a regular file never does this
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        view = view[n:]
        offset += n


def write_json_atomic(path: Path, obj: dict[str, Any], *, fsync: bool = True) -> None:
    """Write JSON to ``path`` via a unique temporary file and ``os.replace``: readers see the old or
    the new file, never a partial one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, sort_keys=True, indent=1)
            f.write("\n")
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock(fd: int, kind: int) -> bool:
    """Non-blocking ``flock``; False when another open file description holds a conflicting lock."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def disk_usage(folder: Path) -> int:
    """Bytes the files directly in ``folder`` occupy on disk (allocated blocks, not apparent size)."""
    total = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        total += st.st_blocks * 512
    return total
