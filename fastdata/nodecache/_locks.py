"""``flock`` helpers of the node cache folder: every lock is a file under ``.locks/``.

A lock is released explicitly before its descriptor is closed: a forked child may share the open
file description, and closing in the parent alone would not release it there.
"""
from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["flock", "release_all", "try_flock", "unlock"]


@contextmanager
def flock(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[int]:
    """Hold ``mode`` (blocking) on lock file ``path`` (created) for the ``with`` block; yields the fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, mode)
        try:
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicit: a forked child may share the description
    finally:
        os.close(fd)


def try_flock(path: Path, mode: int) -> int | None:
    """An fd holding ``mode | LOCK_NB`` on ``path``, or None when someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd


def unlock(fd: int) -> None:
    """Release the lock held by ``fd`` and close it."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def release_all(use: dict[int, list[int]], pid: int) -> None:
    """The use locks of a collected :class:`ShardCache` (its finalizer: no lock taken, no Python
    object of the cache touched). A forked child leaves its parent's descriptors alone."""
    if os.getpid() != pid:
        return
    for fds in list(use.values()):
        while fds:
            try:
                unlock(fds.pop())
            except OSError:  # pragma: no cover - already closed
                pass
    use.clear()
