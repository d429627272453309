"""Row gathers of the cached fast path: store rows -> batch buffers, on a few threads of this process.

Why not ``torch.index_select``: it runs on torch's intra-op pool, which the training loop (and, on
the GPU path, the prefetch thread) share, and whose threads then contend for the same cores (see
docs/design/loader-paths.md). ``GatherPool`` splits a batch's rows over ``threads`` threads (the calling
thread included), each one ``numpy.take`` per field: a C loop of row memcpys with the GIL released,
never touching torch's thread pool.

Buffers: ``BufferRing`` hands out batch tensors over reused buffers (a fresh buffer's first touch
costs page faults, a reused one none). A buffer is leased
as a new numpy view wrapped by ``torch.from_numpy``; every tensor or view made from the batch keeps
that view alive, and only when the last of them is gone does the buffer return to the ring. So a
buffer is never rewritten while anyone (the training loop, a prefetcher's pending copy) can still
see it. With ``pinned=True`` buffers are page-locked (``CUDAPrefetcher`` asks for that, so its copies
start straight from the gathered batch, with no pack).
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from fastdata._runtime import at_fork, executor
from fastdata._util import usable_cores as _usable_cores

__all__ = ["BufferRing", "GatherPool", "check_gather_threads", "default_gather_threads"]

# Batches smaller than this are gathered by the calling thread alone (a hand-off to a thread costs more).
PARALLEL_GATHER_BYTES = 2 << 20
# Free buffers kept per shape (more are dropped: a consumer that kept many batches gave them back).
KEEP_FREE = 8


def default_gather_threads() -> int:
    """A quarter of the usable cores, at most 4 (1 on small machines): the rest stays with the
    training loop (and the prefetch thread)."""
    return max(1, min(4, _usable_cores() // 4))


def check_gather_threads(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"gather_threads must be an int >= 1 or None, got {value!r}")
    return value


_live_rings: weakref.WeakSet[BufferRing] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A ring lock held by another thread of the parent at fork time (a batch given back by a prefetch
    # thread's drop) would stay held forever in the child: its first take() would hang.
    for ring in list(_live_rings):
        ring._lock = threading.Lock()


at_fork(__name__, "fresh buffer-ring locks in the child (a parent thread may hold one)",
        after_in_child=_after_fork_in_child)


class BufferRing:
    """Reusable batch buffers, returned to the ring only when no tensor views them any more."""

    def __init__(self) -> None:
        self._free: dict[tuple, deque[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever allocated (for tests and statistics)
        _live_rings.add(self)

    def take(self, rows: int, shape: tuple[int, ...], dtype: np.dtype, *, pinned: bool) -> np.ndarray:
        key = (rows, tuple(shape), np.dtype(dtype).str, pinned)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        self.allocated += 1
        if pinned:
            t = torch.empty((rows, *shape), dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
            return t.numpy()  # the array keeps the pinned tensor alive
        return np.empty((rows, *shape), dtype=dtype)

    def lease(self, buf: np.ndarray, n: int, pinned: bool) -> torch.Tensor:
        """A tensor over the first ``n`` rows of ``buf``; ``buf`` returns to the ring once that tensor
        and every tensor made from it are gone."""
        view = buf[:n]  # a new ndarray object: its lifetime is the lease
        weakref.finalize(view, self._give_back, (len(buf), buf.shape[1:], buf.dtype.str, pinned), buf)
        return torch.from_numpy(view)

    def _give_back(self, key: tuple, buf: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault(key, deque())
            if len(free) < KEEP_FREE:
                free.append(buf)


def _take_rows(arrays: dict[str, np.ndarray], rows: np.ndarray, outs: dict[str, np.ndarray], lo: int, hi: int) -> None:
    part = rows[lo:hi]
    for name, arr in arrays.items():
        np.take(arr, part, axis=0, out=outs[name][lo:hi], mode="clip")  # rows were checked: clip = no buffering


class GatherPool:
    """``threads`` threads (the caller included) that copy store rows into batch buffers."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._pid = -1

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None or self._pid != os.getpid():  # none yet, or a forked child's dead copy
            self._executor = executor(self.threads - 1, name="fastdata-gather")
            self._pid = os.getpid()
        return self._executor

    def gather(self, arrays: dict[str, np.ndarray], rows: np.ndarray, outs: dict[str, np.ndarray]) -> None:
        n = len(rows)
        nbytes = n * sum(a[0].nbytes for a in arrays.values()) if n else 0
        parts = min(self.threads, n)
        if parts <= 1 or nbytes < PARALLEL_GATHER_BYTES:
            _take_rows(arrays, rows, outs, 0, n)
            return
        bounds = [n * i // parts for i in range(parts + 1)]
        pool = self._pool()
        futures = [pool.submit(_take_rows, arrays, rows, outs, bounds[i], bounds[i + 1]) for i in range(1, parts)]
        error: BaseException | None = None
        try:
            _take_rows(arrays, rows, outs, bounds[0], bounds[1])
        except BaseException as e:  # noqa: BLE001  raised after the other parts have finished with the buffers
            error = e
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        if self._executor is not None and self._pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._executor = None


class FastGather:
    """The cached fast path's batch gather for one loader: pool + buffer ring, kept across epochs."""

    def __init__(self, threads: int, batch_size: int) -> None:
        self.pool = GatherPool(threads)
        self.ring = BufferRing()
        self.batch_size = batch_size
        self.metas: Any = None  # the cached path's MetaMemo (small uncached fields by global index), set there
        self._finalizer = weakref.finalize(self, GatherPool.close, self.pool)

    @property
    def threads(self) -> int:
        return self.pool.threads

    def batch(self, store: Any, rows: list[int], *, pinned: bool) -> dict[str, torch.Tensor] | None:
        """``{field: (len(rows), *shape) tensor}`` of the store's rows, or None if any is not filled."""
        idx = np.asarray(rows, dtype=np.int64)
        if len(store.missing(idx)):
            return None
        arrays = store.field_arrays()
        if arrays is None:
            return None
        cap = max(self.batch_size, len(idx))
        bufs = {name: self.ring.take(cap, arr.shape[1:], arr.dtype, pinned=pinned) for name, arr in arrays.items()}
        self.pool.gather(arrays, idx, bufs)
        return {name: self.ring.lease(buf, len(idx), pinned) for name, buf in bufs.items()}

    def close(self) -> None:
        self._finalizer()
