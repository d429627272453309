"""The thread decoder of :class:`fastdata.DataLoader` (``decode_threads=N``): no worker processes.

A pool of threads (:mod:`._pool`) in the loading process loads the samples the ``num_workers``
(virtual) workers would load, each walking the dataset :class:`~fastdata.dataset.Cursor` a worker
process would walk, and writes them straight into batch buffers (:mod:`._rows`). Batches follow the
:class:`~fastdata.dataset.BatchSchedule`, so they are the worker path's (content, order, partial
batches, skips, resume state); only ``decode_threads`` is free, and it changes speed, never batches.
Each batch carries (virtual worker, position after it), so a state saved on either path resumes on
the other. The consumer's ``next()`` dispatches the coming batches' samples (about ``LOOKAHEAD + 1``
batches in flight) and takes results in sequence order; a sample written to a predicted row that a
skip made wrong is copied by the consumer. An exception in a pool thread reaches the consumer at the
batch where the worker path would raise it, with a note naming thread, virtual worker and sample.
See docs/design/thread-decoder.md.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
from torch.utils.data import default_collate
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from fastdata._util import add_note
from fastdata.dataset import BatchSchedule, EpochStart, ShardedDataset, Turn
from fastdata.loader._cached import FastBatch
from fastdata.loader._collate import collate
from fastdata.loader._pool import Pool
from fastdata.loader._rows import Buffers, Layout, Rows, rows_of, write_row

__all__ = ["LOOKAHEAD", "ThreadBatches", "check_threads", "static_reason", "thread_batches"]

# Batches dispatched beyond the one the consumer waits for: the threads keep decoding while the
# consumer works on a batch, at (LOOKAHEAD + 1) batches of memory (torch's prefetch_factor is 2 too).
LOOKAHEAD = 2
_POLL_S = 0.1  # how often a waiting consumer checks that the pool is alive


def check_threads(value: Any) -> int:
    """Validate ``decode_threads``: an int >= 0 (0: worker processes as usual)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decode_threads must be an int >= 0 (0: decode in worker processes), got {value!r}")
    return value


def static_reason(ds: Any, *, batch_size: int | None, worker_init_fn: Any) -> str | None:
    """Why ``decode_threads`` cannot serve this loader (None: it can)."""
    if not isinstance(ds, ShardedDataset):
        return f"it needs a fastdata.ShardedDataset, got a {type(ds).__name__}"
    if ds.streaming:
        return "a streaming (URL) source has no random access; use worker processes (decode_threads=0)"
    if batch_size is None:
        return "batch_size=None (no automatic batching) is not supported"
    if worker_init_fn is not None:
        return "worker_init_fn= cannot run: no worker processes are started"
    return None


def thread_batches(ds: ShardedDataset, start: EpochStart, *, threads: int, batch_size: int, drop_last: bool,
                   collate_fn: Callable[[Any], Any], pin: str | None, pin_rows: str | None = None,
                   timeout: float = 0) -> ThreadBatches:
    """The batches of ``start``'s epoch decoded in ``threads`` threads (see the module docstring).

    ``pin``: pin every tensor of a batch (``pin_memory=True``); ``pin_rows``: allocate the batch
    rows samples are written into page-locked (default: as ``pin``)."""
    seam = ds.loader_seam
    if seam.has_cache:
        seam.cache_store()  # opened here once, not raced by the pool's first loads
    seqs = seam.sequences_at(start)
    n = len(seqs)
    # one live cursor per virtual worker: the dataset's reader cache keeps the shards each walk
    # reads open (thread-safe: a reader is never closed under a reading thread);
    # with one worker ds.state_dict() follows, as with num_workers=0 on the worker path
    cursors = [seam.cursor(start, w, seq=seq, live=n == 1) for w, seq in enumerate(seqs)]
    batches = ThreadBatches(cursors, first=start.first, threads=threads, batch_size=batch_size, drop_last=drop_last,
                            collate_fn=collate_fn, pin=pin, pin_rows=pin_rows, carry=_CARRY.setdefault(ds, {}),
                            timeout=timeout, record_skips=seam.record_deferred_skips)
    return batches


# What one epoch leaves to the next of the same dataset: the sample layout (so the first batches
# land in place too) and the buffer rings (their pages are already faulted in).
_CARRY: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _shut(pool: Pool, buffers: Buffers, walks: list[_Walk], join: bool) -> None:
    """Close an iterator's pool and give the buffers of its batches in flight back to the ring (held
    only by the iterator and its finalizer: never references the iterator itself)."""
    pool.close(join)
    running = pool.alive > 0  # timed out, or stuck past _JOIN_S: a thread may still write into its rows
    for walk in walks:
        if not running:
            for bufs, _ in walk.buffers.values():
                buffers.release(bufs)
        walk.buffers.clear()  # with a thread running: left busy in the ring, never handed out again
        walk.pending.clear()
        walk.results.clear()


class _Item:
    """One sample's outcome: the sample (None: skipped, with its skip record), where it was written, or the error."""

    __slots__ = ("error", "g", "pos", "sample", "skip", "written")

    def __init__(self, pos: int, g: int, sample: Any = None, written: int = -1, error: BaseException | None = None,
                 skip: dict[str, Any] | None = None):
        self.pos, self.g, self.sample, self.written, self.error, self.skip = pos, g, sample, written, error, skip


Dest = tuple[Layout, Rows, int, int]  # (layout, batch buffers, row, predicted ordinal)


def _load_chunk(cursor: Any, items: list[tuple[int, int, int, int]], dests: list[Dest | None]) -> list[_Item]:
    """Pool task: load samples (pos, g, shard, i) of one virtual worker, writing each in place when
    told where. Stops at the first exception (the consumer raises it there)."""
    out: list[_Item] = []
    for (pos, g, shard, i), dest in zip(items, dests):
        try:
            try:
                sample = cursor.load(shard, i, g)
            except StopIteration as stop:  # re-raised in __next__ it would end the epoch silently; in a worker
                # the dataset's generator turns it into this RuntimeError (PEP 479)
                raise RuntimeError("generator raised StopIteration (while loading a sample)") from stop
            if sample is None:  # skipped: the consumer records it when it reaches this sample
                out.append(_Item(pos, g, skip=cursor.pop_skip(g)))
                continue
            written = -1
            if dest is not None and write_row(sample, dest[0], dest[1], dest[2]):
                written = dest[3]
            out.append(_Item(pos, g, sample, written))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer at this sample
            add_note(e, f"(in thread {threading.current_thread().name} of fastdata.DataLoader(decode_threads=...), "
                     f"virtual worker {cursor.worker}, sample {g}, position {pos} of its sequence)")
            out.append(_Item(pos, g, error=e))
            break
    return out


class _Walk:
    """The consumer-side state of one virtual worker."""

    def __init__(self, cursor: Any, seq: np.ndarray):
        self.cursor = cursor
        self.seq = seq
        self.dispatched = int(cursor.pos)  # next position to dispatch
        self.pending: deque[tuple[Future[list[_Item]], int]] = deque()  # (chunk, its sample count)
        self.results: deque[_Item] = deque()  # outcomes of the chunk being consumed
        self.in_flight = 0  # samples dispatched and not consumed
        self.taken = 0  # samples consumed into batches (true ordinal of the next one)
        self.predicted = 0  # predicted ordinal of the next dispatched sample
        self.buffers: dict[int, Rows] = {}  # batch ordinal -> its buffers

    @property
    def left(self) -> int:
        return len(self.seq) - self.dispatched


class ThreadBatches:
    """The batches of one epoch, decoded in a thread pool, in the worker path's order.

    Iterates :class:`FastBatch` (batch, virtual worker, position after the batch). ``cursors`` are the
    virtual workers' dataset cursors (their ``seq`` and ``pos``); ``first`` yields first.
    """

    def __init__(self, cursors: Sequence[Any], *, first: int, threads: int, batch_size: int, drop_last: bool,
                 collate_fn: Callable[[Any], Any], pin: str | None, pin_rows: str | None = None,
                 carry: dict[Any, Any] | None = None, timeout: float = 0,
                 record_skips: Callable[[list[dict[str, Any]]], None] | None = None):
        self._walks = [_Walk(c, c.seq) for c in cursors]
        for c in cursors:  # loaded ahead: skips are recorded (and counted) in batch order, as from workers
            c.defer_skips = True
        self._record_skips = record_skips
        self._n = len(cursors)
        self._b = batch_size
        self._deal = BatchSchedule(self._n, batch_size, drop_last).deal(first)
        self._collate = collate_fn
        self._inplace = collate_fn is default_collate
        self._pin = pin
        self._threads = threads
        self._chunk = max(1, min(8, batch_size // (4 * threads)))
        self._carry = {} if carry is None else carry
        self._layout: Layout | None = self._carry.get("layout") if self._inplace else None
        pin_rows = pin_rows or pin
        self._buffers = self._carry.setdefault(("buffers", pin_rows), Buffers(pin_rows, LOOKAHEAD + 1))
        self._batches = 0
        self._in_place = self._copied = 0
        self._timeout = timeout  # DataLoader(timeout=): seconds one wait for the pool may take (0: none)
        self._pool: Pool | None = Pool(threads)
        # also when the iterator is dropped without close() (an early break): the buffers of the batches in
        # flight go back to the dataset's ring, which later epochs reuse
        self._finalizer = weakref.finalize(self, _shut, self._pool, self._buffers, self._walks, True)
        self._timed_out = False  # a wait ran past timeout=: close() leaves the threads to end on their own
        # the loader's positions per virtual worker, set with num_workers > 0: a walk that yields no more
        # batches after skipping samples (all its last ones, or a partial batch drop_last drops) moves its
        # position to its end here, as a worker process's report-only result does on the worker path
        self.positions: list[int] | None = None

    # -- public
    def __iter__(self) -> ThreadBatches:
        return self

    def __next__(self) -> FastBatch:
        if self._pool is None:
            raise StopIteration
        try:
            while (w := self._deal.next()) is not None:
                self._dispatch(w)
                rows, pos, skipped = self._take(self._walks[w])
                turn = self._deal.settle(w, len(rows), skipped)
                if turn is Turn.BATCH:
                    batch = self._assemble(self._walks[w], rows)
                    self._batches += 1
                    return FastBatch(batch, w, pos)
                if turn is Turn.END and self.positions is not None:  # as a worker process reports its end
                    self.positions[w] = pos
                self._discard(self._walks[w])
        except BaseException:
            self.close()
            raise
        self.close()
        raise StopIteration

    def close(self) -> None:
        """Stop and join the pool's threads (safe to call twice; also on garbage collection)."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            if self._timed_out:  # raise the timeout now, as the worker path does, not after a join
                self._finalizer.detach()
                _shut(pool, self._buffers, self._walks, False)
            else:
                self._finalizer()

    def pool_threads(self) -> list[threading.Thread]:
        """The pool's threads (for the stall watchdog's stacks)."""
        return [] if self._pool is None else list(self._pool._threads)

    @property
    def stats(self) -> dict[str, int]:
        """``batches`` yielded; samples ``in_place`` (written by a pool thread into their row) and
        ``copied`` (by the consumer); batch buffers ``allocated``."""
        return {"batches": self._batches, "in_place": self._in_place, "copied": self._copied,
                "allocated": self._buffers.allocated}

    # -- dispatch
    def _dispatch(self, w: int) -> None:
        """Keep about LOOKAHEAD + 1 predicted batches in flight, from batch of worker ``w`` on."""
        budget = (LOOKAHEAD + 1) * self._b - sum(walk.in_flight for walk in self._walks)
        have = [walk.in_flight for walk in self._walks]
        active = list(self._deal.active)
        for _ in range((LOOKAHEAD + 1) * self._n):
            if budget <= 0 or not any(active):
                return
            if active[w]:
                walk = self._walks[w]
                need = self._b - min(self._b, have[w])
                have[w] = max(0, have[w] - self._b)
                d = min(need, walk.left, budget)
                if d > 0:
                    self._submit(walk, d)
                    budget -= d
                if need > d and walk.left == 0:
                    active[w] = False  # predicted to end with this batch
                elif need > d:
                    return  # out of budget
            w = (w + 1) % self._n

    def _submit(self, walk: _Walk, count: int) -> None:
        pool = self._pool
        if pool is None:
            raise RuntimeError("fastdata.DataLoader(decode_threads=...) iterator is closed")
        if walk.in_flight == 0:
            walk.predicted = walk.taken  # re-base: nothing in flight can collide
        lo = walk.dispatched
        shards, local = walk.cursor.locate(lo, lo + count)
        gs = walk.seq[lo : lo + count].tolist()
        items = list(zip(range(lo, lo + count), gs, shards.tolist(), local.tolist()))
        for k in range(0, count, self._chunk):
            part = items[k : k + self._chunk]
            dests = [self._dest(walk, walk.predicted + j) for j in range(len(part))]
            walk.predicted += len(part)
            walk.pending.append((pool.submit(_load_chunk, walk.cursor, part, dests), len(part)))
        walk.dispatched += count
        walk.in_flight += count

    def _dest(self, walk: _Walk, ordinal: int) -> Dest | None:
        if self._layout is None or not self._inplace:
            return None
        b = ordinal // self._b
        rows = walk.buffers.get(b)
        if rows is None:
            rows = walk.buffers[b] = rows_of(self._buffers.take(self._layout.fields, self._b))
        return self._layout, rows, ordinal % self._b, ordinal

    # -- consumption
    def _next_item(self, walk: _Walk) -> _Item | None:
        """The next sample outcome of ``walk`` in sequence order (None: its sequence is done)."""
        while not walk.results:
            if not walk.pending:
                if walk.left == 0:
                    return None
                self._submit(walk, min(walk.left, self._b))  # a skip left the prediction short
            fut, _ = walk.pending.popleft()
            walk.results.extend(self._wait(fut))
            if not walk.results:  # pragma: no cover - a chunk always yields or raises
                raise RuntimeError("fastdata decode thread returned no result")
        walk.in_flight -= 1
        return walk.results.popleft()

    def _wait(self, fut: Future[list[_Item]]) -> list[_Item]:
        pool = self._pool
        if pool is None:
            raise RuntimeError("fastdata.DataLoader(decode_threads=...) iterator is closed")
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            pool.ensure_running()  # after a fork pause
            try:
                return fut.result(timeout=_POLL_S)
            except TimeoutError:
                if deadline is not None and time.monotonic() > deadline:
                    self._timed_out = True
                    raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds (a decode_threads "
                                       "thread spent that long on one chunk of samples)") from None

    def _take(self, walk: _Walk) -> tuple[list[Any], int, bool]:
        """The next ``batch_size`` samples of ``walk`` that load (fewer at its end), the position after,
        and whether samples were skipped on the way."""
        rows: list[Any] = []
        skips: list[dict[str, Any]] = []
        pos = int(walk.cursor.pos)
        while len(rows) < self._b:
            item = self._next_item(walk)
            if item is None:
                pos = len(walk.seq)
                break
            pos = item.pos + 1
            if item.error is not None:
                add_note(item.error, f"(fastdata.DataLoader batch {self._batches}, virtual worker {walk.cursor.worker})")
                raise item.error
            if item.sample is None:  # skipped under on_error
                if item.skip is not None:
                    skips.append(item.skip)
                continue
            if self._layout is None and self._inplace:
                self._layout = self._carry["layout"] = Layout.of(item.sample)
                if self._layout is None:
                    self._inplace = False
            rows.append((item.sample, item.written == walk.taken))
            walk.taken += 1
        walk.cursor.pos = pos
        if skips and self._record_skips is not None:
            self._record_skips(skips)  # dataset.skipped; SkipBudgetError past max_skips, at this batch
        return rows, pos, bool(skips)

    def _assemble(self, walk: _Walk, rows: list[tuple[Any, bool]]) -> Any:
        b = (walk.taken - len(rows)) // self._b  # batches start at multiples of batch_size
        samples = [s for s, _ in rows]
        buffers = walk.buffers.pop(b, None)
        layout = self._layout
        if not self._inplace or layout is None:
            if buffers is not None:
                self._buffers.release(buffers[0])
            return self._pinned(collate(self._collate, samples))
        if buffers is None:
            buffers = rows_of(self._buffers.take(layout.fields, self._b))
        try:
            for j, (s, in_place) in enumerate(rows):
                if not in_place and not write_row(s, layout, buffers, j):
                    batch = collate(default_collate, samples)  # the error for samples that do not match
                    # they matched each other: the layout (e.g. carried from an epoch with another
                    # transform) is stale; the next dispatches use theirs
                    self._layout = self._carry["layout"] = Layout.of(samples[0])
                    self._inplace = self._layout is not None
                    return self._pinned(batch)
            copied = sum(not in_place for _, in_place in rows)
            self._copied += copied
            self._in_place += len(rows) - copied
            return layout.collate(samples, buffers[0], self._pinned)
        finally:
            self._buffers.release(buffers[0])

    def _pinned(self, value: Any) -> Any:
        return _pin_memory(value, self._pin) if self._pin is not None else value

    def _discard(self, walk: _Walk) -> None:
        for bufs, _ in walk.buffers.values():
            self._buffers.release(bufs)
        walk.buffers.clear()
