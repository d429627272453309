"""A worker's error, caught by the training loop, must not leave the worker pool to a later garbage
collection (which stalls 5 s per worker: torch's queues are closed by then)."""
from __future__ import annotations

import gc
import multiprocessing as mp
from pathlib import Path

import pytest

from fastdata.dataset import ShardedDataset
from fastdata.errors import DecodeError
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def failing_cls(data: bytes) -> int:
    i = int(bytes(data))
    if i == 9:
        raise ValueError(f"bad label {i}")
    return i


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_error_then_drop_stops_the_workers_at_once(tmp_path: Path, persistent: bool):
    with ShardWriter(tmp_path / "ds", max_samples=8) as w:
        for i in range(32):
            w.write({"__key__": f"s{i:03d}", "cls": str(i).encode()})
    ds = ShardedDataset(tmp_path / "ds", shuffle=False, decode={"cls": failing_cls})
    dl = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)
    it = iter(dl)
    with pytest.raises(DecodeError, match="bad label 9") as caught:
        for _ in it:
            pass
    assert "Original Traceback" in str(caught.value)  # the worker's traceback text is kept
    workers = list(dl._iterator._workers) if persistent else list(it._inner._workers)
    del caught
    del it, dl  # dropping the loader and its iterator (a persistent one: the loader holds it)
    gc.collect()
    _ended_on_their_own(workers)


def _ended_on_their_own(workers: list) -> None:
    for w in workers:
        w.join(timeout=30)  # a hang guard
    assert len(workers) == 2 and [w.exitcode for w in workers] == [0, 0], [w.exitcode for w in workers]


def test_a_plain_torch_loader_error_through_the_prefetcher_stops_its_workers_at_once(tmp_path: Path):
    import torch

    from fastdata.prefetch import CUDAPrefetcher

    class Failing(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 20:
                raise ValueError("bad sample 20")
            return torch.zeros(3)

    dl = torch.utils.data.DataLoader(Failing(), batch_size=4, num_workers=2)
    pf = CUDAPrefetcher(dl, device="cpu", seamless=False)
    workers: list = []
    with pytest.raises(ValueError, match="bad sample 20"):
        for _ in pf:
            workers = workers or mp.active_children()  # the loader's two workers, while they run
    pf.close()
    del pf, dl
    gc.collect()
    _ended_on_their_own(workers)


def test_skip_budget_error_ends_the_pass_and_stops_its_workers(tmp_path: Path):
    from fastdata.errors import SkipBudgetError

    with ShardWriter(tmp_path / "ds", max_samples=8) as w:
        for i in range(32):
            w.write({"__key__": f"s{i:03d}", "cls": (b"x" if i % 3 == 0 else str(i).encode())})
    ds = ShardedDataset(tmp_path / "ds", shuffle=False, decode={"cls": lambda b: int(bytes(b))},
                        on_error="skip", max_skips=2)
    dl = DataLoader(ds, batch_size=4, num_workers=2)
    it = iter(dl)
    with pytest.raises(SkipBudgetError) as info:  # the held ExceptionInfo makes a frame cycle, as user code may
        for _ in it:
            pass
    workers = list(it._inner._workers)
    assert not any(w.is_alive() for w in workers)  # stopped at once, not by a later garbage collection
    with pytest.raises(StopIteration):
        next(it)
    assert len(info.value.skipped) >= 3
    del info, it
    gc.collect()
    _ended_on_their_own(workers)
    again = ShardedDataset(tmp_path / "ds", shuffle=False, on_error="skip")
    assert sum(len(b["__key__"]) for b in DataLoader(again, batch_size=4, num_workers=2)) == 32 - 11
