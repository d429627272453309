"""The shard readers of one process: a thread-safe, fork-aware cache of open readers.

Every read of a :class:`~fastdata.ShardedDataset` goes through ``ReaderCache.acquire``/``release``,
which lease a reader: a reader evicted while a thread reads it only leaves the cache, and its last
holder closes it (one taken again before that is taken back). One thread opens a given shard at a
time. The cache is sized from the live walks' measured shard interleaving (a shuffled walk mixes
far more shards than ``open_shards``: the shuffle buffer keeps closed pieces' tails coming), under
an open-file budget, and evicts the readers no walk reads again first, then those needed furthest
ahead. The dataset's sample loader is its only user.
"""
from __future__ import annotations

import itertools
import math
import sys
import threading
import weakref
from typing import Any

import numpy as np

from fastdata._runtime import at_fork
from fastdata.dataset._cursor import Cursor

__all__ = ["MAX_OPEN_READERS", "ReaderCache", "fork_count"]



MAX_OPEN_READERS = 1024  # shard readers one process keeps open at most (also <= a quarter of RLIMIT_NOFILE)


def _open_budget() -> int:
    """Shard readers one process may keep open: each holds a file descriptor (a tar shard's
    memory map keeps a duplicate of its descriptor; an HDF5 file its own)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        soft = -1
    if soft < 0:  # RLIM_INFINITY or unknown
        return max(1, MAX_OPEN_READERS)
    return max(1, min(MAX_OPEN_READERS, max(16, soft // 4)))


class _Walk:
    """What one walk (a cursor) still reads from each shard, for the reader cache's eviction.

    ``log``: the shard of every load since the last fold (appended without a lock: one list
    append is atomic); :meth:`fold` turns it into ``left``: samples still to load per shard, so
    threads loading out of order count exactly. Measured once (:meth:`measure`): ``total``
    (samples per shard when the walk began), ``first`` (position in the walk's sequence of its
    first sample of the shard), ``width`` (the most shards whose samples interleave at any point:
    the readers the walk needs open at once never to reopen one).
    """

    __slots__ = ("first", "left", "log", "measured", "remaining", "total", "width")

    def __init__(self) -> None:
        self.log: list[int] | None = []  # None: loads are not counted (every shard fits the cache)
        self.measured = False
        self.left: dict[int, int] = {}
        self.total: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.width = 0
        self.remaining = 0

    def measure(self, shards: np.ndarray, start: int, num_shards: int) -> None:
        """The walk reads ``shards`` (the shard of each sample, in order) from position ``start`` on."""
        n = len(shards)
        if n:
            pos = np.arange(n, dtype=np.int64)
            first = np.full(num_shards, n, dtype=np.int64)
            last = np.full(num_shards, -1, dtype=np.int64)
            np.minimum.at(first, shards, pos)
            np.maximum.at(last, shards, pos)
            count = np.bincount(shards, minlength=num_shards)
            used = np.flatnonzero(count)
            events = np.zeros(n + 1, dtype=np.int64)
            events[first[used]] += 1  # positions hold one sample each: no repeated index
            events[last[used] + 1] -= 1
            self.width = int(np.cumsum(events).max())
            keys = used.tolist()
            self.left = dict(zip(keys, count[used].tolist()))
            self.total = dict(self.left)
            self.first = dict(zip(keys, (first[used] + start).tolist()))
            self.remaining = n
        self.measured = True

    def fold(self) -> None:
        """Count the logged loads (under the cache's lock: the only remover of log entries)."""
        k = 0 if self.log is None else len(self.log)
        if not k:
            return
        assert self.log is not None
        done = self.log[:k]
        del self.log[:k]  # loads appended meanwhile stay, after index k
        if not self.measured:
            self.log[:0] = done  # counted once the walk is measured
            return
        left = self.left
        for shard in done:
            c = left.get(shard)
            if c:
                left[shard] = c - 1
                self.remaining -= 1


_LOG_FOLD = 1 << 16  # loads logged per walk before they are counted (bounds the log's memory)


class _Lease:
    """A cached reader and who holds it (``holders``: one entry per lease taken, appended and
    popped without a lock). ``evicted``: out of the cache; closed when its last holder leaves."""

    __slots__ = ("closed", "evicted", "holders", "last", "reader", "shard")

    def __init__(self, shard: int, reader: Any):
        self.shard, self.reader = shard, reader
        self.holders: list[None] = []
        self.evicted = self.closed = False
        self.last = 0  # recency (the cache's clock at the last lease)


_FORKS = 0  # forks this process descends from: a reader cache made before a fork is the parent's
# The lease fast path relies on the GIL ordering single list/attribute operations (see ReaderCache);
# a free-threaded build takes the lock there too.
_LOCK_FREE = bool(getattr(sys, "_is_gil_enabled", lambda: True)())


def fork_count() -> int:
    """Forks this process descends from (a cache made before a fork belongs to the parent)."""
    return _FORKS


def _after_fork_in_child() -> None:
    global _FORKS
    _FORKS += 1


at_fork(__name__, "count forks: a child opens its own shard readers", after_in_child=_after_fork_in_child)


class ReaderCache:
    """The shard readers open in one process, shared by every walk of the dataset; thread-safe.

    Readers are used under a lease (:meth:`acquire`, :meth:`release`). Evicting a reader that is
    in use only takes it out of the cache: its last holder closes it, so no thread ever reads a
    closed reader (and a reader that is acquired again before that is taken back, not reopened).
    A shard is opened by one thread at a time; the others wait for it.

    Taking and giving back a cached reader (once per sample) takes no lock: the lease holder list
    is appended to before ``evicted`` is read, and the evicting thread sets ``evicted`` before it
    reads the holder list (single list and attribute operations are atomic under the GIL), so
    either the evicting thread sees the holder and leaves the reader open, or the holder sees
    ``evicted`` and backs off to the locked path. Everything else (opening, evicting, closing,
    taking back) runs under the lock.

    Size: at least the loader's ``reader_floor()``; when the walks live in this process are
    known, the sum of their widths (:class:`_Walk`) plus 2, so that a walk reopens a shard only
    when :func:`_open_budget` forbids more open readers (or, for a remote manifest whose node
    cache has ``max_bytes``, the floor: each open reader pins its shard there). Eviction takes the reader needed last:
    one no live walk reads again, else the one whose first use by a walk lies furthest ahead,
    else (every cached reader is in the middle of some walk's reads) the least recently used.
    """

    def __init__(self) -> None:
        self.forks = _FORKS
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # a shard being opened by another thread
        self._entries: dict[int, _Lease] = {}
        self._evicted: dict[int, _Lease] = {}  # out of the cache, still held: the last holder closes it
        self._opening: set[int] = set()
        # id(cursor) -> (weak reference to it, its walk); an entry whose reference is dead is stale
        self._walks: dict[int, tuple[weakref.ref[Cursor], _Walk]] = {}
        self._clock = itertools.count(1)
        self._budget = _open_budget()
        self.opened = 0  # readers opened (for tests and benchmarks)

    def acquire(self, shard: int, cursor: Cursor | None, host: Any) -> _Lease:
        """A lease on the reader of ``shard``, opened if needed (``cursor``: the walk this read is part of;
        ``host``: the dataset's sample loader, with its ``source`` and ``reader_floor()``)."""
        if cursor is not None:  # log the load in its walk
            entry = self._walks.get(id(cursor))
            if entry is None or entry[0]() is not cursor:
                self._register(shard, cursor, host)
            else:
                log = entry[1].log
                if log is not None:
                    log.append(shard)
                    if len(log) > _LOG_FOLD:
                        with self._lock:
                            entry[1].fold()
        lease = self._entries.get(shard) if _LOCK_FREE else None
        if lease is not None:  # the common case, lock-free (see the class docstring)
            lease.holders.append(None)
            lease.last = next(self._clock)
            if not lease.evicted:
                return lease
        with self._lock:
            if lease is not None and self._evicted.get(shard) is lease:  # evicted meanwhile, still open
                victims = self._take_back(lease, host)
            else:
                if lease is not None:  # evicted and closed meanwhile: never read
                    lease.holders.pop()
                lease, victims = self._lookup(shard, host)
        for old in victims:
            old.reader.close()
        if lease is not None:
            return lease
        try:
            reader = host.source.reader(shard)
            _ = reader.keys  # index / file opened here, by one thread (readers open lazily, unsynchronised)
        except BaseException:
            with self._lock:
                self._opening.discard(shard)
                self._cv.notify_all()
            raise
        lease = _Lease(shard, reader)
        lease.holders.append(None)
        lease.last = next(self._clock)
        with self._lock:
            self._opening.discard(shard)
            self._entries[shard] = lease
            self.opened += 1
            victims = self._evict(host, keep=shard)  # other threads may have opened readers meanwhile
            self._cv.notify_all()
        for old in victims:
            old.reader.close()
        return lease

    def release(self, lease: _Lease) -> None:
        if _LOCK_FREE:
            lease.holders.pop()
        if lease.evicted or not _LOCK_FREE:  # rare: the reader left the cache; the last holder closes it
            with self._lock:
                if not _LOCK_FREE:
                    lease.holders.pop()
                close = lease.evicted and not lease.holders and self._evicted.get(lease.shard) is lease
                if close:
                    del self._evicted[lease.shard]
                    lease.closed = True
            if close:
                lease.reader.close()

    def _register(self, shard: int, cursor: Cursor, host: Any) -> None:
        """A walk's first load: registered (and measured, outside the lock, when the dataset has
        more shards than the floor keeps open)."""
        with self._lock:
            entry = self._walks.get(id(cursor))
            if entry is not None and entry[0]() is cursor:  # another thread registered it meanwhile
                if entry[1].log is not None:
                    entry[1].log.append(shard)
                return
            for key, (ref, _) in list(self._walks.items()):
                if ref() is None:
                    del self._walks[key]
            walk = _Walk()
            start = cursor.pos  # nothing of the walk was loaded before its first load
            if len(host.source.names) <= host.reader_floor():
                walk.log, walk.measured = None, True  # every shard fits the floor: nothing to count
            else:
                walk.log.append(shard)  # type: ignore[union-attr]
            self._walks[id(cursor)] = (weakref.ref(cursor), walk)
        if walk.log is None:
            return
        try:
            shards = cursor.locate(start, len(cursor.seq))[0]
        except Exception:  # noqa: BLE001 - eviction falls back to LRU for this walk; the read reports errors
            shards = np.zeros(0, dtype=np.int64)
        with self._lock:
            walk.measure(shards, start, len(host.source.names))

    def _take_back(self, lease: _Lease, host: Any) -> list[_Lease]:
        """``lease`` (evicted, held, by this thread too) back into the cache (under the lock);
        returns the readers to close to make room."""
        del self._evicted[lease.shard]
        lease.evicted = False
        self._entries[lease.shard] = lease
        return self._evict(host, keep=lease.shard)

    def _lookup(self, shard: int, host: Any) -> tuple[_Lease | None, list[_Lease]]:
        """(The cached reader of ``shard`` leased, readers to close) under the lock; (None, ...):
        this thread opens it (room was made)."""
        while True:
            lease = self._entries.get(shard)
            if lease is None:
                lease = self._evicted.get(shard)
                if lease is not None:  # evicted but still held: take it back
                    lease.holders.append(None)
                    lease.last = next(self._clock)
                    return lease, self._take_back(lease, host)
            else:
                lease.holders.append(None)
                lease.last = next(self._clock)
                return lease, []
            if shard not in self._opening:
                self._opening.add(shard)
                return None, self._evict(host)  # room for the reader about to open
            self._cv.wait()  # another thread opens it

    def _evict(self, host: Any, keep: int | None = None) -> list[_Lease]:
        """Take readers out of the cache (under the lock) until it and the readers being opened fit
        its size, never ``keep``; returns those to close now (the others are held)."""
        floor = host.reader_floor()
        if len(self._entries) + len(self._opening) <= min(self._budget, floor):
            return []  # fits whatever the walks need
        walks = []
        for ref, w in self._walks.values():
            c = ref()
            if c is not None and w.measured:
                w.fold()
                if w.remaining > 0:
                    walks.append((c.pos, w))
        cap = min(self._budget, max(floor, sum(w.width for _, w in walks) + 2))
        if getattr(host.source.node_cache, "max_bytes", None) is not None:
            # an open reader of a remote manifest's shard pins it in the node cache, whose max_bytes
            # is sized for the floor (see RemoteShards): keep to that
            cap = min(cap, floor)
        victims = []
        while len(self._entries) + len(self._opening) > cap and len(self._entries) > (keep is not None):
            best, best_key = None, (-2.0, 0)
            for shard, lease in self._entries.items():
                if shard != keep:
                    key = (_need_key(shard, walks), -lease.last)  # then the least recently used
                    if key > best_key:
                        best, best_key = lease, key
            if best is None:
                break
            del self._entries[best.shard]
            best.evicted = True  # before the holders are read (see the class docstring)
            if best.holders:
                self._evicted[best.shard] = best
            else:
                best.closed = True
                victims.append(best)
        return victims


def _need_key(shard: int, walks: list[tuple[int, _Walk]]) -> float:
    """How gladly a reader is evicted: inf (no walk reads it again), the distance to its first
    use by a walk that has not started it yet, -1 (a walk is in the middle of it)."""
    key = math.inf
    for pos, walk in walks:
        left = walk.left.get(shard, 0)
        if left <= 0:
            continue
        if left < walk.total[shard]:
            return -1
        key = min(key, max(0, walk.first[shard] - pos))
    return key
