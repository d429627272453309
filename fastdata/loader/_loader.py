"""``fastdata.DataLoader``: torch's DataLoader plus exact ``state_dict()``/``load_state_dict()``.

The progress of a :class:`~fastdata.ShardedDataset` lives in the DataLoader workers; the main
process must capture it. Torch hands out an IterableDataset's batches round-robin over the
workers, skipping exhausted ones, so batch counts would give per-worker progress, but not when
samples are skipped on errors or with ``in_order=False``. Instead, the collate function (which
runs in the worker right after the batch was pulled from the dataset) attaches the worker's exact
position in its index sequence to the batch; the main process strips it before the batch is
yielded and records it. ``state_dict()`` therefore reflects exactly the batches the caller has
received, whatever the worker count, prefetching or skipped samples.

Cached fast path (``cached_fast_path=``, :mod:`fastdata.loader._cached`): when the dataset's cache
store holds every sample of the epoch and no per-sample work needs a worker, the batches are
gathered from the store in the calling process instead, identical in content and order.

Thread decoder (``decode_threads=N``, :mod:`fastdata.loader._threads`): no worker processes; the
``num_workers`` virtual workers' samples are decoded by N threads of this process straight into
batch buffers, again identical in content and order to the worker path.

Everything else is ``torch.utils.data.DataLoader`` unchanged; with any other dataset this class
behaves exactly like torch's (``state_dict()`` then raises TypeError).
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import pickle
import signal
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.data
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from fastdata._util import check_index, release_frames
from fastdata.dataset import BatchSchedule, EpochStart, ShardedDataset, SkipReport, take_cursor
from fastdata.dataset import collate as collate_encoded
from fastdata.errors import CacheError, FastdataError, SkipBudgetError
from fastdata.loader import _cached as _cache_loader
from fastdata.loader import _threads as _thread_loader
from fastdata.loader import _watchdog
from fastdata.loader._gather import FastGather, check_gather_threads, default_gather_threads
from fastdata._pickling import explain, main_without_file

__all__ = ["DataLoader"]

LOADER_STATE_VERSION = 1
_log = logging.getLogger(__name__)
_monotonic = time.monotonic  # the stall watchdog's one call per batch


class _Tagged:
    """A batch plus the producing worker's position; survives pin_memory and the result queue."""

    __slots__ = ("batch", "tag")

    def __init__(self, batch: Any, tag: tuple[int, int, int, list[dict[str, Any]]] | None):
        self.batch = batch
        self.tag = tag

    def pin_memory(self) -> _Tagged:
        return _Tagged(_pin_memory(self.batch), self.tag)


class _NoBatch:
    """Stands for the batch of a report-only result (a worker's skips after its last batch)."""

    __slots__ = ()


class _TaggingCollate:
    def __init__(self, collate_fn: Callable[[Any], Any], token: str, schedule: BatchSchedule):
        self.collate_fn = collate_fn
        self.token = token
        self.schedule = schedule

    def __call__(self, data: Any) -> _Tagged:
        if isinstance(data, SkipReport) or (isinstance(data, list) and data and isinstance(data[-1], SkipReport)):
            # the walk ended with skips after its last yield: send them (and the final position);
            # real samples in this batch are the ones torch would have batched without the markers
            real = [] if isinstance(data, SkipReport) else [x for x in data if not isinstance(x, SkipReport)]
            batch = _thread_loader.collate(self.collate_fn, real) if self.schedule.yields(len(real)) else _NoBatch()
        else:
            batch = _thread_loader.collate(self.collate_fn, data)  # StopIteration: RuntimeError
        cursor = take_cursor()
        if cursor is None or cursor.token != self.token:
            return _Tagged(batch, None)
        return _Tagged(batch, (cursor.worker, cursor.epoch, cursor.pos, cursor.drain_skips()))


@dataclass
class _Run:
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
_RESET_LOCK = threading.Lock()


class _LoaderIter:
    def __init__(self, loader: DataLoader, inner: Any, run: _Run, length: int | None = None):
        self._loader, self._inner, self._run, self._length = loader, inner, run, length
        self._ended = False
        self._busy: threading.Thread | None = None  # the thread inside next() now
        self._watch: _watchdog.Watch | None = None

    def __iter__(self) -> _LoaderIter:
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
        with _RESET_LOCK:
            if self._ended:
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
                raise
            except BaseException as e:
                release_frames(e)  # no reference cycle keeps torch's workers alive (see there)
                dead = _dead_worker(self._inner, e) if isinstance(e, (ConnectionError, EOFError)) else None
                if dead is not None:
                    raise RuntimeError(dead) from e
                raise
            if isinstance(item, _cache_loader.FastBatch):  # skips are recorded in this process already
                self._run.pos[item.worker] = item.pos
                self._run.last = item.worker
                self._run.batches += 1
                return item.batch
            if isinstance(item, _Tagged):
                report_only = isinstance(item.batch, _NoBatch)
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


class _WatchedIter(_LoaderIter):
    """The loader's iterator with the stall watchdog (see ``_watchdog``): its thread starts at the
    first ``next()``; it ends with this iterator (exhaustion, ``close()``, garbage collection)."""

    def __init__(self, loader: DataLoader, inner: Any, run: _Run, length: int | None, limit: float,
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
            item = _LoaderIter.__next__(self)
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


def _loader_iter(loader: DataLoader, inner: Any, run: _Run, length: int | None,
                 helpers: Callable[[Any], list[threading.Thread | None]]) -> _LoaderIter:
    limit = _watchdog.threshold(loader.stall_warning, loader.timeout)
    if limit is None:
        return _LoaderIter(loader, inner, run, length)
    return _WatchedIter(loader, inner, run, length, limit, helpers)


def _describe_due(loader_ref: weakref.ref[DataLoader], run: _Run) -> Callable[[], str]:
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


def _worker_helpers(inner: Any) -> list[threading.Thread | None]:
    return [getattr(inner, "_pin_memory_thread", None)]  # torch's, with pin_memory=True


def _pool_helpers(inner: Any) -> list[threading.Thread | None]:
    return list(inner.pool_threads())  # the thread decoder's pool


def _gather_helpers(inner: Any) -> list[threading.Thread | None]:
    return [t for t in threading.enumerate() if t.name.startswith("fastdata-gather")]  # the cached path's gathers


def _dead_worker(inner: Any, error: BaseException) -> str | None:
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


def _start_method(ctx: Any) -> str:
    """The start method of a DataLoader's ``multiprocessing_context`` (None: multiprocessing's default)."""
    if ctx is not None:
        return str(ctx.get_start_method())
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


class DataLoader(torch.utils.data.DataLoader):
    """Drop-in ``torch.utils.data.DataLoader`` with exact resume for :class:`ShardedDataset`.

    ``state_dict()`` captures the position after the batches yielded so far;
    ``load_state_dict()`` makes the next iteration yield exactly the remaining samples of that
    epoch: in the same order with the same ``num_workers``; exactly once but in another order
    with a different ``num_workers``. ``len()`` is the exact number of batches per epoch
    (each worker yields its own final partial batch unless ``drop_last``).

    Args:
        cached_fast_path: ``"auto"`` (default): an epoch whose samples are all in the dataset's
            cache store (all but 0.1%: those are loaded in this process), with no ``transform=``
            or ``sample_transform=``, the default ``collate_fn`` and no ``worker_init_fn``, is
            read in this process with one store gather per batch instead of through worker
            processes (none are started); the batches are the same (content, keys, order,
            partial batches, resume state) as the workers would give. ``True``: also with a
            custom ``collate_fn`` (run in this process) or a ``worker_init_fn`` (not called);
            ``CacheError`` when the store lacks more of the epoch. ``False``: always the
            workers. ``last_path`` tells which path the latest epoch took ("cached", "threads"
            or "workers") and ``fallback_reason`` why not the fast one.
        decode_threads: ``0`` (default): samples are loaded in ``num_workers`` worker processes.
            ``N >= 1``: no worker processes; ``N`` threads of this process load (read, decode,
            transform) the samples the ``num_workers`` workers would load and write them straight
            into batch buffers (pinned with ``pin_memory=True``), with no per-batch IPC. Batches
            are the same (content, keys, order, partial batches, resume state) as with worker
            processes and the same ``num_workers``, which therefore still fixes the order; ``N``
            only sets the speed. Needs an indexed (not streaming) ``ShardedDataset``, a
            ``batch_size`` and no ``worker_init_fn``; ``transform=``/``sample_transform=`` and a
            custom ``collate_fn`` must be thread-safe (the collate runs in the calling thread).
            An epoch the cached fast path can serve takes that path instead.
        preload_next_epoch: with ``persistent_workers=True`` (default True): a worker done with its part
            of an epoch loads the first ``prefetch_factor`` batches' samples of its part of the next
            epoch while it waits, so that epoch does not start cold (the epoch is predicted: the one
            ``set_epoch`` selected, else the last step between epochs; a wrong guess is discarded).
            Batches, order and resume state are unchanged. False: torch's behaviour.
        gather_threads: threads of this process that copy the cached fast path's rows into batch
            buffers (numpy row copies, never torch's intra-op pool). Default (None): a quarter of the
            usable cores, at most 4, leaving the rest to the training loop.
        stall_warning: seconds (default 60) the consumer may wait for one batch before a WARNING on
            the ``fastdata.loader`` logger says how long it waited, for which batch (epoch, logical
            worker, worker process), each worker process's pid and state, and the Python stack of
            every thread of every worker process (taken with ``faulthandler`` on SIGUSR2, so also of a
            deadlocked worker; "unavailable" on Windows) and of the in-process threads that make the
            batches (thread decoder pool, cached path, pin-memory thread). Repeated at doubling
            intervals while the stall lasts; a last WARNING says when it ended. Nothing is raised or
            stopped: torch's ``timeout=`` still does that (no warning when ``stall_warning >= timeout``).
            ``None`` or ``0``: off. With a ``ShardedDataset`` only.
        Everything else: as ``torch.utils.data.DataLoader``, except that worker processes (over a
        ``ShardedDataset``) leave through ``os._exit`` under every start method, as fork children do
        (spawn workers otherwise run finalization and C++ static destructors, which aborted some at
        an early stop; see ``fastdata.loader._exit``): ``atexit`` handlers in workers do not run;
        and they end within a second when this process dies (``kill -9`` included), whatever their
        parent process (a ``forkserver`` worker's is the fork server; see ``_watchdog.WorkerInit``).

    ``fast_path_pinned`` (attribute, default False): gather the cached fast path's batches straight
    into page-locked buffers even without ``pin_memory``; ``CUDAPrefetcher`` sets it on the loader it
    wraps (on a CUDA device), so its host-to-device copies need no pack. The thread decoder
    (``decode_threads``) then writes its samples into page-locked batch rows too.
    """

    def __init__(self, dataset: Any, *args: Any, cached_fast_path: bool | str = "auto", decode_threads: int = 0,
                 gather_threads: int | None = None, preload_next_epoch: bool = True,
                 stall_warning: float | None = _watchdog.DEFAULT_STALL_WARNING, **kwargs: Any):
        mode = _cache_loader.check_mode(cached_fast_path)
        self.stall_warning = _watchdog.check_stall_warning(stall_warning)
        if not isinstance(preload_next_epoch, bool):
            raise ValueError(f"preload_next_epoch must be True or False, got {preload_next_epoch!r}")
        self.preload_next_epoch = preload_next_epoch
        self.gather_threads = check_gather_threads(gather_threads)
        self.fast_path_pinned = False
        self._gather: FastGather | None = None
        self.decode_threads = _thread_loader.check_threads(decode_threads)
        with warnings.catch_warnings():
            if decode_threads:  # no worker processes start: torch's advice on their number does not apply
                warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
            super().__init__(dataset, *args, **kwargs)
        self._check_torch_arguments()
        if decode_threads:
            why = _thread_loader.static_reason(dataset, batch_size=self.batch_size, worker_init_fn=self.worker_init_fn)
            if why is not None:
                raise ValueError(f"decode_threads={decode_threads}: {why}")
        self._run: _Run | None = None
        self._live: weakref.ref[_LoaderIter] | None = None  # the latest worker-path iterator
        self.cached_fast_path = mode
        self.last_path: str | None = None  # "cached", "threads" or "workers": the path the latest iteration took
        self.fallback_reason: str | None = None  # why the latest iteration did not take the fast path
        self._fast_seed_drawn = False
        if getattr(dataset, "image_decode", "cpu") == "device" and self.collate_fn is torch.utils.data.default_collate:
            self.collate_fn = collate_encoded  # EncodedImage fields -> one PackedImages per field and batch
        self._user_collate = self.collate_fn
        if mode is True:
            reason = self._static_reason(forced=True)
            if reason is not None:
                raise ValueError(f"cached_fast_path=True: {reason}")
        if isinstance(dataset, ShardedDataset):
            self.collate_fn = _TaggingCollate(self.collate_fn, dataset.loader_seam.token, self._schedule())

    def _check_torch_arguments(self) -> None:
        """torch checks only ``num_workers < 0`` and ``timeout < 0`` here: 1.5 workers or a NaN timeout
        failed at the first iteration with a TypeError or an AssertionError, and strings passed as
        flags (``persistent_workers="no"``) were taken as true."""
        self.num_workers = check_index("num_workers", self.num_workers, 0)
        timeout = self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        factor = self.prefetch_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int) or factor < 1):
            raise ValueError(f"prefetch_factor must be None or an int >= 1, got {factor!r}")
        for name in ("pin_memory", "persistent_workers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _static_reason(self, *, forced: bool) -> str | None:
        return _cache_loader.static_reason(self.dataset, batch_size=self.batch_size, collate_fn=self._user_collate,
                                           worker_init_fn=self.worker_init_fn, forced=forced)

    def _sharded(self) -> ShardedDataset:
        if not isinstance(self.dataset, ShardedDataset):
            raise TypeError(f"state_dict/load_state_dict need a fastdata.ShardedDataset, got {type(self.dataset).__name__}")
        return self.dataset

    def set_epoch(self, epoch: int) -> None:
        """``dataset.set_epoch(epoch)`` (reaches persistent workers too)."""
        self._sharded().set_epoch(epoch)

    def __len__(self) -> int:
        if not isinstance(self.dataset, ShardedDataset):
            return super().__len__()
        self._IterableDataset_len_called = len(self.dataset)
        return self.dataset.loader_seam.batches_per_epoch(self.batch_size, num_workers=self.num_workers,
                                                          drop_last=self.drop_last)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self.dataset
        if not isinstance(ds, ShardedDataset):
            return super().__iter__()
        previous = self._live() if self._live is not None else None
        if previous is not None and previous._inner is getattr(self, "_iterator", None):
            with _RESET_LOCK:  # persistent workers: torch resets the iterator `previous` reads from
                busy = previous._busy
                if busy is not None and busy is not threading.current_thread():
                    raise RuntimeError(
                        f"this DataLoader (persistent_workers=True) is being iterated in thread {busy.name!r} "
                        "(a CUDAPrefetcher's, if it wraps the loader) while iter() was called on it here: "
                        "its workers serve one iteration at a time. Iterate the prefetcher, not the loader, "
                        "or give this loop its own DataLoader")
                previous._ended = True  # it would take this iteration's batches (and count them as its own)
        seam = ds.loader_seam
        seam.resolve_dist()
        seam.begin_skip_budget()
        start = seam.epoch_start(self.num_workers)
        fast = self._fast_iter(ds, start)
        if fast is not None:
            self.last_path, self.fallback_reason = "cached", None
            seam.consume_resume()
            self._draw_base_seed()
            return _loader_iter(self, fast, self._run, len(self), _gather_helpers)
        if self.decode_threads:
            self.last_path = "threads"
            pin = _cache_loader.pin_device() if self.pin_memory else None
            # a CUDAPrefetcher consumes this loader: samples land in page-locked rows (no pack)
            pin_rows = pin or ("cuda" if self.fast_path_pinned and torch.cuda.is_available() else None)
            batches = _thread_loader.thread_batches(
                ds, start, threads=self.decode_threads, batch_size=self.batch_size,  # type: ignore[arg-type]
                drop_last=self.drop_last, collate_fn=self._user_collate, pin=pin, pin_rows=pin_rows,
                timeout=self.timeout)
            seam.consume_resume()
            self._draw_base_seed()
            self._run = _Run(start, list(start.consumed))
            if self.num_workers > 0:  # a walk ending in skips reports its end, as a worker process does
                batches.positions = self._run.pos
            return _loader_iter(self, batches, self._run, len(self), _pool_helpers)
        self.last_path = "workers"
        # torch's iterator compares its batch count with the sample count of the latest len() call, which
        # may be another epoch's (an elastic resume's rest): it would warn at every batch; len() is exact here
        self._IterableDataset_len_called = None
        pool = self._iterator  # persistent workers
        if pool is not None and any(w.exitcode is not None for w in getattr(pool, "_workers", ())):
            # one died (kill -9, out of memory): torch would reuse the pool, and every later iter() raised
            # "DataLoader worker (pid(s) N) exited unexpectedly" naming the dead one; start a new pool
            pool._shutdown_workers()
            self._iterator = None
        if self.num_workers > 0:  # workers report skips after their last batch (see LoaderSeam.report_skips_inline)
            seam.report_skips_inline(self._schedule())
            if self.persistent_workers and self.preload_next_epoch:
                seam.preload_next_epoch((self.batch_size or 1) * (self.prefetch_factor or 2))
        try:
            inner = super().__iter__()  # workers now hold a copy of the dataset with the resume state
        finally:
            seam.stop_skip_reports()
            seam.preload_next_epoch(0)
        seam.consume_resume()
        self._run = _Run(start, list(start.consumed))
        if previous is not None and previous._inner is inner:  # persistent workers: torch reset that iterator
            if previous._watch is not None:
                previous._watch.stop(join=False)
        it = _loader_iter(self, inner, self._run, None, _worker_helpers)
        self._live = weakref.ref(it)
        return it

    def _get_iterator(self) -> Any:
        """torch's iterator, its workers started through ``_watchdog.WorkerInit`` (it stands in for
        ``worker_init_fn`` only while they start): each worker leaves through ``os._exit`` as a fork
        child does (``_exit``: spawn workers aborted at exit otherwise) and, with the stall watchdog on,
        can dump its stacks."""
        if self.num_workers == 0 or not isinstance(self.dataset, ShardedDataset):
            return super()._get_iterator()
        user_fn = self.worker_init_fn
        parts = [("dataset", self.dataset), ("collate_fn", self._user_collate), ("worker_init_fn", user_fn)]
        method = _start_method(self.multiprocessing_context)
        unimportable = main_without_file(method, parts) if method != "fork" else None
        if unimportable is not None:  # the workers would die while starting
            raise unimportable
        watched = _watchdog.CAN_DUMP and _watchdog.threshold(self.stall_warning, self.timeout) is not None
        stacks = _watchdog.WorkerStacks() if watched else None
        self.worker_init_fn = (stacks.init_fn(user_fn) if stacks is not None
                               else _watchdog.WorkerInit(None, user_fn))
        try:
            with _watchdog.forking_workers():
                inner = super()._get_iterator()
        except (TypeError, AttributeError, pickle.PicklingError) as e:  # what pickle raises: spawn/forkserver
            if method == "fork":
                raise
            better = explain(method, parts, e)
            if better is None:
                raise
            raise better from e
        finally:
            self.worker_init_fn = user_fn
        if stacks is not None:
            _watchdog.attach(inner, stacks)
        return inner

    def _fast_iter(self, ds: ShardedDataset, start: EpochStart) -> Iterator[Any] | None:
        """The cached fast path's batches for this epoch, or None (``fallback_reason`` says why)."""
        mode = self.cached_fast_path
        reason = "cached_fast_path=False" if mode is False else self._static_reason(forced=mode is True)
        plan: Any = None
        store = None
        if ds.loader_seam.has_cache:
            try:
                store = ds.loader_seam.cache_store()  # opened (and held) in this process too: no eviction between epochs
            except FastdataError as e:
                if mode is True:
                    raise
                reason = reason or f"the cache store cannot be opened: {e}"
        if reason is None:
            plan = _cache_loader.plan_fast_epoch(ds, store, start)
            if isinstance(plan, str):
                if mode is True:
                    raise CacheError(f"cached_fast_path=True: {plan}; fill it first (ShardedDataset.build_cache, "
                                     "`fastdata cache build`, or one epoch with cached_fast_path='auto')")
                reason = plan
        if reason is not None:
            self.fallback_reason = reason
            _log.debug("fastdata.DataLoader: epoch %d through workers: %s", start.epoch, reason)
            return None
        self._run = _Run(start, list(start.consumed))
        pin = _cache_loader.pin_device() if self.pin_memory else None
        seqs, missing = plan
        batch_size: int = self.batch_size  # type: ignore[assignment]  # not None: static_reason checks it
        if self._gather is None:  # one per loader: its threads and buffers serve every epoch
            self._gather = FastGather(self.gather_threads or default_gather_threads(), batch_size)
        return _cache_loader.cached_batches(
            ds, store, seqs, missing=missing, start=start, batch_size=batch_size,
            drop_last=self.drop_last, collate_fn=self._user_collate, pin=pin, gather=self._gather,
            pinned=self.fast_path_pinned, positions=self._run.pos if self.num_workers > 0 else None,
        )

    def _draw_base_seed(self) -> None:
        """Consume the global torch RNG as torch's iterator would (its workers' base seed), so the
        random stream of the training loop does not depend on which path an epoch took."""
        if self.persistent_workers and self.num_workers > 0:
            if self._iterator is not None or self._fast_seed_drawn:
                return
            self._fast_seed_drawn = True
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)

    def _schedule(self, num_workers: int | None = None) -> BatchSchedule:
        """How this loader deals batches over ``num_workers`` walks (default: its own ``num_workers``)."""
        return BatchSchedule(self.num_workers if num_workers is None else num_workers, self.batch_size,
                             self.drop_last)

    def _next_worker(self, run: _Run) -> int:
        """Logical worker of the next batch (the schedule's prediction from the samples each has left)."""
        left = None
        if run.last is not None and self.num_workers > 0 and not self._sharded().streaming:
            left = [c - p for c, p in zip(self._sharded().loader_seam.counts_at(run.start), run.pos)]
        return self._schedule(run.start.num_workers).next_worker(run.last, run.start.first, left)

    def state_dict(self) -> dict[str, Any]:
        """Exact position after the batches yielded so far (JSON-serialisable)."""
        ds = self._sharded()
        run = self._run
        if run is not None and run.epoch == ds.epoch:
            state = ds.loader_seam.state_at(run.epoch, run.stages_now(), self._next_worker(run))
            batches = run.batches
        else:
            state, batches = ds.state_dict(), 0
        return {"version": LOADER_STATE_VERSION, "dataset": state, "num_workers": self.num_workers,
                "batches": batches}

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from :meth:`state_dict` (or a ``ShardedDataset.state_dict()``).

        A list of every rank's state (rank order) resumes at any world size and ``num_workers``:
        the samples no rank consumed are read exactly once, each rank yielding the same number of
        batches (see ``ShardedDataset.load_state_dict``).
        """
        ds = self._sharded()
        if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
            ds.load_state_dict([s["dataset"] if "dataset" in s else s for s in state], batch_size=self.batch_size,
                               num_workers=self.num_workers, drop_last=self.drop_last)
        else:
            ds.load_state_dict(state["dataset"] if "dataset" in state else state, batch_size=self.batch_size,
                               num_workers=self.num_workers, drop_last=self.drop_last)
        self._run = None
        if self._iterator is not None:  # persistent workers hold the old state: restart them
            self._iterator._shutdown_workers()
            self._iterator = None
