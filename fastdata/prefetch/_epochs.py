"""The seamless-epoch policy of ``CUDAPrefetcher``: where the next epoch starts, and with which number.

The prefetcher asks this module, never torch's classes directly:

* ``iter_hazards(iterable)``: would ``iter(iterable)`` fork worker processes, draw from torch's
  global RNG (``sampler_draws``: which samplers do)? ``next_start(hazards)`` turns that into where
  the next epoch's ``iter()`` runs (``NextStart``: the producer thread, the consumer early, or the
  consumer at its next ``iter()``).
* ``epoch_api(iterable)``: whose ``set_epoch`` is called and whose ``epoch`` is read;
  ``resolve_epoch``: the number an epoch gets once the prefetcher's ``set_epoch`` drives it;
  ``lookahead_valid``: an epoch started ahead is kept unless the loader's epoch changed meanwhile.
* ``EpochRunner``: starts epochs under these rules, in the consumer's or the producer's thread;
  ``EpochRunner.drive`` decides what ``CUDAPrefetcher.set_epoch`` does (``SetEpoch``).

Invariants: the producer thread never runs an ``iter()`` that forks or draws from the global RNG,
and an epoch started ahead is never handed out under another epoch number. Nothing here starts a
thread. Reasoning: docs/design/prefetch.md ("Seamless epochs").
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fastdata._util import start_method

__all__ = ["EpochApi", "EpochRunner", "IterHazards", "NextStart", "SetEpoch", "epoch_api", "iter_hazards",
           "lookahead_valid", "next_start", "resolve_epoch", "sampler_draws"]

# Samplers that draw from the global RNG only without their own ``generator=``.
SEEDED_SAMPLERS = ("RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler")
# How many ``.iterable`` wrappers ``iter_hazards`` looks through to find the loader.
MAX_WRAPPERS = 8


class IterHazards(NamedTuple):
    """What ``iter()`` of an iterable would do if called now."""

    forks: bool  # starts worker processes under the fork start method
    draws: bool  # draws from torch's global RNG


class NextStart(enum.Enum):
    """Where the next epoch's ``iter()`` runs."""

    THREAD = "thread"  # the producer thread, right after it pulled the current epoch's last batch
    CONSUMER = "consumer"  # the consumer's thread, at its first next() after the producer thread ended
    AT_ITER = "at_iter"  # the consumer's thread when it iterates again, where a plain loop calls iter()


class SetEpoch(enum.Enum):
    """What ``CUDAPrefetcher.set_epoch`` does once ``EpochRunner.drive`` has recorded the epoch."""

    DONE = "done"  # the epoch started ahead has that number, or the running epoch's look-ahead will use it
    NOW = "now"  # no epoch runs or was started ahead: set the loader's epoch now (``EpochRunner.set_now``)
    DISCARD = "discard"  # an epoch started ahead has another number: stop that run, then ``set_now``


def iter_hazards(iterable: Any) -> IterHazards:
    """What ``iter(iterable)`` would do if called now.

    Only a ``torch.utils.data.DataLoader`` (fastdata's included) is inspected; any other iterable is
    taken to neither fork nor draw from torch's global RNG in its ``iter()``. A wrapper that keeps the
    loader it iterates as ``.iterable`` (``DecodeImages.ahead(loader)``, another prefetcher) is
    judged by that loader. A DataLoader forks when it has ``num_workers > 0`` worker processes to
    start (not persistent ones already alive, not fastdata's ``decode_threads``) under the ``fork``
    start method (its ``multiprocessing_context``, else the default one). It draws from the global
    RNG without ``generator=`` (its workers' base seed; persistent workers already alive skip that
    draw), through a sampler for which ``sampler_draws`` says so, or through any batch sampler other
    than ``BatchSampler``. A DataPipe dataset counts as both (torch's iterator may run collectives).
    """
    data = torch.utils.data
    seen = 0
    while not isinstance(iterable, data.DataLoader) and seen < MAX_WRAPPERS:
        inner = getattr(iterable, "iterable", None)
        if inner is None or inner is iterable:
            break
        iterable, seen = inner, seen + 1
    if not isinstance(iterable, data.DataLoader):
        return IterHazards(False, False)
    pipe = getattr(data, "IterDataPipe", None)
    if pipe is not None and isinstance(iterable.dataset, pipe):
        return IterHazards(True, True)
    workers = iterable.num_workers > 0 and not getattr(iterable, "decode_threads", 0)
    alive = workers and iterable.persistent_workers and getattr(iterable, "_iterator", None) is not None
    forks = workers and not alive and start_method(iterable.multiprocessing_context) == "fork"
    rng = iterable.generator is None and not alive
    batches = iterable.batch_sampler
    if batches is not None and type(batches) is not data.BatchSampler:
        return IterHazards(forks, True)  # a batch sampler of the user's: may draw from the global RNG
    samplers = [iterable.sampler, getattr(batches, "sampler", None)]
    return IterHazards(forks, rng or any(sampler_draws(s) for s in samplers if s is not None))


def sampler_draws(sampler: Any) -> bool:
    """Whether iterating ``sampler`` may draw from torch's global RNG: not for ``SequentialSampler``,
    ``DistributedSampler`` or an IterableDataset's sampler; for the ``SEEDED_SAMPLERS`` only without
    their own ``generator``; for any other class (subclasses included) yes, as it is unknown."""
    data = torch.utils.data
    if type(sampler) in (data.SequentialSampler, data.DistributedSampler):
        return False
    if isinstance(sampler, data.dataloader._InfiniteConstantSampler):  # an IterableDataset's: draws nothing
        return False
    if type(sampler) in tuple(getattr(data, n) for n in SEEDED_SAMPLERS):
        return getattr(sampler, "generator", None) is None
    return True


def next_start(hazards: tuple[bool, bool]) -> NextStart:
    """Where the next epoch's ``iter()`` runs, given ``(forks, draws)`` of that ``iter()``: where it
    draws from the global RNG, exactly where a plain loop would draw (so the training loop's random
    stream is that of a plain loop); where it only forks, in the consumer's thread once no thread of
    the prefetcher runs; otherwise in the producer thread."""
    forks, draws = hazards
    if draws:
        return NextStart.AT_ITER
    return NextStart.CONSUMER if forks else NextStart.THREAD


@dataclass(frozen=True)
class EpochApi:
    """The wrapped loader's epoch: ``owner.set_epoch`` sets it, ``holder.epoch`` reads it."""

    owner: Any
    holder: Any  # None: no object with an int ``epoch``; ``get()`` returns None

    def get(self) -> Any:
        return getattr(self.holder, "epoch", None)

    def set(self, value: int) -> None:
        self.owner.set_epoch(value)


def epoch_api(iterable: Any) -> EpochApi | None:
    """The first of the iterable itself (fastdata.DataLoader), its ``sampler`` (DistributedSampler)
    and its ``dataset`` (an IterableDataset) with a ``set_epoch``; None when none has one. The epoch
    is read from the first of them with an int ``epoch``."""
    candidates = [iterable, getattr(iterable, "sampler", None), getattr(iterable, "dataset", None)]
    owner = next((c for c in candidates if c is not None and callable(getattr(c, "set_epoch", None))), None)
    if owner is None:
        return None
    holder = next((c for c in candidates if c is not None and isinstance(getattr(c, "epoch", None), int)), None)
    return EpochApi(owner, holder)


def resolve_epoch(next_value: int | None, last_value: int | None, now: Any) -> int:
    """The epoch number of the next epoch once ``CUDAPrefetcher.set_epoch`` drives them: the number
    asked for (``next_value``), else the loader's own (``now``) when it was set behind the prefetcher
    since the last epoch started (``last_value``), else the last one + 1 (1 when none)."""
    if next_value is not None:
        return next_value
    if last_value is not None and now is not None and now != last_value:
        return now  # set on the loader behind the prefetcher: honoured, then + 1 from there
    return (last_value or 0) + 1


def lookahead_valid(started_value: Any, now: Any) -> bool:
    """An epoch started ahead with the loader's epoch at ``started_value`` (None: unknown) may be
    handed out while the loader's epoch is ``now``: only if it was not changed meanwhile."""
    return started_value is None or now == started_value


class EpochRunner:
    """Starts epochs of the wrapped iterable, in the consumer's thread or (look-ahead) the producer's.

    Shared by the prefetcher and its thread; holds no reference to the prefetcher. ``driven``: the
    user called ``CUDAPrefetcher.set_epoch``, so every epoch start sets the loader's epoch
    (``resolve_epoch``). ``hazards``: what ``iter()`` of the iterable would do (``iter_hazards``), which
    ``next_start`` turns into where the next epoch starts.
    """

    def __init__(self, iterable: Iterable[Any],
                 hazards: Callable[[Any], tuple[bool, bool]] = iter_hazards) -> None:
        self.iterable = iterable
        self.api = epoch_api(iterable)
        self.hazards = hazards
        self.lock = threading.Lock()
        self.driven = False
        self.next_value: int | None = None
        self.last_value: int | None = None
        self.advances = False  # iter() of the iterable moves its epoch itself
        fn = getattr(iterable, "state_dict", None)
        self.snapshot: Callable[[], Any] | None = fn if callable(fn) else None
        self.state_error: BaseException | None = None

    def current(self) -> Any:
        """The loader's epoch now (None: unknown)."""
        return self.api.get() if self.api is not None else None

    def begin(self, on_started: Callable[[Any], None] | None = None,
              ahead: bool = False) -> tuple[Iterator[Any], Any, Any]:
        """(iterator, loader state before its first batch, the loader's epoch value).

        ``ahead``: called by the thread (a look-ahead), while the consumer may set the loader's epoch.
        Its epoch value is then read before ``iter()``: an epoch set during (or after) that ``iter()``
        differs from it, and the consumer discards the epoch (``lookahead_valid``) instead of taking
        the old epoch's iterator for the new epoch. Unless ``iter()`` itself moves the epoch (seen
        in the consumer's thread, where nothing else can set it meanwhile): then the value after it."""
        with self.lock:
            if self.driven and self.api is not None:
                now = self.current()
                value = resolve_epoch(self.next_value, self.last_value, now)
                if now != value:
                    self.api.set(value)
                self.next_value, self.last_value = None, value
            before = self.current()
            source = iter(self.iterable)  # DataLoader starts/resets its workers here
            state = self._snap()
            value = self.current()
            if not ahead and value != before:
                self.advances = True  # the iterable's iter() advances its own epoch
            elif ahead and not self.advances:
                value = before
            if on_started is not None:
                on_started(value)
            return source, state, value

    def drive(self, epoch: int, run: Any) -> SetEpoch:
        """Record ``CUDAPrefetcher.set_epoch(epoch)``: from now on every epoch start sets the loader's
        epoch. ``run``: the producer's ``Run`` (None: none), whose look-ahead (``ahead``, recorded by
        ``begin``'s ``on_started`` under the lock held here), ``begun``, ``finished``, ``handoff`` and
        ``alive()`` say whether an epoch was started ahead (kept if it has this number, else discarded)
        or one is running (its look-ahead takes the number); otherwise the epoch is set now."""
        with self.lock:
            self.driven = True
            ahead = run.ahead if run is not None and run.ahead is not None and run.ahead[0] > run.begun else None
            if ahead is not None:
                if ahead[1] != epoch:
                    return SetEpoch.DISCARD
                self.next_value = None
                return SetEpoch.DONE
            busy = run is not None and run.begun > run.finished and (run.alive() or run.handoff is not None)
            if busy:  # mid-epoch: the look-ahead of the next epoch will use it
                self.next_value = epoch
                return SetEpoch.DONE
            return SetEpoch.NOW

    def set_now(self, epoch: int) -> None:
        """Set the loader's epoch at once; the next epoch starts with it."""
        assert self.api is not None
        with self.lock:
            self.api.set(epoch)
            self.next_value, self.last_value = epoch, epoch

    def restart_from_loader(self) -> None:
        """The next epoch starts with the loader's epoch as it is now (after a resume or a discard)."""
        with self.lock:
            self.next_value = self.current()

    def _snap(self) -> Any:
        if self.snapshot is None:
            return None
        try:
            return self.snapshot()
        except (TypeError, NotImplementedError) as e:  # e.g. fastdata.DataLoader over a plain dataset
            self.state_error, self.snapshot = e, None
            return None
