"""The thread decoder's pool: daemon threads running submitted calls in order, paused around ``os.fork``.

The threads are named ``fastdata-decode-<k>`` and hold only the task queue (a dropped iterator lets its
pool be collected). Before any ``os.fork`` of this process every pool joins its threads after their
current task (a fork never copies a running decode thread); in the parent they restart on demand. A
task's exception is handed to the consumer through its future, with its traceback.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from fastdata._runtime import at_fork, thread

__all__ = ["Pool"]

_JOIN_S = 10.0  # how long close() waits for a thread stuck in a user transform before leaving it (daemon)

_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()


def _pause_before_fork() -> None:
    for pool in list(_POOLS):
        pool.pause()


def _resume_after_fork() -> None:
    """In the parent after a fork: paused pools may start their threads again."""
    for pool in list(_POOLS):
        pool.resume()


at_fork(__name__, "pause the decode-thread pools across a fork", before=_pause_before_fork,
        after_in_parent=_resume_after_fork)


class Pool:
    """Daemon threads running submitted calls in order of submission; pausable for fork."""

    def __init__(self, threads: int, name: str = "fastdata-decode"):
        self.size = threads
        self.name = name
        self._tasks: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._stopping = False  # threads exit after their current task (pause or close)
        self._paused = False  # between os.fork's before and after hooks: no (re)start, even from another thread
        self._closed = False
        self._pid = os.getpid()
        _POOLS.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("fastdata decode pool is closed")
            self._tasks.append((fut, fn, args))
            self._cv.notify()
        self.ensure_running()
        return fut

    def ensure_running(self) -> None:
        """(Re)start the threads (after a fork pause); only in the process that created the pool."""
        if self._pid != os.getpid():
            raise RuntimeError("a fastdata decode_threads iterator cannot be used in a forked child process; "
                               "iterate the DataLoader in the child instead")
        with self._cv:
            if self._closed or self._paused or (self._threads and all(t.is_alive() for t in self._threads)):
                return
            self._stopping = False
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < self.size:
                t = thread(_run, args=(self._tasks, self._cv, self._should_stop), name=f"{self.name}-{len(self._threads)}")
                t.start()
                self._threads.append(t)

    def _should_stop(self) -> bool:
        return self._stopping

    def _join(self) -> None:
        me = threading.current_thread()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + _JOIN_S  # one wait for all of them: not _JOIN_S per stuck thread
        for t in threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t is not me and t.is_alive()]
        if stuck:
            warnings.warn(f"fastdata decode thread(s) {', '.join(stuck)} did not finish their task within "
                          f"{_JOIN_S:g} s (a transform that blocks?); left running as daemons", RuntimeWarning,
                          stacklevel=3)
        with self._cv:
            self._threads = [t for t in self._threads if t.is_alive()]

    def pause(self) -> None:
        """Join the threads after their current task; queued tasks wait until :meth:`resume`."""
        if self._pid == os.getpid():
            with self._cv:
                self._paused = True
            if self._threads:
                self._join()

    def resume(self) -> None:
        """Allow :meth:`ensure_running` to start the threads again (they start on demand)."""
        with self._cv:
            self._paused = False

    def close(self, join: bool = True) -> None:
        """Cancel queued tasks and join the threads (safe to call twice). ``join=False``: only tell
        them to exit after their current task (after a timeout: the consumer must not wait for them)."""
        with self._cv:
            self._closed = True
            tasks, self._tasks = list(self._tasks), deque()
            if not join:
                self._stopping = True
                self._cv.notify_all()
        for fut, _, _ in tasks:
            fut.cancel()
        if join and self._pid == os.getpid():
            self._join()

    @property
    def alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)


def _run(tasks: deque[Any], cv: threading.Condition, should_stop: Callable[[], bool]) -> None:
    """Thread body: holds only the queue, so a dropped iterator lets its pool be collected."""
    # One intra-op thread for torch ops in transforms, as in a DataLoader worker process (the
    # setting is per thread: the caller's own torch ops keep theirs); otherwise every pool thread
    # entering a parallel region would open its own OpenMP team over all cores.
    torch.set_num_threads(1)
    while True:
        with cv:
            while not tasks and not should_stop():
                cv.wait()
            if should_stop():
                return
            fut, fn, args = tasks.popleft()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            fut.set_exception(e)
        del fut, fn, args
