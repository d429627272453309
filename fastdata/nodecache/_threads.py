"""The node cache's background threads: prefetch downloads and the idle-reader releaser.

Prefetch threads download the next shards of this process's read order (:meth:`ShardCache.plan`);
a failure after every retry is kept for the shard's demand fetch, which raises it. The releaser
runs while a process with ``max_bytes`` holds open readers: when another process waits for space
and this one does not, it closes the readers no thread has read for a while, so their shards can
be evicted. Neither kind of thread runs while the process forks: both are stopped before a fork
(a download under way stops at its next chunk) and started again after it in the parent.
Design note: ``docs/design/nodecache.md``.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from fastdata._runtime import at_fork
from fastdata._runtime import thread as new_thread
from fastdata.io import redact_url
from fastdata.nodecache._errors import Interrupted

__all__ = ["BackgroundThreads"]

_PREFETCH_IDLE_S = 1.0  # an idle prefetch thread exits after this (no thread lingers, e.g. across a fork)
_RELEASE_POLL_S = 0.1  # a process holding open readers looks this often for processes waiting for space
_RELEASE_IDLE_S = 0.5  # ... and then closes those of its readers no thread has read for this long
_FORK_JOIN_S = 2.0  # the longest a fork waits for the cache's threads to stop (a poll, a chunk, a request)

# Caches whose releaser or prefetch threads may run in this process. None of them runs while the process
# forks (a DataLoader starting fork workers): a thread alive at fork time can leave a lock held in the child
# forever, and Python 3.12 warns about it. Stopped before the fork, restarted after it in the parent.
_RELEASING: weakref.WeakSet[Any] = weakref.WeakSet()
_PREFETCHING: weakref.WeakSet[Any] = weakref.WeakSet()

_log = logging.getLogger("fastdata.nodecache")


class BackgroundThreads:
    """The threads half of :class:`~fastdata.nodecache.ShardCache` (a mixin: it shares the cache's state)."""

    # the cache's state this half reads and writes (set by ShardCache.__init__ and _setup); it also calls the
    # cache's is_local, url, _fetch and _others_wait
    root: Path
    prefetch: int
    _pid: int
    _lock: threading.Lock
    _order: list[int]
    _queue: queue.Queue[int | None] | None
    _pending: dict[int, threading.Event]
    _failed: dict[int, tuple[float, Exception]]
    _active: set[int]
    _prefetchers: list[tuple[threading.Thread, queue.Queue[int | None]]]
    _interrupt: threading.Event
    _requeue: list[int]
    _waits: dict[int, int]
    _readers: weakref.WeakSet[Any]
    _releaser: threading.Thread | None
    _releaser_wake: threading.Event
    _releaser_paused: bool

    # ----- prefetch --------------------------------------------------------------------------
    def _prefetch_after(self, k: int) -> None:
        if not self.prefetch or not self._order:
            return
        want = [s for s in self._order[k + 1 : k + 1 + self.prefetch] if not self.is_local(s)]
        if want:
            self._enqueue(want)

    def _enqueue(self, want: list[int]) -> None:
        """Queue prefetches of ``want`` for the prefetch threads (started if none run)."""
        with self._lock:
            if self._interrupt.is_set():
                self._requeue.extend(s for s in want if s not in self._requeue)  # forking now: after it
                return
            if self._queue is None:
                # daemon threads: a download in flight never keeps the interpreter from exiting (a
                # killed download leaves a .part file that the next holder of the shard's lock removes)
                self._queue = queue.Queue()
                self._prefetchers = [(t, q) for t, q in self._prefetchers if t.is_alive()]
                for k in range(min(4, self.prefetch)):
                    thread = new_thread(self._prefetch_loop, args=(self._queue,), name=f"fastdata-nodecache-{k}")
                    self._prefetchers.append((thread, self._queue))
                    thread.start()
                _PREFETCHING.add(self)
            for s in want:
                if s not in self._pending and s not in self._failed:  # a failed one waits for its demand fetch
                    self._pending[s] = threading.Event()
                    self._queue.put(s)

    def _prefetch_loop(self, requests: queue.Queue[int | None]) -> None:
        while True:
            try:
                i = requests.get(timeout=_PREFETCH_IDLE_S)
            except queue.Empty:
                with self._lock:  # idle: retire this queue's threads; the next prefetch starts new ones
                    if self._queue is requests and requests.empty():
                        self._queue = None
                    if self._queue is not requests:
                        return
                continue
            if i is None:
                return
            with self._lock:
                if i not in self._pending:
                    continue  # fetched on demand meanwhile, or the cache was closed
                self._active.add(i)
            try:
                self._fetch(i, demand=False)
            except Interrupted:
                pass  # the process forks: fetched again after it (a demand fetch meanwhile fetches it itself)
            except Exception as e:  # noqa: BLE001 - handed to the demand fetch of shard i, which raises it
                _log.debug("node cache: prefetch of %s failed: %s", redact_url(self.url(i)), e)
                with self._lock:
                    self._failed[i] = (time.monotonic(), e)
            finally:
                with self._lock:
                    self._active.discard(i)
                    done = self._pending.pop(i, None)
                if done is not None:
                    done.set()

    def _stop_prefetch(self) -> list[threading.Thread]:
        """Before a fork: stop the prefetch threads (a download under way stops at its next chunk and
        is dropped); the threads to join. The shards still wanted are queued again after the fork."""
        if self._pid != os.getpid():
            return []
        with self._lock:
            prefetchers, self._prefetchers = self._prefetchers, []
            self._queue = None
            self._interrupt.set()
            queued = [s for s in self._pending if s not in self._active]  # taken by no thread: dropped here
            self._requeue = [s for s in self._order if s in self._pending] + [
                s for s in self._pending if s not in self._order]
            events = [self._pending.pop(s) for s in queued]
        for event in events:
            event.set()  # a demand fetch waiting for it fetches it itself
        for thread, requests in prefetchers:
            requests.put(None)  # one per thread of that queue: each takes one and exits
        return [t for t, _ in prefetchers if t.is_alive()]

    def _resume_prefetch(self) -> None:
        """After a fork, in the parent: prefetch again what :meth:`_stop_prefetch` stopped."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._interrupt.clear()
            want, self._requeue = self._requeue, []
        want = [s for s in want if not self.is_local(s)]
        if want:
            self._enqueue(want)

    # ----- idle readers give way to processes waiting for space ------------------------------------
    def _start_releaser(self) -> None:
        """Start the releaser thread (``self._lock`` held)."""
        self._releaser_wake.clear()
        self._releaser_paused = False
        self._releaser = new_thread(self._release_loop, name="fastdata-nodecache-release")
        _RELEASING.add(self)
        self._releaser.start()

    def _stop_releaser(self) -> threading.Thread | None:
        """Before a fork: tell the releaser thread to stop; the thread to join (None if none runs)."""
        if self._pid != os.getpid():
            return None
        with self._lock:
            thread, self._releaser = self._releaser, None
            if thread is None:
                return None
            self._releaser_paused = True
            self._releaser_wake.set()
        return thread

    def _resume_releaser(self) -> None:
        """After a fork, in the parent: restart a releaser stopped for it while readers are still open."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if self._releaser_paused and self._releaser is None:
                self._releaser_paused = False
                if self._readers:
                    self._start_releaser()

    def _release_loop(self) -> None:
        me = threading.current_thread()
        while True:
            self._releaser_wake.wait(_RELEASE_POLL_S)
            with self._lock:
                if self._releaser is not me:
                    return  # the cache was reset (fork, close)
                if not self._readers:  # nothing open: exit (the next watch() starts a new thread)
                    self._releaser = None
                    return
            try:
                self._release_idle()
            except Exception as e:  # noqa: BLE001 - never dies silently: logged, tried again next poll
                _log.warning("node cache %s: releasing idle readers failed: %r", self.root, e)

    def _release_idle(self) -> None:
        """One poll of the releaser (its own frame: no reader outlives it here, so the readers that
        nobody else holds can be collected, and then this cache)."""
        with self._lock:
            readers = list(self._readers)
        # nobody waits, or this process waits too (then the deadlock check decides): the readers
        # only note their read counts (their idle clocks)
        idle_s = math.inf if self._waits or not self._others_wait() else _RELEASE_IDLE_S
        now = time.monotonic()
        for reader in readers:
            if reader.release_if_idle(now, idle_s):
                _log.debug("node cache: released idle %s for a process waiting for space", reader)


def _pause_threads_before_fork() -> None:
    threads = []
    for cache in list(_RELEASING):
        thread = cache._stop_releaser()
        if thread is not None:
            threads.append(thread)
    for cache in list(_PREFETCHING):
        threads.extend(cache._stop_prefetch())
    deadline = time.monotonic() + _FORK_JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _resume_threads_after_fork() -> None:
    for cache in list(_RELEASING):
        cache._resume_releaser()
    for cache in list(_PREFETCHING):
        cache._resume_prefetch()


at_fork(__name__, "pause the node cache's prefetch and release threads across a fork",
        before=_pause_threads_before_fork, after_in_parent=_resume_threads_after_fork)
