"""``CUDAPrefetcher``: overlap loading and host-to-device copies with compute, across epochs.

This module is the consumer's side: iteration, the hand-over of each staged batch, epochs begun
by the consumer, ``set_epoch``, exact resume (``state_dict`` as of the last batch handed over),
shutdown and statistics. A producer thread (``_producer``) pulls batches from the wrapped iterable
and stages them (``_stage``: pinned ring, side-stream copies, device transforms) into a pipe with a
memory bound (``_queue``); where each next epoch starts is the epoch policy's decision (``_epochs``).
Without CUDA the same thread and pipe give a CPU prefetcher with identical semantics.

Invariants: one run (thread and pipe) at a time per prefetcher; errors of the thread are raised at
the batch where they happened; a thread still running when the interpreter exits is stopped first
(``_stop_runs_at_exit``). Design: docs/design/prefetch.md.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fastdata._runtime import at_exit
from fastdata.errors import StateError
from fastdata.prefetch._epochs import EpochRunner, SetEpoch, lookahead_valid
from fastdata.prefetch._epochs import iter_hazards as _iter_hazards
from fastdata.prefetch._options import PrefetchOptions, resolve_device
from fastdata.prefetch._producer import RUNS, Run, note
from fastdata.prefetch._queue import CLOSED, END, EpochStart, Failure, Pipe, Stats, perf_counter
from fastdata.prefetch._stage import CpuStager, CudaStager, default_pack_threads
from fastdata.prefetch.tree import keys_matcher

__all__ = ["CUDAPrefetcher"]

# How long break/close wait for the thread (it can only stop between two next() calls of the wrapped
# iterable) before warning and leaving the daemon thread to finish that call on its own.
JOIN_TIMEOUT_S = 10.0


def _stop_runs_at_exit() -> None:
    """atexit: stop the producer threads still running (a prefetcher never closed, its next epoch
    started ahead) and wait for them, at most ``JOIN_TIMEOUT_S`` in all. A daemon thread that is in
    torch code when the interpreter finalizes is ended by ``pthread_exit``, whose unwinding through
    torch's C++ frames aborted the process at the end of a script that had run normally ("terminate
    called without an active exception", exit status 134)."""
    runs = [run for run in list(RUNS) if run.alive()]
    for run in runs:
        run.pipe.stop.set()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for run in runs:
        thread = run.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


at_exit(__name__, "stop the prefetchers' producer threads before the interpreter finalizes", _stop_runs_at_exit)


class CUDAPrefetcher:
    """Iterate ``iterable`` with every tensor of every batch already on ``device``.

    Args:
        iterable: a DataLoader or any re-iterable of batches (tensors, possibly nested in dicts, lists,
            tuples, namedtuples and dataclasses; other values pass through untouched).
        device: ``None`` (CUDA when available, ``cuda:$LOCAL_RANK``; else CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``, an index or a ``torch.device``.
        depth: batches staged ahead of the one the consumer holds. Device memory held for batches
            never exceeds ``depth + 1`` batches (those staged and the one ``next()`` returns) plus the
            previous batch the consumer still holds, at epoch boundaries too; pinned staging memory is
            ``depth + 1`` slots of the largest packed batch (+ at most 1/16).
        transform: ``batch -> batch`` applied after the move, on the side stream (CUDA) or in the
            background thread (CPU); e.g. ``fastdata.gpu.Normalize(...)``.
        keep_on_host: keys (dict keys, field names or indices) whose values stay where they are.
        seamless: start the next epoch's iterator as soon as the current one is exhausted (before
            the consumer has taken its last batches) where that is safe and exact; see below. With
            ``set_epoch`` called on the prefetcher, each look-ahead epoch gets the next epoch number.
        pack_threads: threads that pack pageable batches into pinned memory (default: a quarter of
            the usable cores, at most 4).
        stream_priority: ``"normal"`` (default) or ``"high"``: the CUDA priority of the side stream
            that copies and runs ``transform``. With ``"high"`` the GPU schedules the transform's
            kernels (e.g. the device decode stage's resampling) ahead of queued training kernels
            instead of behind them. No effect on the CPU.

    Use it on one stream: the consumer's current stream at each ``next()`` waits for the batch.
    Iterating again starts the next epoch (an unfinished one is stopped first). Errors raised by the
    iterable or the transform are re-raised at the batch where they happened, with their traceback.

    Where the next epoch's ``iter()`` runs (``seamless=True``), decided at the end of each epoch:

    * In the background thread, right after the current epoch's last batch was pulled, when that
      ``iter()`` neither forks nor draws from the global torch RNG: any iterable that is not a
      ``torch.utils.data.DataLoader`` nor wraps one as ``.iterable`` (as ``DecodeImages.ahead(loader)``
      does; its ``iter()`` is taken to do neither), or a DataLoader (torch's or fastdata's) with
      ``generator=`` and a sampler that uses it (the default one, a ``DistributedSampler``, or a
      ``(Subset|Weighted)RandomSampler`` with its own generator) whose ``iter()`` starts no worker
      process: ``num_workers=0``, fastdata's ``decode_threads=``, persistent workers already alive, or a
      ``spawn``/``forkserver`` ``multiprocessing_context``.
    * In the consumer's thread, at its first ``next()`` after the background thread has ended (it ends
      after the epoch's last batch instead; the consumer then starts a new one that stages into the
      same memory bound), when ``iter()`` forks worker processes (``num_workers > 0`` under the
      ``fork`` start method, not persistent or not yet started) but draws nothing from the global
      RNG: no thread of the prefetcher runs while the workers fork.
    * In the consumer's thread when it iterates the prefetcher again, exactly where a plain loop calls
      ``iter(loader)``, when ``iter()`` draws from the global RNG (a DataLoader without ``generator=``
      draws its workers' base seed; a ``RandomSampler`` without one, or an unknown sampler class, may
      draw): the training loop's random stream is then that of a plain loop, but that epoch's start-up
      is not hidden. Give the loader a ``generator=`` to keep epochs seamless.

    Random draws the loader makes later, in its ``next()`` (a map-style dataset with
    ``num_workers=0`` drawing in ``__getitem__``), happen in the background thread in any case.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        *,
        device: str | int | torch.device | None = None,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        keep_on_host: Iterable[str | int] | str | int = (),
        seamless: bool = True,
        pack_threads: int | None = None,
        stream_priority: str = "normal",
    ) -> None:
        if not isinstance(iterable, Iterable):
            raise ValueError(f"iterable must be iterable, got {type(iterable).__name__}")
        if isinstance(iterable, Iterator):
            warnings.warn(
                "CUDAPrefetcher wraps a one-shot iterator: only the first epoch will have batches",
                stacklevel=2,
            )
        self.options = PrefetchOptions(depth=depth, keep_on_host=keep_on_host, transform=transform,
                                       seamless=seamless, pack_threads=pack_threads,
                                       stream_priority=stream_priority)
        self.device = resolve_device(device)
        self._iterable = iterable
        pin = getattr(iterable, "pin_fast_path", None)
        if self.device.type == "cuda" and callable(pin):
            pin()  # fastdata.DataLoader: gather cached batches straight into page-locked memory (no pack)
        self._epochs = EpochRunner(iterable, hazards=_iter_hazards)  # the module's name: replaceable in tests
        self._stats = Stats()
        skip = keys_matcher(self.options.keep_on_host)
        if self.device.type == "cuda":
            threads = pack_threads if pack_threads is not None else default_pack_threads()
            self._stager: CpuStager | CudaStager = CudaStager(
                self.device, slots=depth + 1, transform=transform, skip=skip, stats=self._stats,
                pack_threads=threads, high_priority=stream_priority == "high",
            )
        else:
            self._stager = CpuStager(transform, skip)
        self._run: Run | None = None
        # __iter__ and _stop_run from several consumer threads: one run at a time on the staging slots
        self._run_lock = threading.RLock()
        self._recent: deque[Any] = deque(maxlen=depth)  # credits of the last hand-overs
        self._closed = False
        self._state: Any = None  # the wrapped loader's state after the last batch handed over
        self._loads = 0  # load_state_dict calls: an iterator made before one raises StateError
        self._warned_epoch = False

    @property
    def iterable(self) -> Iterable[Any]:
        """The wrapped iterable (e.g. for its settings; iterating it directly bypasses the prefetch)."""
        return self._iterable

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # TypeError if the iterable has none

    # --- epochs --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        with self._run_lock:  # another thread's iter() waits until this run has started, then ends it
            if self._closed:
                raise RuntimeError("CUDAPrefetcher is closed")
            run = self._run
            if run is not None and self._continues(run):
                number = run.finished + 1
                run.claimed = number
                run.request(number)
                if run.handoff is not None and run.handoff[0] == number:  # the thread left it to us
                    self._begin_next(run)
            else:
                self._stop_run()
                run, number = self._start_run(), 0
        return self._consume(run, number)

    def _continues(self, run: Run) -> bool:
        """The consumer took the run's latest epoch to its end and the thread goes on (or left a word)."""
        return (self.options.seamless and run.finished == run.claimed and not run.pipe.stop.is_set()
                and (run.alive() or not run.pipe.items.empty() or run.handoff is not None))

    def _start_run(self) -> Run:
        credits = [None] * (self.options.depth - len(self._recent)) + list(self._recent)
        run = Run(Pipe(credits))
        source, state, value = self._epochs.begin()  # in the caller's thread
        self._state = state  # state_dict() before the first batch: this epoch's start, not the last run's
        run.pipe.items.put(EpochStart(0, state, value))
        self._run = run
        run.start(source, self._epochs, self._stager, self._stats, self.device, self.options.seamless)
        return run

    def _consume(self, run: Run, number: int) -> Iterator[Any]:
        finished = False
        loads = self._loads
        try:
            t0 = perf_counter()
            while True:
                if self._loads != loads:
                    raise StateError(
                        "this iterator was made before load_state_dict() on its CUDAPrefetcher; the loaded state "
                        "applies to the next iter(prefetcher): iterate the prefetcher again")
                handoff = run.handoff
                if handoff is not None and (handoff[0] == number or (handoff[1] and handoff[0] == number + 1)):
                    self._begin_next(run)
                item = run.pipe.get(run.alive)
                if isinstance(item, EpochStart):
                    if item.number != number:
                        raise RuntimeError(f"fastdata prefetch: epoch {item.number} arrived, expected {number}")
                    if number > 0 and not self._ahead_still_valid(item):
                        self._stats.add(lookahead_discarded=1)
                        self._stop_run()
                        self._epochs.restart_from_loader()  # restart with the epoch the loader was set to
                        run, number = self._start_run(), 0
                        continue
                    run.begun = number
                    self._state = item.state
                    self._stats.add(epochs=1)
                    continue
                if isinstance(item, Failure):
                    error, item = item.error, None
                    try:
                        raise error
                    finally:  # no cycle frame -> error -> traceback -> frame (see _util.release_frames)
                        del error
                if item is END:
                    run.finished = number
                    finished = True
                    return
                if item is CLOSED:
                    return
                batch, credit = self._stager.handover(item)
                run.pipe.credits.put(credit)
                self._recent.append(credit)
                self._stats.add_wait(perf_counter() - t0, item.nbytes)
                if item.state is not None:
                    self._state = item.state
                item = None  # the generator frame must not keep the batch alive past the consumer
                yield batch
                batch = None
                t0 = perf_counter()
        finally:
            if not finished and self._run is run:
                self._stop_run()

    def _begin_next(self, run: Run) -> None:
        """Start the epoch the thread left to the consumer (``run.handoff``), in this thread, once the
        thread has ended (so no other thread of ours runs while the loader may fork its workers),
        and a new thread that stages it into the same pipe and credits."""
        assert run.handoff is not None
        number, early = run.handoff
        run.handoff = None
        thread = run.thread
        if thread is not None:
            thread.join(JOIN_TIMEOUT_S)  # it has staged its last batch: only END and its exit are left
            if thread.is_alive():
                run.pipe.items.put(Failure(RuntimeError(f"{thread.name} did not end after its epoch")))
                return

        def started(value: Any) -> None:
            run.ahead = (number, value)

        try:
            source, state, value = self._epochs.begin(started)
        except Exception as e:  # noqa: BLE001  surfaces at that epoch, like a look-ahead's error
            note(e, f"raised while starting epoch {number} (iter() of the wrapped iterable)")
            run.pipe.items.put(Failure(e))
            return
        if early:
            self._stats.add(lookahead_epochs=1)
        run.pipe.items.put(EpochStart(number, state, value))
        run.start(source, self._epochs, self._stager, self._stats, self.device, self.options.seamless, number)

    def _ahead_still_valid(self, start: EpochStart) -> bool:
        """A look-ahead epoch is kept unless the loader's epoch was changed behind the prefetcher."""
        if lookahead_valid(start.epoch_value, self._epochs.current()):
            return True
        if not self._warned_epoch:
            self._warned_epoch = True
            warnings.warn(
                f"CUDAPrefetcher: the wrapped loader's epoch changed to {self._epochs.current()!r} after the "
                f"prefetcher had started epoch {start.epoch_value!r} ahead; that epoch was discarded and "
                "restarted. Call CUDAPrefetcher.set_epoch() instead of the loader's to keep epochs seamless.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False

    def set_epoch(self, epoch: int) -> None:
        """Set the wrapped loader's epoch for the next epoch (``loader.set_epoch``, else its sampler's or
        dataset's), and from then on start every epoch with the previous epoch + 1 unless this is
        called again (an epoch set on the loader itself meanwhile is kept, and + 1 goes on from it).
        An epoch already started ahead with another number is discarded."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        ep = self._epochs
        if ep.api is None:
            raise TypeError(f"the wrapped {type(self._iterable).__name__} has no set_epoch() "
                            "(nor has its sampler or dataset)")
        action = ep.drive(epoch, self._run)
        if action is SetEpoch.DONE:
            return
        if action is SetEpoch.DISCARD:
            self._stats.add(lookahead_discarded=1)
            self._stop_run()
        ep.set_now(epoch)

    # --- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> Any:
        """The wrapped loader's ``state_dict()`` as of the last batch handed to the consumer.

        The background thread reads ahead (into the next epoch, too), so the loader's own
        ``state_dict()`` counts batches still in flight; this one is snapshotted right after each
        batch was pulled and handed over with it, so resuming from it replays nothing and skips nothing.
        """
        if self._epochs.state_error is not None:
            return self._iterable.state_dict()  # type: ignore[attr-defined]  # raises its own error again
        if not callable(getattr(self._iterable, "state_dict", None)):
            raise TypeError(f"the wrapped {type(self._iterable).__name__} has no state_dict()")
        if self._run is None and self._state is None:
            return self._iterable.state_dict()  # type: ignore[attr-defined]
        return self._state

    def load_state_dict(self, state: Any) -> None:
        """Stop the current epoch and pass ``state`` to the wrapped loader's ``load_state_dict``; it
        applies to the next ``iter()``.

        A loader with ``check_state_dict`` (``fastdata.DataLoader``) checks ``state`` first: a bad one is
        its ``StateError``, and nothing changes (the epoch goes on). An iterator of this prefetcher
        made before the load raises ``StateError`` at its next ``next()``.
        """
        fn = getattr(self._iterable, "load_state_dict", None)
        if not callable(fn):
            raise TypeError(f"the wrapped {type(self._iterable).__name__} has no load_state_dict()")
        self.check_state_dict(state)
        self._loads += 1
        self._stop_run()
        fn(state)
        self._state = None
        if self._epochs.driven:  # the next epoch is the resumed one, not the one after it
            self._epochs.restart_from_loader()

    def check_state_dict(self, state: Any) -> None:
        """The wrapped loader's ``check_state_dict(state)`` where it has one (``StateError`` for a state
        its ``load_state_dict`` would refuse); changes nothing."""
        check = getattr(self._iterable, "check_state_dict", None)
        if callable(check):
            check(state)

    # --- shutdown --------------------------------------------------------------------------------

    def _stop_run(self, *, wait: bool = True) -> None:
        with self._run_lock:
            self._stop_run_locked(wait)

    def _stop_run_locked(self, wait: bool) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        for item in run.pipe.drain():
            self._stats.add(queued_bytes=-getattr(item, "nbytes", 0))
        thread = run.thread
        if not wait or thread is None or thread is threading.current_thread():
            return
        thread.join(JOIN_TIMEOUT_S)
        for item in run.pipe.drain():
            self._stats.add(queued_bytes=-getattr(item, "nbytes", 0))
        if thread.is_alive():
            warnings.warn(
                f"{thread.name}: the wrapped iterable's next() has not returned after {JOIN_TIMEOUT_S:.0f} s;"
                " the daemon thread will exit when it does",
                RuntimeWarning,
                stacklevel=4,
            )
        self._stager.fold()

    def close(self) -> None:
        """Stop the background thread and free the staging buffers. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._stop_run()
        self._stager.release()

    def __enter__(self) -> CUDAPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            self._stop_run_locked(False)  # no lock: nothing else refers to this object any more
        except Exception:  # noqa: BLE001  interpreter shutdown: nothing left to report to
            pass

    # --- statistics ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters since construction or ``reset_stats()``.

        ``batches``, ``epochs`` (begun by the consumer), ``lookahead_epochs`` (started before the
        consumer took the previous epoch's last batch, by the thread or by the consumer), ``lookahead_discarded`` (started ahead, then discarded because the epoch changed);
        ``wait_s`` (total time the consumer waited in ``next()``), ``wait_p50_s``, ``wait_p99_s``,
        ``wait_max_s`` (per batch, last 100k batches); ``load_s`` (thread time in the iterable's
        ``next()``), ``stage_s`` (thread time packing and issuing copies), ``pack_s`` and ``pack_gbps``
        (packing pageable tensors into pinned memory; ``pack_threads`` threads), ``throttle_s``
        (thread time held back by the memory bound); ``bytes`` (host-to-device bytes issued),
        ``copy_s`` and ``copy_gbps`` (device time of the copies, from CUDA events; lags a few batches
        behind ``bytes`` during an epoch); ``pinned_bytes`` (staging memory held), ``pinned_allocs``,
        ``queued_bytes`` (device bytes staged but not yet handed over), ``peak_batch_bytes``,
        ``depth``, ``device``.
        """
        out = self._stats.snapshot()
        out.update(
            pinned_bytes=self._stager.pinned_bytes,
            pinned_allocs=self._stager.pinned_allocs,
            pack_threads=self._stager.pack_threads,
            depth=self.options.depth,
            device=str(self.device),
        )
        return out

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after warm-up); memory figures (``pinned_bytes``, ``pinned_allocs``,
        ``queued_bytes``) are not counters and stay."""
        self._stats.reset()

    def __repr__(self) -> str:
        return f"CUDAPrefetcher({self._iterable!r}, device={str(self.device)!r}, depth={self.options.depth})"
