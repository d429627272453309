"""Session 6 bug hunt in the lifecycle of the loader's and the prefetcher's threads and processes:
one regression test per defect found."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.prefetch import CUDAPrefetcher
from fastdata.shards.writer import ShardWriter


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


def _wait_exit(pid: int, seconds: float) -> int | None:
    """The exit status of child ``pid`` once it has ended within ``seconds``, else None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_worker_ends_when_the_loaders_process_is_killed_though_its_parent_lives() -> None:
    """A forkserver worker's parent is the fork server, which outlives a kill -9 of the training
    process (every forkserver child holds the server's "alive" pipe), and torch's workers check only
    their parent: after the kill, the workers and the server lived on for good (a spawn worker that
    started after the kill did too). Here the "loader's process" is a forked child killed with
    SIGKILL and the worker a sibling whose parent (this process) lives on, as the fork server does."""
    from fastdata.loader import _watchdog

    owner = os.fork()
    if owner == 0:  # the loader's process
        time.sleep(30)
        os._exit(0)
    worker = None
    try:
        init = _watchdog.WorkerInit(None, None)
        init.parent, init.parent_start = owner, _watchdog._start_time(owner)  # made in the loader's process
        worker = os.fork()
        if worker == 0:
            try:
                init(0)
                time.sleep(30)
            finally:
                os._exit(0)
        time.sleep(0.1)
        assert _wait_exit(worker, 0) is None  # running while the loader's process lives
        os.kill(owner, signal.SIGKILL)
        assert _wait_exit(owner, 10) is not None
        assert _wait_exit(worker, 10) == 1  # ended by its watch, within a poll or two
        worker = None
    finally:
        for pid in (owner, worker):
            if pid:
                with contextlib.suppress(ProcessLookupError, ChildProcessError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)


def _keyed(dest: Path, n: int = 12, per_shard: int = 4) -> Path:
    with ShardWriter(dest, max_samples=per_shard) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "cls": str(i).encode()})
    return dest


class _Blocking:
    """sample_transform that blocks on ``release`` from the sample ``first`` on, counting its blocked calls."""

    def __init__(self, first: str) -> None:
        self.first = first
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.blocked = 0

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"] >= self.first:
            with self.lock:
                self.blocked += 1
            self.release.wait(30)
        return sample


def test_closing_a_thread_decoder_with_stuck_threads_waits_once_not_once_per_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """close() (and so a break, Ctrl-C or the pause before a fork) joined each pool thread stuck in a
    transform for _JOIN_S (10 s) in turn: 4 threads stuck on a slow remote read held the consumer
    40 s. One deadline now covers them all, and one warning names them."""
    from fastdata.loader import _pool

    monkeypatch.setattr(_pool, "_JOIN_S", 0.5)
    block = _Blocking("k004")
    loader = DataLoader(ShardedDataset(_keyed(tmp_path / "ds"), sample_transform=block), batch_size=4,
                        num_workers=1, decode_threads=4)
    it = iter(loader)
    try:
        assert list(next(it)["__key__"]) == ["k000", "k001", "k002", "k003"]
        deadline = time.monotonic() + 10
        while block.blocked < 4 and time.monotonic() < deadline:  # every pool thread is stuck
            time.sleep(0.01)
        assert block.blocked == 4
        waits = request.getfixturevalue("decode_thread_joins")  # the join timeouts of the stuck threads from here
        with pytest.warns(RuntimeWarning, match=r"fastdata-decode-0, .*did not finish their task within 0.5 s"):
            it.close()
        assert len(waits) == 4 and sum(waits) <= 0.5, waits  # one 0.5 s deadline for all: was 4 x 0.5 s
    finally:
        block.release.set()


@pytest.mark.parametrize("workers", [0, 2])
def test_close_ends_a_worker_path_iterator_and_stops_its_workers(tmp_path: Path, workers: int) -> None:
    """close() on a worker-path iterator stopped only the watchdog: its worker processes ran on (and
    loaded ahead) until a garbage collection, and next() went on yielding batches; on the thread
    decoder close() ends the iteration. Now it does on every path."""
    import multiprocessing

    loader = DataLoader(ShardedDataset(_keyed(tmp_path / "ds"), shuffle=False), batch_size=2, num_workers=workers,
                        multiprocessing_context="fork" if workers else None)
    it = iter(loader)
    assert list(next(it)["__key__"]) == ["k000", "k001"]
    state = loader.state_dict()
    it.close()
    assert multiprocessing.active_children() == []
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # twice is fine
    assert loader.state_dict() == state  # the batches received, as before
    assert len(list(loader)) == len(loader)  # the next iteration is whole


def test_a_new_iteration_over_persistent_workers_ends_the_previous_iterator(tmp_path: Path) -> None:
    """torch resets its one persistent-worker iterator at every iter(); fastdata's previous iterator
    still wrapped it, so its next() silently took a batch of the new iteration (counted in its own
    state), the new iterator missed that batch and the loader's state_dict() replayed it on resume.
    The previous iterator now ends (StopIteration), as torch's own reset one has moved on."""
    loader = DataLoader(ShardedDataset(_keyed(tmp_path / "ds"), shuffle=False), batch_size=2, num_workers=1,
                        persistent_workers=True, multiprocessing_context="fork")
    first = iter(loader)
    next(first)
    second = iter(loader)
    keys = list(next(second)["__key__"])
    with pytest.raises(StopIteration):
        next(first)
    keys += [k for batch in second for k in batch["__key__"]]
    assert keys == [f"k{i:03d}" for i in range(12)]
    assert loader.state_dict()["batches"] == len(loader) == 6


def test_a_prefetcher_left_open_is_stopped_before_the_interpreter_finalizes() -> None:
    """A script whose last loop ran over a CUDAPrefetcher it never closed ended with SIGABRT (exit
    134, "terminate called without an active exception") in 4-7 of 8 runs, 6 of 6 with a device
    transform busy in the next epoch started ahead: the daemon thread was in torch code when the
    interpreter finalized, and pthread_exit's unwinding through torch's C++ frames aborted. An
    atexit hook now stops and joins every producer thread first. (Checked here in process: the hook
    ends a busy look-ahead thread.)"""
    import torch

    from fastdata.prefetch import _prefetcher

    hook = _prefetcher._stop_runs_at_exit  # registered with atexit (measured at exit: 0 aborts in 24 runs)
    busy = threading.Event()

    class Batches:
        epochs = 0

        def __iter__(self) -> Iterator[torch.Tensor]:
            self.epochs += 1
            return iter([torch.full((4,), self.epochs)] * 3)

    def transform(x: torch.Tensor) -> torch.Tensor:
        if int(x[0]) == 2:  # the epoch started ahead
            busy.set()
            time.sleep(0.05)
        return x + 0

    p = CUDAPrefetcher(Batches(), device="cpu", transform=transform)
    try:
        assert len(list(p)) == 3
        assert busy.wait(10)
        thread = p._run.thread
        assert thread is not None and thread.is_alive()
        hook()
        assert not thread.is_alive()
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
