"""The seamless-epoch policy alone (``fastdata.prefetch._epochs``), without a prefetcher or a thread:
which samplers draw from the global RNG, which loaders fork, where the next epoch starts, whose
``set_epoch`` is used, which number an epoch gets, what ``CUDAPrefetcher.set_epoch`` does, and when an
epoch started ahead is still valid."""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch.utils import data

from fastdata.loader import DataLoader as FastLoader
from fastdata.prefetch._epochs import (
    EpochRunner,
    IterHazards,
    NextStart,
    SetEpoch,
    epoch_api,
    iter_hazards,
    lookahead_valid,
    next_start,
    resolve_epoch,
    sampler_draws,
)

ITEMS = [torch.full((2,), i) for i in range(8)]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class _Stream(data.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class _EpochStream(_Stream):
    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


# --- which samplers draw from the global RNG --------------------------------------------------------


@pytest.mark.parametrize(("make", "draws"), [
    (lambda: data.SequentialSampler(ITEMS), False),
    (lambda: data.DistributedSampler(ITEMS, num_replicas=2, rank=0, shuffle=True), False),
    (lambda: data.RandomSampler(ITEMS), True),
    (lambda: data.RandomSampler(ITEMS, generator=_generator()), False),
    (lambda: data.SubsetRandomSampler([0, 1, 2]), True),
    (lambda: data.SubsetRandomSampler([0, 1, 2], generator=_generator()), False),
    (lambda: data.WeightedRandomSampler([1.0, 2.0], 4), True),
    (lambda: data.WeightedRandomSampler([1.0, 2.0], 4, generator=_generator()), False),
    (lambda: type("Mine", (data.Sampler,), {"__iter__": lambda self: iter([0])})(), True),  # unknown: may draw
    (lambda: type("Sub", (data.RandomSampler,), {})(ITEMS, generator=_generator()), True),  # a subclass: unknown
], ids=["sequential", "distributed", "random", "random+generator", "subset", "subset+generator", "weighted",
        "weighted+generator", "unknown", "random-subclass"])
def test_which_samplers_draw_from_the_global_rng(make, draws: bool) -> None:
    assert sampler_draws(make()) is draws


def test_an_iterable_datasets_sampler_draws_nothing() -> None:
    loader = data.DataLoader(_Stream(), batch_size=2, generator=_generator())
    assert type(loader.sampler).__name__ == "_InfiniteConstantSampler" and not sampler_draws(loader.sampler)
    assert iter_hazards(loader) == (False, False)


# --- what iter() of a loader would do ---------------------------------------------------------------


def test_an_iterable_that_is_no_loader_neither_forks_nor_draws() -> None:
    assert iter_hazards(ITEMS) == IterHazards(forks=False, draws=False)
    assert iter_hazards(iter(ITEMS)) == (False, False)


def test_a_loader_draws_without_its_own_generator_or_with_a_drawing_sampler() -> None:
    assert iter_hazards(data.DataLoader(ITEMS, batch_size=2)) == (False, True)  # its workers' base seed
    assert iter_hazards(data.DataLoader(ITEMS, batch_size=2, generator=_generator())) == (False, False)
    seeded = data.DataLoader(ITEMS, batch_size=2, shuffle=True, generator=_generator())  # the sampler uses it
    assert iter_hazards(seeded) == (False, False)
    own = data.DataLoader(ITEMS, batch_size=2, sampler=data.RandomSampler(ITEMS), generator=_generator())
    assert iter_hazards(own) == (False, True)  # the sampler has no generator of its own


def test_a_batch_sampler_of_the_users_may_draw() -> None:
    class Batches(data.Sampler):
        def __iter__(self) -> Iterator[list[int]]:
            return iter([[0, 1], [2, 3]])

        def __len__(self) -> int:
            return 2

    loader = data.DataLoader(ITEMS, batch_sampler=Batches(), generator=_generator())
    assert iter_hazards(loader) == (False, True)
    plain = data.DataLoader(ITEMS, batch_sampler=data.BatchSampler(data.SequentialSampler(ITEMS), 2, False),
                            generator=_generator())
    assert iter_hazards(plain) == (False, False)


@pytest.mark.parametrize("method", [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()])
def test_worker_processes_fork_only_under_the_fork_start_method(method: str) -> None:
    loader = data.DataLoader(ITEMS, batch_size=2, num_workers=2, generator=_generator(),
                             multiprocessing_context=mp.get_context(method))
    assert iter_hazards(loader) == (method == "fork", False)


def test_persistent_workers_already_alive_neither_fork_nor_draw() -> None:
    loader = data.DataLoader(ITEMS, batch_size=2, num_workers=2, persistent_workers=True,
                             multiprocessing_context=mp.get_context("fork") if "fork" in mp.get_all_start_methods()
                             else None)
    assert iter_hazards(loader).draws  # not started yet: they draw their base seed
    loader._iterator = object()  # what torch keeps while persistent workers are alive
    assert iter_hazards(loader) == (False, False)


def test_decode_threads_start_no_worker_processes() -> None:
    loader = FastLoader(ITEMS, batch_size=2, num_workers=2, generator=_generator(),
                        multiprocessing_context=mp.get_context("fork") if "fork" in mp.get_all_start_methods()
                        else None)
    assert iter_hazards(loader).forks is ("fork" in mp.get_all_start_methods())
    loader.decode_threads = 2  # a ShardedDataset's thread decoder: workers are threads, not processes
    assert iter_hazards(loader) == (False, False)


def test_a_wrapper_is_judged_by_the_loader_it_iterates() -> None:
    class Wrapper:
        def __init__(self, iterable: object) -> None:
            self.iterable = iterable

        def __iter__(self) -> Iterator[object]:
            return iter(self.iterable)  # type: ignore[call-overload]

    loader = data.DataLoader(ITEMS, batch_size=2)
    assert iter_hazards(Wrapper(Wrapper(loader))) == iter_hazards(loader) == (False, True)
    circular = Wrapper(None)
    circular.iterable = circular
    assert iter_hazards(circular) == (False, False)  # no loader behind it: ends, judged as no loader


# --- where the next epoch starts --------------------------------------------------------------------


@pytest.mark.parametrize(("hazards", "where"), [
    ((False, False), NextStart.THREAD),
    ((True, False), NextStart.CONSUMER),
    ((False, True), NextStart.AT_ITER),
    ((True, True), NextStart.AT_ITER),
])
def test_where_the_next_epoch_starts(hazards: tuple[bool, bool], where: NextStart) -> None:
    assert next_start(hazards) is where
    assert _where_next(EpochRunner(ITEMS, hazards=lambda it: hazards)) is where


def _where_next(runner: EpochRunner) -> NextStart:
    """Where the producer thread finds the next epoch starts, as it asks."""
    return next_start(runner.hazards(runner.iterable))


def test_the_runner_judges_the_iterable_with_iter_hazards_by_default() -> None:
    assert _where_next(EpochRunner(data.DataLoader(ITEMS, batch_size=2))) is NextStart.AT_ITER
    assert _where_next(EpochRunner(ITEMS)) is NextStart.THREAD


# --- whose set_epoch is used ------------------------------------------------------------------------


def test_the_loaders_own_set_epoch_comes_first() -> None:
    class Loader(data.DataLoader):
        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    loader = Loader(ITEMS, batch_size=2, sampler=data.DistributedSampler(ITEMS, num_replicas=1, rank=0))
    api = epoch_api(loader)
    assert api is not None and api.owner is loader and api.holder is loader
    api.set(3)
    assert api.get() == 3 and loader.sampler.epoch == 0


def test_else_the_samplers_then_the_datasets() -> None:
    sampler = data.DistributedSampler(ITEMS, num_replicas=2, rank=1)
    api = epoch_api(data.DataLoader(ITEMS, batch_size=2, sampler=sampler))
    assert api is not None and api.owner is sampler and api.holder is sampler
    api.set(5)
    assert sampler.epoch == 5 and api.get() == 5
    stream = _EpochStream()
    api = epoch_api(data.DataLoader(stream, batch_size=2))
    assert api is not None and api.owner is stream
    api.set(2)
    assert api.get() == stream.epoch == 2


def test_no_set_epoch_anywhere_is_none_and_an_epoch_nowhere_reads_none() -> None:
    assert epoch_api(data.DataLoader(ITEMS, batch_size=2)) is None
    assert epoch_api(ITEMS) is None

    class Blind:
        def set_epoch(self, epoch: int) -> None:
            pass

    api = epoch_api(Blind())
    assert api is not None and api.holder is None and api.get() is None


# --- which number an epoch gets once the prefetcher drives them --------------------------------------


@pytest.mark.parametrize(("next_value", "last_value", "now", "expected"), [
    (7, 3, 3, 7),  # asked for: taken as it is
    (7, None, None, 7),
    (None, 3, 3, 4),  # nothing asked: the previous + 1
    (None, None, None, 1),
    (None, None, 0, 1),
    (None, 3, 9, 9),  # set on the loader behind the prefetcher: honoured
    (None, 3, None, 4),  # the loader's epoch unknown: + 1
])
def test_the_number_of_a_driven_epoch(next_value, last_value, now, expected: int) -> None:
    assert resolve_epoch(next_value, last_value, now) == expected


def test_a_driven_runner_sets_the_loaders_epoch_at_each_start() -> None:
    stream = _EpochStream()
    runner = EpochRunner(data.DataLoader(stream, batch_size=2))
    assert runner.drive(2, None) is SetEpoch.NOW and runner.driven
    runner.set_now(2)
    values = [runner.begin()[2] for _ in range(3)]
    assert values == [2, 3, 4] and stream.epoch == 4
    stream.set_epoch(10)  # behind the runner
    assert runner.begin()[2] == 10
    runner.restart_from_loader()
    assert runner.begin()[2] == 10  # the loader's epoch again (a resumed epoch is not skipped)


def test_an_undriven_runner_leaves_the_epoch_alone() -> None:
    stream = _EpochStream()
    runner = EpochRunner(data.DataLoader(stream, batch_size=2))
    assert [runner.begin()[2] for _ in range(2)] == [0, 0] and stream.epoch == 0


# --- when an epoch started ahead is still valid -----------------------------------------------------


@pytest.mark.parametrize(("started", "now", "valid"), [
    (None, 4, True),  # the loader's epoch is unknown: nothing to compare
    (3, 3, True),
    (3, 4, False),  # changed behind the prefetcher after the look-ahead started
    (3, None, False),
])
def test_a_lookahead_is_valid_unless_the_epoch_changed(started, now, valid: bool) -> None:
    assert lookahead_valid(started, now) is valid


def test_a_lookahead_records_the_epoch_before_its_iter_unless_iter_advances_it() -> None:
    class Advancing:
        """A loader whose iter() moves its own epoch (as some samplers do)."""

        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self) -> Iterator[int]:
            self.epoch += 1
            return iter([self.epoch])

    class Fixed(Advancing):
        def __iter__(self) -> Iterator[int]:
            return iter([self.epoch])

    moving = EpochRunner(Advancing())
    assert moving.begin()[2] == 1  # in the consumer's thread: the value after iter(), and iter() advances
    assert moving.begin(ahead=True)[2] == 2 and lookahead_valid(2, moving.current())
    fixed = EpochRunner(Fixed())
    seen = []
    assert fixed.begin(seen.append, ahead=True)[2] == 0 and seen == [0]
    fixed.iterable.set_epoch(1)  # set behind the runner after the look-ahead started
    assert not lookahead_valid(0, fixed.current())


def test_the_loader_state_before_the_first_batch_and_a_loader_without_one() -> None:
    class Stateful:
        def __init__(self) -> None:
            self.pulled = 0

        def state_dict(self) -> dict[str, int]:
            return {"pulled": self.pulled}

        def __iter__(self) -> Iterator[int]:
            return iter([1, 2])

    source, state, value = EpochRunner(Stateful()).begin()
    assert list(source) == [1, 2] and state == {"pulled": 0} and value is None

    class Refuses(Stateful):
        def state_dict(self) -> dict[str, int]:
            raise TypeError("no state over a plain dataset")

    runner = EpochRunner(Refuses())
    assert runner.begin()[1] is None and isinstance(runner.state_error, TypeError) and runner.snapshot is None


# --- what CUDAPrefetcher.set_epoch does ------------------------------------------------------------


def _run(begun: int = -1, finished: int = -1, ahead=None, alive: bool = False, handoff=None) -> SimpleNamespace:
    """The fields of a producer ``Run`` that ``EpochRunner.drive`` reads."""
    return SimpleNamespace(begun=begun, finished=finished, ahead=ahead, handoff=handoff, alive=lambda: alive)


@pytest.mark.parametrize(("run", "epoch", "action", "next_value"), [
    (None, 4, SetEpoch.NOW, "kept"),  # nothing runs: set now
    (_run(begun=0, finished=0), 4, SetEpoch.NOW, "kept"),  # its epoch taken to the end: set now
    (_run(begun=0, ahead=(1, 4)), 4, SetEpoch.DONE, None),  # started ahead with this number: kept
    (_run(begun=0, ahead=(1, 3)), 4, SetEpoch.DISCARD, "kept"),  # started ahead with another: discarded
    (_run(begun=1, ahead=(1, 3), alive=True), 4, SetEpoch.DONE, 4),  # that epoch begun: a running one
    (_run(begun=0, alive=True), 4, SetEpoch.DONE, 4),  # mid-epoch: its look-ahead takes the number
    (_run(begun=0, handoff=(1, False)), 4, SetEpoch.DONE, 4),  # the thread left the next epoch to the consumer
    (_run(begun=0), 4, SetEpoch.NOW, "kept"),  # begun, but its thread ended with no hand-off: set now
])
def test_what_set_epoch_does(run, epoch: int, action: SetEpoch, next_value) -> None:
    runner = EpochRunner(data.DataLoader(_EpochStream(), batch_size=2))
    runner.set_now(9)  # asked for before
    assert runner.drive(epoch, run) is action
    assert runner.driven
    assert runner.next_value == (9 if next_value == "kept" else next_value)
    assert runner.current() == 9  # drive() never sets the loader's epoch itself
