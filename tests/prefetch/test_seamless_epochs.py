"""Seamless epochs: the prefetcher starts the next epoch's iterator ahead, in the thread and at the
epoch torch would, and discards the look-ahead when the user changes the epoch behind it."""
from __future__ import annotations

import gc
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata.prefetch import CUDAPrefetcher
from tests.helpers.prefetch import RangeDataset, prefetch_threads, wait_no_prefetch_threads
from tests.helpers.shards import make_shards


class _SlowStartLoader:
    """Each epoch's first batch comes ``startup_s`` late (workers starting); then batches are quick."""

    def __init__(self, n: int, startup_s: float) -> None:
        self.n, self.startup_s, self.iters = n, startup_s, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.iters += 1
        return self._gen()

    def _gen(self):
        time.sleep(self.startup_s)
        for i in range(self.n):
            yield torch.full((4,), i)


@pytest.mark.parametrize("seamless", [True, False])
def test_seamless_epochs_start_the_next_epoch_ahead(seamless: bool) -> None:
    """The loader outpaces compute, but every epoch starts 40 ms late: with seamless epochs the next
    epoch is started while the consumer still works on the last batches, so its start-up is hidden."""
    _check_seamless_wait(seamless)


def test_epochs_started_by_the_consumer_stay_seamless(monkeypatch) -> None:
    """A loader whose iter() forks (but draws no global RNG): the thread ends after each epoch and the
    consumer starts the next one at its next next(), while it still has staged batches to take."""
    from fastdata.prefetch import _prefetcher

    monkeypatch.setattr(_prefetcher, "_iter_hazards", lambda it: (True, False))
    _check_seamless_wait(True)


def test_epochs_of_a_global_rng_loader_start_where_a_plain_loop_starts_them(monkeypatch) -> None:
    from fastdata.prefetch import _prefetcher

    monkeypatch.setattr(_prefetcher, "_iter_hazards", lambda it: (False, True))
    _check_seamless_wait(False)


def _check_seamless_wait(seamless: bool) -> None:
    # seamless: each next epoch's iterator is started ahead (its 40 ms start-up hidden behind the 2 batches
    # queued); a run that is not seamless waits the start-up at every epoch (a sleep: only ever longer). What
    # seamless saves: benchmarks/prefetch_overlap.py --part seamless (docs/design/prefetch_overlap.md).
    loader = _SlowStartLoader(8, startup_s=0.04)
    pf = CUDAPrefetcher(loader, device="cpu", depth=2, seamless=seamless)
    for epoch in range(4):
        got = []
        for b in pf:
            got.append(int(b[0]))
            time.sleep(0.04)  # compute: 2 batches ahead = 80 ms of slack > 40 ms start-up
        assert got == list(range(8))
        if epoch == 0:
            pf.reset_stats()  # the first epoch's start-up cannot be hidden
    s = pf.stats()
    pf.close()
    assert s["batches"] == 24
    # seamless: the fifth epoch is started ahead, unless close() came first
    assert loader.iters in ((4, 5) if seamless else (4,))
    if seamless:
        assert s["lookahead_epochs"] >= 3 and s["lookahead_discarded"] == 0
    else:
        assert s["wait_p99_s"] > 0.03, s  # each epoch start waits for the start-up
        assert s["lookahead_epochs"] == 0


class _Steps(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), i)


def _rng_stream(batches, epochs: int = 3) -> list[float]:
    """A training loop's use of the global torch RNG (dropout), one draw per batch; slow enough
    that the prefetcher reaches the end of each epoch while batches are still staged."""
    out = []
    for _ in range(epochs):
        for b in batches:
            out.append(float(torch.rand(()) + b[0, 0]))
            time.sleep(0.005)
    return out


@pytest.mark.parametrize("own_generator,shuffle", [(False, False), (False, True), (True, True)])
def test_training_rng_stream_is_that_of_a_plain_loop(own_generator: bool, shuffle: bool) -> None:
    """torch's DataLoader draws its workers' base seed from the global RNG at iter() unless it has a
    generator: that draw must happen where a plain loop makes it, not in the thread at a time that
    depends on thread timing (identical runs would then train differently)."""
    def loader():
        return torch.utils.data.DataLoader(
            _Steps(), batch_size=2, shuffle=shuffle,
            generator=torch.Generator().manual_seed(1) if own_generator else None)

    torch.manual_seed(0)
    want = _rng_stream(loader())
    torch.manual_seed(0)
    pf = CUDAPrefetcher(loader(), device="cpu", depth=2)
    got = _rng_stream(pf)
    s = pf.stats()
    pf.close()
    assert got == want
    # with its own generator the loader's iter() touches no global state: epochs still start ahead
    assert s["lookahead_epochs"] >= 2 if own_generator else s["lookahead_epochs"] == 0


class _RecordingLoader(torch.utils.data.DataLoader):
    """Records, at each iter(), the calling thread and fastdata's other threads alive."""

    calls: list[list[str]]

    def __iter__(self):
        me = threading.current_thread()
        self.calls.append([me.name] + sorted(t.name for t in threading.enumerate()
                                             if t is not me and t.name.startswith("fastdata")))
        return super().__iter__()


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="no fork")
def test_forking_loader_starts_its_epochs_in_the_consumer_thread_alone() -> None:
    loader = _RecordingLoader(_Steps(), batch_size=2, num_workers=1, multiprocessing_context="fork",
                              generator=torch.Generator().manual_seed(1))
    loader.calls = []
    want = [b.tolist() for b in torch.utils.data.DataLoader(_Steps(), batch_size=2)]
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    for _ in range(3):
        got = []
        for b in pf:
            got.append(b.tolist())
            time.sleep(0.01)
        assert got == want
    pf.close()
    assert len(loader.calls) >= 3
    assert all(c == ["MainThread"] for c in loader.calls), loader.calls
    # persistent workers alive with a generator: later epochs fork nothing, the thread starts them
    loader = _RecordingLoader(_Steps(), batch_size=2, num_workers=1, multiprocessing_context="fork",
                              persistent_workers=True, generator=torch.Generator().manual_seed(1))
    loader.calls = []
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    for _ in range(3):
        assert [b.tolist() for b in pf] == want
    _wait_for(lambda: len(loader.calls) == 4)
    pf.close()
    assert loader.calls[0] == ["MainThread"] and all(c[0].startswith("fastdata-prefetch") for c in loader.calls[1:])


class _EpochLoader:
    """Batches tagged with the epoch they were made for; records every set_epoch call."""

    def __init__(self, n: int = 5) -> None:
        self.n, self.epoch, self.calls = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        e = self.epoch
        return iter([(e, i) for i in range(self.n)])


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_set_epoch_drives_the_lookahead() -> None:
    loader = _EpochLoader()
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    for epoch in range(4):
        pf.set_epoch(epoch)
        assert list(pf) == [(epoch, i) for i in range(5)]
    _wait_for(lambda: len(loader.calls) == 5)
    assert pf.stats()["lookahead_epochs"] >= 3 and pf.stats()["lookahead_discarded"] == 0
    assert loader.calls == [0, 1, 2, 3, 4]  # each epoch set once; 4 = the one started ahead
    pf.set_epoch(9)  # not the one started ahead: discarded, restarted with 9
    assert list(pf) == [(9, i) for i in range(5)]
    assert pf.stats()["lookahead_discarded"] == 1
    assert list(pf) == [(10, i) for i in range(5)]  # no call: the next epoch number
    pf.close()
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        pf.set_epoch(-1)
    with pytest.raises(TypeError, match="has no set_epoch"):
        CUDAPrefetcher([1], device="cpu").set_epoch(0)


def test_loader_set_epoch_behind_the_prefetcher_discards_the_lookahead() -> None:
    loader = _EpochLoader()
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    assert list(pf) == [(0, i) for i in range(5)]
    _wait_for(lambda: pf.stats()["lookahead_epochs"] == 1)  # epoch 0 again started ahead (no set_epoch)
    loader.set_epoch(1)
    with pytest.warns(RuntimeWarning, match=r"call CUDAPrefetcher.set_epoch\(\)|Call CUDAPrefetcher.set_epoch"):
        assert list(pf) == [(1, i) for i in range(5)]
    assert pf.stats()["lookahead_discarded"] == 1
    assert list(pf) == [(1, i) for i in range(5)]  # unchanged epoch: the look-ahead is kept
    assert pf.stats()["lookahead_discarded"] == 1
    pf.close()


def test_distributed_sampler_epochs_through_the_prefetcher() -> None:
    ds = RangeDataset()
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler)
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected.append([b["y"].tolist() for b in loader])
    assert expected[0] != expected[1]
    pf = CUDAPrefetcher(loader, device="cpu")
    for epoch in range(3):
        pf.set_epoch(epoch)
        assert [b["y"].tolist() for b in pf] == expected[epoch]
    pf.close()


def test_lookahead_error_surfaces_in_the_next_epoch() -> None:
    class Loader:
        iters = 0

        def __iter__(self):
            Loader.iters += 1
            if Loader.iters == 2:
                raise OSError("shard-000007.tar: connection reset")
            return iter(range(3))

    pf = CUDAPrefetcher(Loader(), device="cpu")
    assert list(pf) == [0, 1, 2]  # the failing iter() ran ahead; this epoch is unaffected
    with pytest.raises(OSError, match="connection reset") as info:
        list(pf)
    if sys.version_info >= (3, 11):
        assert any("starting epoch 1 ahead" in n for n in info.value.__notes__)
    assert list(pf) == [0, 1, 2]  # a fresh start
    pf.close()
    assert not wait_no_prefetch_threads()


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_across_the_epoch_boundary(tmp_path, num_workers: int) -> None:
    """set_epoch through the prefetcher: epoch 1 is started ahead while epoch 0's last batches are
    consumed; states saved at the boundary and inside epoch 1 resume exactly (nothing twice, nothing lost)."""
    import json

    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader

    make_shards(tmp_path / "ds", 40, 6)

    def make() -> DataLoader:
        return DataLoader(ShardedDataset(tmp_path / "ds", shuffle=True, seed=1), batch_size=3,
                          num_workers=num_workers, persistent_workers=num_workers > 0)

    def ids(b) -> list[int]:
        return [int(i) for i in b["cls"]]

    ref = make()
    expected = []
    for epoch in range(3):
        ref.set_epoch(epoch)
        expected.append([ids(b) for b in ref])
    assert expected[0] != expected[1]
    pf = CUDAPrefetcher(make(), device="cpu", depth=3)
    pf.set_epoch(0)
    assert [ids(b) for b in pf] == expected[0]
    time.sleep(0.1)  # epoch 1 runs ahead
    at_end = json.loads(json.dumps(pf.state_dict()))
    pf.set_epoch(1)
    it = iter(pf)
    first = [ids(next(it)) for _ in range(2)]
    time.sleep(0.1)
    inside = json.loads(json.dumps(pf.state_dict()))
    pf.close()
    assert first == expected[1][:2] and pf.stats()["lookahead_discarded"] == 0
    # from the boundary: nothing left of epoch 0, then all of epoch 1
    a = CUDAPrefetcher(make(), device="cpu")
    a.load_state_dict(at_end)
    assert list(a) == []
    a.set_epoch(1)
    assert [ids(b) for b in a] == expected[1]
    a.close()
    # from inside epoch 1: its rest, then epoch 2 (set_epoch driven: the next number by itself)
    b = CUDAPrefetcher(make(), device="cpu")
    b.load_state_dict(inside)
    b.set_epoch(1)
    assert [ids(x) for x in b] == expected[1][2:]
    assert [ids(x) for x in b] == expected[2]
    b.close()


def test_second_iterator_of_the_same_epoch_stops_the_first() -> None:
    pf = CUDAPrefetcher(list(range(6)), device="cpu")
    first, second = iter(pf), iter(pf)  # neither advanced yet
    assert list(second) == list(range(6))
    assert list(first) == []  # stopped, not blocked on the pipe the second one owns
    assert list(pf) == list(range(6))
    pf.close()


def test_driven_epochs_then_loader_set_epoch_directly() -> None:
    loader = _EpochLoader(3)
    pf = CUDAPrefetcher(loader, device="cpu")
    pf.set_epoch(0)
    assert list(pf) == [(0, i) for i in range(3)]
    _wait_for(lambda: pf.stats()["lookahead_epochs"] == 1)  # epoch 1 started ahead
    loader.set_epoch(5)  # behind the prefetcher's back
    with pytest.warns(RuntimeWarning, match="discarded and restarted"):
        assert list(pf) == [(5, i) for i in range(3)]
    assert list(pf) == [(6, i) for i in range(3)]  # and on from there
    pf.close()


def test_gc_after_a_finished_epoch_stops_the_persistent_thread() -> None:
    pf = CUDAPrefetcher(list(range(5)), device="cpu")
    assert list(pf) == list(range(5))
    assert prefetch_threads()  # waiting for the next epoch, one epoch started ahead
    del pf
    gc.collect()
    assert not wait_no_prefetch_threads()


class _Epochal:
    """A re-iterable with ``set_epoch``/``epoch`` (like a loader) whose ``iter()`` reads the epoch,
    then, at its ``hold``-th call, waits for ``gate`` (a loader whose iter() takes time: workers starting)."""

    def __init__(self, n: int = 3, hold: int = 0) -> None:
        self.epoch = 0
        self.n = n
        self.hold = hold
        self.calls = 0
        self.in_iter = threading.Event()
        self.gate = threading.Event()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        self.calls += 1
        if self.calls == self.hold:
            self.in_iter.set()
            assert self.gate.wait(10)
        return iter([(epoch, i) for i in range(self.n)])


def _epochs_of(batches: list[Any]) -> set[int]:
    return {int(e) for e, _ in batches}


def test_loader_epoch_set_while_the_lookahead_iter_runs_is_not_mislabelled() -> None:
    """The look-ahead read the loader's epoch after its iter(): a loader.set_epoch(1) landing while
    that iter() ran (it had already fixed epoch 0) labelled epoch 0's iterator as epoch 1, so the
    next epoch silently repeated epoch 0 (same order) with no warning and nothing discarded."""
    src = _Epochal(hold=2)  # the look-ahead's iter() of epoch 1 waits for the gate
    p = CUDAPrefetcher(src, device="cpu")
    try:
        assert _epochs_of(list(p)) == {0}
        assert src.in_iter.wait(10)
        src.set_epoch(1)  # behind the prefetcher's back, while its look-ahead's iter() runs
        src.gate.set()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(p)
        assert _epochs_of(got) == {1}, got
        assert any("discarded" in str(w.message) for w in caught)
        assert p.stats()["lookahead_discarded"] == 1
    finally:
        src.gate.set()
        p.close()


@pytest.mark.parametrize("seamless", [False, True])
def test_loader_epoch_set_behind_a_driven_prefetcher_is_honoured(seamless: bool) -> None:
    """After CUDAPrefetcher.set_epoch, an epoch start set the loader's epoch to the previous + 1 even
    when the user had set the loader's epoch meanwhile: with seamless=False (or a look-ahead that had
    not begun yet) loader.set_epoch(5) was silently overwritten with 1; a later look-ahead discarded
    and ran 5. Both orders now run 5, then 6."""
    src = _Epochal()
    p = CUDAPrefetcher(src, device="cpu", seamless=seamless)
    try:
        p.set_epoch(0)
        assert _epochs_of(list(p)) == {0}
        src.set_epoch(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a look-ahead already started is discarded
            assert _epochs_of(list(p)) == {5}
        assert _epochs_of(list(p)) == {6}
    finally:
        p.close()


def test_an_iterable_whose_iter_advances_its_own_epoch_runs_one_epoch_per_pass() -> None:
    """The look-ahead reads the epoch before iter() (see the test above); an iterable whose iter()
    moves its own epoch on must not look changed behind the prefetcher's back: every look-ahead was
    discarded and started again, so each pass advanced the epoch twice (0, 2, 4, 6)."""

    class Advancing:
        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self) -> Iterator[tuple[int, int]]:
            epoch, self.epoch = self.epoch, self.epoch + 1
            return iter([(epoch, i) for i in range(3)])

    p = CUDAPrefetcher(Advancing(), device="cpu")
    try:
        assert [_epochs_of(list(p)) for _ in range(4)] == [{0}, {1}, {2}, {3}]
        assert p.stats()["lookahead_discarded"] == 0
    finally:
        p.close()


def test_decode_ahead_wrapper_does_not_hide_a_forking_loader_from_the_prefetcher():
    # CUDAPrefetcher starts the next epoch in its own thread only when the loader's iter() neither forks
    # nor draws from torch's global RNG; DecodeImages.ahead(loader) is no DataLoader, so a loader with
    # fork workers behind it had its next epoch (and its workers' fork) started from the prefetch thread
    import threading

    from fastdata.prefetch._prefetcher import _iter_hazards

    starts = []

    class Recording(torch.utils.data.DataLoader):
        def __iter__(self):
            starts.append(threading.current_thread().name)
            return super().__iter__()

    loader = Recording([torch.full((2,), i) for i in range(4)], batch_size=2, num_workers=0)
    wrapped = fastdata.gpu.DecodeImages(device="cpu").ahead(loader)
    assert _iter_hazards(wrapped) == _iter_hazards(loader) == (False, True)  # no generator: global RNG
    with fastdata.CUDAPrefetcher(wrapped, device="cpu") as batches:
        for _ in range(3):
            assert sum(1 for _ in batches) == 2
    assert starts == [threading.current_thread().name] * 3
