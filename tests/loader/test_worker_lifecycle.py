"""Worker processes over their life: iterators closed, persistent workers reset by a new iter(), workers
that outlive a killed loader process, garbage never collected in a fork worker."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter
from tests.helpers.shards import make_shards


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


@pytest.mark.parametrize("workers", [0, 2])
def test_close_ends_a_worker_path_iterator_and_stops_its_workers(tmp_path: Path, workers: int) -> None:
    """close() on a worker-path iterator stopped only the watchdog: its worker processes ran on (and
    loaded ahead) until a garbage collection, and next() went on yielding batches; on the thread
    decoder close() ends the iteration. Now it does on every path."""
    import multiprocessing

    loader = DataLoader(ShardedDataset(make_shards(tmp_path / "ds", 12, 4, key="k{i:03d}"), shuffle=False), batch_size=2, num_workers=workers,
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
    loader = DataLoader(ShardedDataset(make_shards(tmp_path / "ds", 12, 4, key="k{i:03d}"), shuffle=False), batch_size=2, num_workers=1,
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


class _Gate:
    """sample_transform (in a worker process) that holds every sample from ``first`` on until the file
    ``flag`` exists."""

    def __init__(self, first: str, flag: Path) -> None:
        self.first, self.flag = first, flag

    def __call__(self, sample: dict) -> dict:
        deadline = time.monotonic() + 20
        while sample["__key__"] >= self.first and not self.flag.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        return sample


def test_iter_of_a_persistent_loader_busy_in_another_thread_says_so(tmp_path: Path) -> None:
    """A persistent-worker loader iterated in one thread (a CUDAPrefetcher's) and iter()'d in another:
    torch reset the one iterator under the reading thread, which died with torch's bare
    ``KeyError: _ResumeIteration(seed=None)``. Now iter() refuses with an error that says what happened,
    and the running iteration goes on unharmed."""
    with ShardWriter(tmp_path / "ds", max_samples=4) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "cls": str(i).encode()})
    gate = _Gate("k2", tmp_path / "go")
    ds = ShardedDataset(tmp_path / "ds", shuffle=False, sample_transform=gate)
    loader = DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=True, multiprocessing_context="fork")
    it = iter(loader)
    got: list[str] = list(next(it)["__key__"])
    errors: list[BaseException] = []

    def rest() -> None:
        try:
            got.extend(k for batch in it for k in batch["__key__"])
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    reader = threading.Thread(target=rest, name="reader")
    reader.start()
    deadline = time.monotonic() + 10
    while it._busy is None and time.monotonic() < deadline:  # the reader waits inside next()
        time.sleep(0.005)
    try:
        with pytest.raises(RuntimeError, match="being iterated in thread 'reader'"):
            iter(loader)
    finally:
        gate.flag.touch()
        reader.join(20)
    assert errors == [] and got == [f"k{i}" for i in range(8)]
    assert [k for batch in loader for k in batch["__key__"]] == got  # the loader still works


class _Cyclic:
    """Left in a reference cycle: its destructor records the process that ran it."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.me = self

    def __del__(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect(sample: dict) -> dict:
    gc.collect()  # a collection in the worker, as any allocation may start one
    return sample


def test_a_fork_worker_never_collects_the_garbage_of_the_loaders_process(tmp_path: Path) -> None:
    """A reference cycle left in the training process (test_train's in-process DDP model, whose hook
    refers to it) was collected in a fork worker at its first collection: the DDP reducer's destructor
    ran gloo's process-group teardown there and the worker hung for good (the whole suite stalled in
    test_tune). Objects inherited from the parent are now out of the worker's collector's reach."""
    with ShardWriter(tmp_path / "ds", max_samples=2) as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "cls": str(i).encode()})
    log = tmp_path / "del.log"
    ds = ShardedDataset(tmp_path / "ds", shuffle=False, sample_transform=_collect)
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
    gc.disable()  # the cycle must still be there when the workers fork
    try:
        _Cyclic(log)
        assert len([b for b in loader]) == 2
    finally:
        gc.enable()
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())]  # destroyed once, here
