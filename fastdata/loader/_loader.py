"""``fastdata.DataLoader``: torch's DataLoader plus exact ``state_dict()``/``load_state_dict()``.

Over a :class:`~fastdata.ShardedDataset` an epoch takes one of three paths, chosen at each
``iter()``: the cached fast path (:mod:`._cached`: every sample in the cache store, gathered in this
process), the thread decoder (:mod:`._threads`: ``decode_threads=N``, no worker processes) or torch's
worker processes. All three yield the same batches, dealt by one
:class:`~fastdata.dataset.BatchSchedule`, and record positions the same way (:mod:`._iteration`), so
a state saved on one path resumes on another. The loader reaches the dataset only through
``dataset.loader_seam``. With any other dataset this class is torch's DataLoader unchanged
(``state_dict()`` then raises TypeError). See docs/design/loader-paths.md.
"""
from __future__ import annotations

import logging
import pickle
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch.utils.data

from fastdata._pickling import explain, main_without_file
from fastdata._util import start_method
from fastdata.dataset import BatchSchedule, EpochStart, ShardedDataset, parse_state
from fastdata.dataset import collate as collate_encoded
from fastdata.errors import CacheError, FastdataError, StateError
from fastdata.loader import _cached as _cache_loader
from fastdata.loader import _threads as _thread_loader
from fastdata.loader import _watchdog
from fastdata.loader._args import torch_arguments
from fastdata.loader._gather import FastGather, check_gather_threads, default_gather_threads
from fastdata.loader._iteration import (RESET_LOCK, LoaderIter, Run, TaggingCollate, gather_helpers, loader_iter,
                                       pool_helpers, worker_helpers)
from fastdata.loader._state import LOADER_STATE_VERSION, LoaderState, parse_loader_state

__all__ = ["DataLoader", "EpochSampler"]

_log = logging.getLogger(__name__)
_T_co = TypeVar("_T_co", covariant=True)



class EpochSampler(torch.utils.data.dataloader._InfiniteConstantSampler):
    """The sampler torch gives an IterableDataset (endless ``None``s) with ``set_epoch`` passed on to the
    ShardedDataset: a trainer that sets the epoch through ``loader.sampler`` (Lightning does, before each
    epoch's ``iter()``) reaches the dataset, whose order then changes every epoch."""

    def __init__(self, dataset: ShardedDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """Drop-in ``torch.utils.data.DataLoader`` with exact resume for :class:`ShardedDataset`.

    ``state_dict()`` captures the position after the batches yielded so far;
    ``load_state_dict()`` makes the next iteration yield exactly the remaining samples of that
    epoch: in the same order with the same ``num_workers``; exactly once but in another order
    with a different ``num_workers``. The state is checked in full before anything changes
    (``StateError``; ``check_state_dict()`` checks without loading); it applies to the next
    ``iter()``: an iterator made before the load raises ``StateError`` at its next ``next()``.
    ``len()`` is the exact number of batches per epoch (each worker yields its own final partial
    batch unless ``drop_last``). Generic like torch's (``DataLoader[dict]``); torch's arguments are
    taken with torch's meaning (``pin_memory=1``, ``prefetch_factor=2.0``, ``timeout=math.inf``;
    see ``_args``). Over a ShardedDataset, ``accelerate``'s ``Accelerator.prepare`` returns the
    loader itself (it already splits the data per rank) and its ``save_state``/``load_state`` keep
    its position (docs/guide/trainers.md).

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

    ``pin_fast_path()``: gather the cached fast path's batches straight into page-locked buffers even
    without ``pin_memory``; ``CUDAPrefetcher`` calls it on the loader it wraps (on a CUDA device), so
    its host-to-device copies need no pack. The thread decoder (``decode_threads``) then writes its
    samples into page-locked batch rows too. ``fast_path_pinned`` (read-only) says whether it was called.
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
        self._fast_path_pinned = False  # pin_fast_path()
        self._gather: FastGather | None = None
        self.decode_threads = _thread_loader.check_threads(decode_threads)
        arguments = torch_arguments(dataset, args, kwargs)
        with warnings.catch_warnings():
            if decode_threads:  # no worker processes start: torch's advice on their number does not apply
                warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
            super().__init__(**arguments)
        if decode_threads:
            why = _thread_loader.static_reason(dataset, batch_size=self.batch_size, worker_init_fn=self.worker_init_fn)
            if why is not None:
                raise ValueError(f"decode_threads={decode_threads}: {why}")
        self._run: Run | None = None
        self._live: weakref.ref[LoaderIter] | None = None  # the latest worker-path iterator
        self._iters: weakref.WeakSet[LoaderIter] = weakref.WeakSet()  # every iterator: a load ends them
        self._loaded: tuple[int, int, int | None] | None = None  # (epoch, batches, num_workers) of the last load
        self.cached_fast_path = mode
        self.last_path: str | None = None  # "cached", "threads" or "workers": the path the latest iteration took
        self.fallback_reason: str | None = None  # why the latest iteration did not take the fast path
        self._fast_seed_drawn = False
        if getattr(dataset, "image_decode", "cpu") == "device" and self.collate_fn is torch.utils.data.default_collate:
            self.collate_fn = collate_encoded  # EncodedImage fields -> one PackedImages per field and batch
        if mode is True:
            reason = self._static_reason(forced=True)
            if reason is not None:
                raise ValueError(f"cached_fast_path=True: {reason}")
        sharded = isinstance(dataset, ShardedDataset)
        if sharded:  # torch refuses sampler= for an IterableDataset, and setting it later: replaced as torch set it
            object.__setattr__(self, "sampler", EpochSampler(dataset))
        # Accelerate's prepare() rebuilds a DataLoader from this one's arguments, unless it was prepared
        # already: this one splits the data per rank itself (a rebuilt one would split it again, or
        # dispatch one rank's part to every rank) and, as a stateful loader, has its position saved by
        # save_state and restored by load_state (docs/guide/trainers.md)
        self._is_accelerate_prepared = sharded
        self.use_stateful_dataloader = sharded

    def _static_reason(self, *, forced: bool) -> str | None:
        return _cache_loader.static_reason(self.dataset, batch_size=self.batch_size, collate_fn=self.collate_fn,
                                           worker_init_fn=self.worker_init_fn, forced=forced)

    def _sharded(self) -> ShardedDataset:
        if not isinstance(self.dataset, ShardedDataset):
            raise TypeError(f"state_dict/load_state_dict need a fastdata.ShardedDataset, got {type(self.dataset).__name__}")
        return self.dataset

    def set_epoch(self, epoch: int) -> None:
        """``dataset.set_epoch(epoch)`` (reaches persistent workers too)."""
        self._sharded().set_epoch(epoch)

    @property
    def fast_path_pinned(self) -> bool:
        """Whether :meth:`pin_fast_path` was called (then batches of the fast paths are page-locked)."""
        return self._fast_path_pinned

    def pin_fast_path(self) -> None:
        """Build the cached fast path's and the thread decoder's batches in page-locked memory from the
        next ``iter()`` on, even without ``pin_memory``, for a consumer that copies them to a CUDA
        device (``CUDAPrefetcher`` calls it): its copies then need no pack into pinned memory."""
        self._fast_path_pinned = True

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
            with RESET_LOCK:  # persistent workers: torch resets the iterator `previous` reads from
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
            return self._track(loader_iter(self, fast, self._run, len(self), gather_helpers))
        if self.decode_threads:
            self.last_path = "threads"
            pin = _cache_loader.pin_device() if self.pin_memory else None
            # a CUDAPrefetcher consumes this loader: samples land in page-locked rows (no pack)
            pin_rows = pin or ("cuda" if self.fast_path_pinned and torch.cuda.is_available() else None)
            batches = _thread_loader.thread_batches(
                ds, start, threads=self.decode_threads, batch_size=self.batch_size,  # type: ignore[arg-type]
                drop_last=self.drop_last, collate_fn=self.collate_fn, pin=pin, pin_rows=pin_rows,
                timeout=self.timeout)
            seam.consume_resume()
            self._draw_base_seed()
            self._run = self._new_run(start)
            if self.num_workers > 0:  # a walk ending in skips reports its end, as a worker process does
                batches.positions = self._run.pos
            return self._track(loader_iter(self, batches, self._run, len(self), pool_helpers))
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
        self._run = self._new_run(start)
        if previous is not None and previous._inner is inner:  # persistent workers: torch reset that iterator
            if previous._watch is not None:
                previous._watch.stop(join=False)
        it = loader_iter(self, inner, self._run, None, worker_helpers)
        self._live = weakref.ref(it)
        return self._track(it)

    def _new_run(self, start: EpochStart) -> Run:
        """The record of an iteration from ``start``; one that starts at a loaded state counts on from its
        ``batches`` (the batches of the epoch handed out before it)."""
        loaded, self._loaded = self._loaded, None
        carried = loaded[1] if loaded is not None and start.resumed and loaded[0] == start.epoch else 0
        return Run(start, list(start.consumed), batches=carried)

    def _track(self, it: LoaderIter) -> LoaderIter:
        self._iters.add(it)
        return it

    def _get_iterator(self) -> Any:
        """torch's iterator, its workers started through ``_watchdog.WorkerInit`` (it stands in for
        ``worker_init_fn`` only while they start): each worker leaves through ``os._exit`` as a fork
        child does (``_exit``: spawn workers aborted at exit otherwise) and, with the stall watchdog on,
        can dump its stacks. Over a ShardedDataset its collate tags each batch with the position of the
        walk that made it (``TaggingCollate``; the loader's iterator strips the tag): set only while
        torch's iterator is built, so ``collate_fn`` stays the user's for anyone who reads it."""
        if not isinstance(self.dataset, ShardedDataset):
            return super()._get_iterator()
        user_collate = self.collate_fn
        self.collate_fn = TaggingCollate(user_collate, self.dataset.loader_seam.token, self._schedule())
        try:
            return self._torch_iterator(user_collate)
        finally:
            self.collate_fn = user_collate

    def _torch_iterator(self, user_collate: Any) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        user_fn = self.worker_init_fn
        parts = [("dataset", self.dataset), ("collate_fn", user_collate), ("worker_init_fn", user_fn)]
        method = start_method(self.multiprocessing_context)
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
        seam = ds.loader_seam
        if seam.has_cache:
            try:
                store = seam.cache_store()  # opened (and held) in this process too: no eviction between epochs
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
        self._run = self._new_run(start)
        pin = _cache_loader.pin_device() if self.pin_memory else None
        seqs, missing = plan
        batch_size: int = self.batch_size  # type: ignore[assignment]  # not None: static_reason checks it
        if self._gather is None:  # one per loader: its threads and buffers serve every epoch
            self._gather = FastGather(self.gather_threads or default_gather_threads(), batch_size)
        return _cache_loader.cached_batches(
            ds, store, seqs, missing=missing, start=start, batch_size=batch_size,
            drop_last=self.drop_last, collate_fn=self.collate_fn, pin=pin, gather=self._gather,
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

    def _next_worker(self, run: Run) -> int:
        """Logical worker of the next batch (the schedule's prediction from the samples each has left)."""
        left = None
        if run.last is not None and self.num_workers > 0 and not self._sharded().streaming:
            left = [c - p for c, p in zip(self._sharded().loader_seam.counts_at(run.start), run.pos)]
        return self._schedule(run.start.num_workers).next_worker(run.last, run.start.first, left)

    def state_dict(self) -> dict[str, Any]:
        """Exact position after the batches handed out so far (JSON-serialisable): ``{"version",
        "dataset" (the ShardedDataset's state), "num_workers" (of its positions), "batches" (handed out
        in this epoch so far, across resumes)}``. Right after ``load_state_dict(s)`` it is ``s``."""
        ds = self._sharded()
        run = self._run
        if run is not None and run.epoch == ds.epoch:
            state = ds.loader_seam.state_at(run.epoch, run.stages_now(), self._next_worker(run))
            return {"version": LOADER_STATE_VERSION, "dataset": state, "num_workers": self.num_workers,
                    "batches": run.batches}
        batches, num_workers = 0, self.num_workers
        loaded = self._loaded
        if loaded is not None and loaded[0] == ds.epoch and ds.loader_seam.resume_pending():
            batches = loaded[1]
            num_workers = self.num_workers if loaded[2] is None else loaded[2]
        return {"version": LOADER_STATE_VERSION, "dataset": ds.state_dict(), "num_workers": num_workers,
                "batches": batches}

    def check_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Raise ``StateError`` (naming the field, its value and the logical worker where one is meant)
        if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        ds = self._sharded()
        parsed = self._parse_state(ds, state)
        ds.loader_seam.check_state(parsed.dataset, self.batch_size, self.num_workers, self.drop_last)

    def _parse_state(self, ds: ShardedDataset, state: Any) -> LoaderState:
        """``parse_loader_state(state)``, and for a streaming source, whose walks cannot be split again, the
        worker count of its positions against this loader's (else refused only when the epoch starts)."""
        parsed = parse_loader_state(state)
        if ds.streaming:
            parts = parsed.dataset if isinstance(parsed.dataset, list) else [parsed.dataset]
            for part in parts:
                stages = parse_state(part).stages
                if stages and stages[-1][0] != max(1, self.num_workers):
                    raise StateError(f"state_dict: its positions are of num_workers={stages[-1][0]}; a streaming "
                                     f"(URL) source resumes only with the num_workers it was saved with, this "
                                     f"loader has num_workers={self.num_workers}")
        return parsed

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from :meth:`state_dict` (or a ``ShardedDataset.state_dict()``) at the next ``iter()``.

        The whole state is checked first (``StateError``; nothing changes then). An iterator of this
        loader made before the load ends: its next ``next()`` raises ``StateError`` (the state applies to
        the next ``iter()``, torchdata's rule), so it can neither replay the epoch nor end it in silence.
        Refused while another thread is inside ``next()`` of this loader's iterator (a ``CUDAPrefetcher``'s:
        load through the prefetcher). A list of every rank's state (rank order) resumes at any world size
        and ``num_workers``: the samples no rank consumed are read exactly once, each rank yielding the
        same number of batches (see ``ShardedDataset.load_state_dict``).
        """
        ds = self._sharded()
        parsed = self._parse_state(ds, state)
        with RESET_LOCK:
            busy = next((it._busy for it in list(self._iters) if it._busy is not None
                         and it._busy is not threading.current_thread()), None)
        if busy is not None:
            raise StateError(
                f"load_state_dict while thread {busy.name!r} is inside next() of this loader's iterator (a "
                "CUDAPrefetcher's, if one wraps the loader): call the prefetcher's load_state_dict (it stops its "
                "thread first), or load the state before the loop")
        ds.load_state_dict(parsed.dataset, batch_size=self.batch_size, num_workers=self.num_workers,
                           drop_last=self.drop_last)  # checks everything before it changes anything
        self._loaded = (ds.epoch, parsed.batches, parsed.num_workers)
        self._run = None
        with RESET_LOCK:
            stale = list(self._iters)
        for it in stale:
            it.invalidate()
        if self._iterator is not None:  # persistent workers hold the old state: restart them
            self._iterator._shutdown_workers()
            self._iterator = None
