"""Session 7, lead: regression tests for defects found outside the helpers' areas."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from fastdata import CUDAPrefetcher
from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter


def test_two_threads_iterating_one_prefetcher_get_no_internal_error() -> None:
    """One thread's iter() ends the other's run (as a second iter() does in one thread); the ended loop
    stops cleanly. Before: 'prefetch thread exited without finishing the epoch' (the stopped consumer
    took the stop for a dead producer) or 'cannot join thread before it is started'."""
    pf = CUDAPrefetcher([torch.full((2,), i) for i in range(40)], device="cpu")
    errors: list[BaseException] = []
    counts: list[int] = []

    def loop() -> None:
        try:
            n = 0
            for batch in pf:
                assert int(batch[0]) == n  # in order, from the start of the epoch, nothing skipped
                n += 1
            counts.append(n)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    for _ in range(12):
        threads = [threading.Thread(target=loop) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    pf.close()
    assert errors == []
    assert len(counts) == 24 and max(counts) == 40  # the run started last always completes


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
