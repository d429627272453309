"""The iterator of ``fastdata.DataLoader`` over a ShardedDataset, on every path, and the worker path's batch tags.

The progress of a ShardedDataset lives where its samples are loaded; the main process must capture
it. On the worker path the collate (:class:`TaggingCollate`, run in the worker right after the batch
was pulled from the dataset) attaches the worker's exact position to the batch; :class:`LoaderIter`
strips it and records it in the epoch's :class:`Run` (the thread and cached paths yield ``FastBatch``
with the position). So ``state_dict()`` reflects exactly the batches the caller received, whatever the
worker count, prefetching or skipped samples; skip records that reach the main process are recorded
at their batch (``SkipBudgetError`` there, before the position moves). See docs/design/loader-paths.md.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from fastdata._util import release_frames
from fastdata.dataset import BatchSchedule, EpochStart, SkipReport, take_cursor
from fastdata.errors import SkipBudgetError, StateError
from fastdata.loader import _cached as _cache_loader
from fastdata.loader import _threads as _thread_loader
from fastdata.loader import _watchdog
from fastdata.loader._collate import collate

__all__ = ["RESET_LOCK", "LoaderIter", "NoBatch", "Run", "Tagged", "TaggingCollate", "dead_worker",
           "gather_helpers", "loader_iter", "pool_helpers", "worker_helpers"]

_log = logging.getLogger(__name__)
_monotonic = time.monotonic  # the stall watchdog's one call per batch


class Tagged:
    """A batch plus the producing worker's position; survives pin_memory and the result queue."""

    __slots__ = ("batch", "tag")

    def __init__(self, batch: Any, tag: tuple[int, int, int, list[dict[str, Any]]] | None):
        self.batch = batch
        self.tag = tag

    def pin_memory(self) -> Tagged:
        return Tagged(_pin_memory(self.batch), self.tag)


class NoBatch:
    """Stands for the batch of a report-only result (a worker's skips after its last batch)."""

    __slots__ = ()


class TaggingCollate:
    def __init__(self, collate_fn: Callable[[Any], Any], token: str, schedule: BatchSchedule):
        self.collate_fn = collate_fn
        self.token = token
        self.schedule = schedule

    def __call__(self, data: Any) -> Tagged:
        if isinstance(data, SkipReport) or (isinstance(data, list) and data and isinstance(data[-1], SkipReport)):
            # the walk ended with skips after its last yield: send them (and the final position);
            # real samples in this batch are the ones torch would have batched without the markers
            real = [] if isinstance(data, SkipReport) else [x for x in data if not isinstance(x, SkipReport)]
            batch = collate(self.collate_fn, real) if self.schedule.yields(len(real)) else NoBatch()
        else:
            batch = collate(self.collate_fn, data)  # StopIteration: RuntimeError
        cursor = take_cursor()
        if cursor is None or cursor.token != self.token:
            return Tagged(batch, None)
        return Tagged(batch, (cursor.worker, cursor.epoch, cursor.pos, cursor.drain_skips()))


@dataclass
class Run:
    start: EpochStart
    pos: list[int]
    batches: int = 0
    last: int | None = None  # logical worker of the last batch yielded

    @property
    def epoch(self) -> int:
        return self.start.epoch

    def stages_now(self) -> list[Any]:
        stages = self.start.stages
        return [*stages[:-1], (stages[-1][0], tuple(self.pos))]


# orders a persistent-worker loader's iter() (torch resets the one iterator it shares) against next()
# of the iterator it ends; held for flag updates only, never while waiting for a batch
RESET_LOCK = threading.Lock()


class LoaderIter:
    def __init__(self, loader: Any, inner: Any, run: Run, length: int | None = None):
        self._loader, self._inner, self._run, self._length = loader, inner, run, length
        self._ended = False
        self._done = False  # the iteration reached its end (StopIteration)
        self._stale = False  # a state was loaded into the loader since: next() raises StateError
        self._busy: threading.Thread | None = None  # the thread inside next() now
        self._watch: _watchdog.Watch | None = None

    def __iter__(self) -> LoaderIter:
        return self

    def __len__(self) -> int:
        # the worker path's torch iterator has no length over an IterableDataset (an infinite sampler): the
        # loader's, as on the other paths (the whole epoch's batches, after a resume too)
        return len(self._loader) if self._length is None else self._length

    def close(self) -> None:
        """End this iteration now (later ``next()``: StopIteration): stop the stall watchdog's thread,
        the thread decoder's threads and worker processes that are not persistent (persistent
        workers stay with the loader). Safe to call twice."""
        self._ended = True
        if self._watch is not None:
            self._watch.stop()
        inner = self._inner
        if isinstance(inner, (_thread_loader.ThreadBatches, types.GeneratorType)):  # threads; the cached path
            inner.close()
        elif not getattr(inner, "_persistent_workers", True) and callable(getattr(inner, "_shutdown_workers", None)):
            inner._shutdown_workers()  # torch's worker processes stop now, not at a later garbage collection

    def invalidate(self) -> None:
        """The loader loaded a state (which applies to its next ``iter()``): end this iteration as
        :meth:`close` does, but make its next ``next()`` raise StateError instead of ending in silence
        (it would replay the epoch from its old start, or, over persistent workers, yield nothing)."""
        if self._done:
            return
        self._stale = True
        self.close()

    def _end_pass(self) -> None:
        """The pass is over (``SkipBudgetError``): stop its worker processes now, while torch's queues
        still work (left to a garbage collection, each worker is joined after a 5 s timeout; see
        ``_util.release_frames``); persistent workers stay with the loader. Later ``next()``: StopIteration."""
        self._ended = True
        if self._watch is not None:
            self._watch.stop(join=False)  # called from within next(): the consumer's wait ends right after
        inner = self._inner
        if not getattr(inner, "_persistent_workers", True) and callable(getattr(inner, "_shutdown_workers", None)):
            inner._shutdown_workers()

    def __next__(self) -> Any:
        with RESET_LOCK:
            if self._ended:
                if self._stale:
                    raise StateError(
                        "this iterator was made before load_state_dict() on its DataLoader; the loaded state "
                        "applies to the next iter(loader): iterate the loader again (for batch in loader: ...)")
                raise StopIteration
            self._busy = threading.current_thread()
        try:
            return self._next()
        finally:
            self._busy = None

    def _next(self) -> Any:
        while True:
            try:
                item = next(self._inner)
            except StopIteration:
                self._done = True
                raise
            except BaseException as e:
                release_frames(e)  # no reference cycle keeps torch's workers alive (see there)
                dead = dead_worker(self._inner, e) if isinstance(e, (ConnectionError, EOFError)) else None
                if dead is not None:
                    raise RuntimeError(dead) from e
                raise
            if isinstance(item, _cache_loader.FastBatch):  # skips are recorded in this process already
                self._run.pos[item.worker] = item.pos
                self._run.last = item.worker
                self._run.batches += 1
                return item.batch
            if isinstance(item, Tagged):
                report_only = isinstance(item.batch, NoBatch)
                if item.tag is not None:
                    worker, _, pos, skips = item.tag
                    if skips and self._loader.num_workers > 0:  # in-process skips are already recorded
                        try:
                            self._loader.dataset.loader_seam.record_skips(skips)  # SkipBudgetError past max_skips
                        except SkipBudgetError:
                            self._end_pass()
                            raise  # before the position moves: this batch is not yielded, a resume reads it
                    self._run.pos[worker] = pos
                    if not report_only:
                        self._run.last = worker
                if report_only:
                    continue  # a worker's skips after its last batch: recorded, nothing to yield
                item = item.batch
            self._run.batches += 1
            return item


class WatchedIter(LoaderIter):
    """The loader's iterator with the stall watchdog (see ``_watchdog``): its thread starts at the
    first ``next()``; it ends with this iterator (exhaustion, ``close()``, garbage collection)."""

    def __init__(self, loader: Any, inner: Any, run: Run, length: int | None, limit: float,
                 helpers: Callable[[Any], list[threading.Thread | None]]):
        super().__init__(loader, inner, run, length)
        self._watch = _watchdog.Watch(limit, inner, _describe_due(weakref.ref(loader), run), helpers)
        weakref.finalize(self, self._watch.stop, False)

    def __next__(self) -> Any:
        watch: _watchdog.Watch = self._watch  # type: ignore[assignment]
        # the watchdog's only per-batch cost: when the wait began
        if watch.thread is None:
            watch.start()  # notes this thread as the consumer's
        watch.since = since = _monotonic()
        try:
            item = LoaderIter.__next__(self)
        except StopIteration:
            watch.since = 0.0
            if watch.warned:
                watch.ended(since, "the epoch ended (no more batches)")
            watch.stop()
            raise
        except BaseException as e:
            watch.since = 0.0
            if watch.warned:
                watch.ended(since, f"next() raised {type(e).__name__}")
            raise
        watch.since = 0.0
        if watch.warned:
            watch.ended(since)
        return item


def loader_iter(loader: Any, inner: Any, run: Run, length: int | None,
                 helpers: Callable[[Any], list[threading.Thread | None]]) -> LoaderIter:
    limit = _watchdog.threshold(loader.stall_warning, loader.timeout)
    if limit is None:
        return LoaderIter(loader, inner, run, length)
    return WatchedIter(loader, inner, run, length, limit, helpers)


def _describe_due(loader_ref: weakref.ref[Any], run: Run) -> Callable[[], str]:
    """For the stall watchdog: which batch the consumer waits for (holds the loader weakly)."""

    def describe() -> str:
        what = f"batch #{run.batches + 1} of epoch {run.epoch}"
        loader = loader_ref()
        if loader is not None:
            try:
                what += f" from logical worker {loader._next_worker(run)}"
            except Exception as e:  # noqa: BLE001 - best effort: the warning goes out without it
                _log.debug("fastdata.DataLoader: no logical worker for the stall warning: %r", e)
        return what

    return describe


def worker_helpers(inner: Any) -> list[threading.Thread | None]:
    return [getattr(inner, "_pin_memory_thread", None)]  # torch's, with pin_memory=True


def pool_helpers(inner: Any) -> list[threading.Thread | None]:
    return list(inner.pool_threads())  # the thread decoder's pool


def gather_helpers(inner: Any) -> list[threading.Thread | None]:
    return [t for t in threading.enumerate() if t.name.startswith("fastdata-gather")]  # the cached path's gathers


def dead_worker(inner: Any, error: BaseException) -> str | None:
    """Why receiving a batch failed with ``error`` (a ConnectionError or EOFError), when a worker process died.

    A batch's tensors come with the file descriptor of their shared memory, fetched through a
    connection to the worker that sent it: a worker killed (``kill -9``, the out-of-memory killer) with
    batches in the queue made the next ``next()`` raise a bare ``ConnectionResetError: Connection reset
    by peer`` (also from torch's own DataLoader), unless its process had already ended when torch looked.
    None when no worker has died within a second (then ``error`` is about something else)."""
    workers = getattr(inner, "_workers", None)
    if not workers or "in DataLoader worker process" in str(error):  # raised by your code in a worker, passed on
        return None
    deadline = time.monotonic() + _DEAD_WAIT_S
    while True:
        for w in workers:
            code = w.exitcode  # a worker done with its part of an iterable dataset exits with 0
            if code:
                how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0 and -code in _SIGNALS
                       else f"exited with code {code}")
                return (f"DataLoader worker (pid {w.pid}) {how} while passing a batch to this process "
                        f"({type(error).__name__}: {error}); its batches are lost (a SIGKILL is often the "
                        "out-of-memory killer: see dmesg)")
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


_DEAD_WAIT_S = 1.0
_SIGNALS = {int(s) for s in signal.Signals}
