"""Next-epoch preload in persistent DataLoader workers: no cold start at every epoch.

When a worker's walk of an epoch ends, :class:`NextEpoch` loads the first ``samples`` positions of its
walk of the predicted next epoch in a daemon thread, while the worker waits for torch's next message.
If the next ``iter()`` starts exactly that walk (epoch, resume stages, first worker, rank and world
size), the walk replays them first; otherwise they are discarded. Samples, order, recorded positions,
skip records and errors are those of a walk without preload. Only indexed sources are preloaded; the
thread is stopped and joined before the worker's own thread uses the dataset again, and never
outlives its process. See docs/design/next-epoch-preload.md.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from fastdata._runtime import at_exit, thread
from fastdata.dataset._cursor import Cursor, EpochStart

__all__ = ["NextEpoch"]

# The preload threads of this process, stopped at interpreter exit.
_LIVE: weakref.WeakSet[NextEpoch] = weakref.WeakSet()


def _stop_all() -> None:
    for pre in list(_LIVE):
        pre.stop()


at_exit(__name__, "stop the next-epoch preload threads of persistent workers", _stop_all)


class _Loaded:
    """What the thread loaded: per position (position after it, sample or None, skip records so far)."""

    __slots__ = ("start", "worker", "cursor", "rows", "error", "dist")

    def __init__(self, start: EpochStart, worker: int, cursor: Cursor, dist: tuple[int, int] = (0, 1)) -> None:
        self.start, self.worker, self.cursor = start, worker, cursor
        self.dist = dist  # (rank, world_size) of the walk it loaded
        self.rows: list[tuple[int, Any, int]] = []
        self.error: BaseException | None = None


class NextEpoch:
    """One worker process's next-epoch preload (see the module docstring)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._loaded: _Loaded | None = None
        self._last_epoch: int | None = None
        self._step = 1
        self.preloaded = 0  # epochs whose start came from a preload (statistics, tests)
        self.discarded = 0  # preloads thrown away: another epoch start came

    # ----- the worker's thread ------------------------------------------------------------------
    def walk(self, seam: Any, start: EpochStart, worker: int, physical: int) -> Iterator[Any]:
        """The samples of ``worker``'s walk of ``start`` (preloaded ones first), then a preload of
        the predicted next epoch (``seam``: the dataset's LoaderSeam; ``physical``: this process's
        torch worker id)."""
        ds = seam.dataset
        loaded = self.take(start, worker, (ds.rank, ds.world_size))
        if self._last_epoch is not None and start.epoch != self._last_epoch:
            self._step = start.epoch - self._last_epoch
        self._last_epoch = start.epoch
        if loaded is None:
            cursor = seam.cursor(start, worker)
            yield from iter(cursor)
        else:
            cursor = loaded.cursor
            yield from _replay(loaded)
            yield from iter(cursor)  # from the position reached, to the end of the walk
        self._begin(seam, start, physical)

    def take(self, start: EpochStart, worker: int, dist: tuple[int, int] = (0, 1)) -> _Loaded | None:
        """Stop the thread; its samples if they are those of ``(start, worker)`` at ``dist`` (rank,
        world_size: the main process may have resolved others since), else None."""
        self.stop()
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return None
        if loaded.start == start and loaded.worker == worker and loaded.dist == dist:
            self.preloaded += 1
            return loaded
        self.discarded += 1
        return None

    def stop(self) -> None:
        """Stop the thread after the sample it is loading, and join it."""
        thread = self._thread
        if thread is not None:
            self._halt.set()
            thread.join()
            self._thread = None

    def _begin(self, seam: Any, done: EpochStart, physical: int) -> None:
        ds = seam.dataset
        if self.samples <= 0 or ds.streaming:
            return
        shared = ds.epoch  # set_epoch of the main process reaches workers through shared memory
        epoch = shared if shared != done.epoch else done.epoch + self._step
        if epoch < 0:
            return
        nw = done.num_workers
        start = seam.epoch_start(nw, epoch)
        worker = (physical + start.first) % nw  # the mapping of ShardedDataset.__iter__
        cursor = seam.cursor(start, worker)
        self._loaded = _Loaded(start, worker, cursor, (ds.rank, ds.world_size))
        self._halt = threading.Event()
        _LIVE.add(self)
        self._thread = thread(_preload, args=(self._loaded, self.samples, self._halt), name="fastdata-next-epoch")
        self._thread.start()


def _preload(loaded: _Loaded, samples: int, halt: threading.Event) -> None:
    """Thread body: load up to ``samples`` positions of the walk, recording each one."""
    cursor = loaded.cursor
    try:
        seq = cursor.seq
        end = min(len(seq), cursor.pos + samples)
        pos = cursor.pos
        if pos >= end:
            return
        shards, local = cursor.locate(pos, end)
        for j, (shard, i, g) in enumerate(zip(shards.tolist(), local.tolist(), seq[pos:end].tolist())):
            if halt.is_set():
                return
            sample = cursor.load(shard, i, g)  # skips go to cursor.skips, as in the walk
            cursor.pos = pos + j + 1
            loaded.rows.append((cursor.pos, sample, len(cursor.skips)))
    except BaseException as e:  # noqa: BLE001  raised by the walk at this position, in the worker's thread
        loaded.error = e


def _replay(loaded: _Loaded) -> Iterator[Any]:
    """The preloaded positions as the walk would have yielded them; leaves the cursor after them."""
    cursor = loaded.cursor
    records, cursor.skips = cursor.skips, []
    done = 0
    for pos, sample, made in loaded.rows:
        cursor.skips.extend(records[done:made])  # the skips made while reaching this position
        done = made
        cursor.pos = pos
        if sample is None:
            continue
        cursor.mark_current()
        yield sample
    cursor.skips.extend(records[done:])  # made while loading a position that then raised
    if loaded.error is not None:
        raise loaded.error
