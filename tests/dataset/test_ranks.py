"""Several ranks: rank= and world_size=, torch.distributed and torchrun, each rank's share and state;
two real gloo processes yield equal batch counts."""
from __future__ import annotations

import json
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter
from tests.helpers.ranks import cls_ids, rank_loader


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.mark.parametrize("rank, world_size, name", [
    (1.5, 2, "rank"), (0, 2.7, "world_size"), ("1", 2, "rank"), (0, "2", "world_size"), (True, 2, "rank"),
    (0, 0, "world_size"), (0, -1, "world_size"), (None, 2, "both"), (2, 2, r"rank must be in \[0, world_size=2\)"),
])
def test_malformed_rank_or_world_size_is_refused_naming_it(seven, rank, world_size, name):
    """rank=1.5 was read as 1, "1" as 1, True as 1 and world_size=2.7 as 2 (int() of anything), and
    world_size=0 said "rank must be in [0, world_size=0)"."""
    with pytest.raises(ValueError, match=name):
        ShardedDataset(seven, rank=rank, world_size=world_size)


def test_numpy_and_tensor_ints_are_a_rank(seven):
    ds = ShardedDataset(seven, rank=np.int64(1), world_size=torch.tensor(2))
    assert (ds.rank, ds.world_size) == (1, 2) and type(ds.rank) is int


def _fake_dist(monkeypatch, rank: int, world: int) -> None:
    """torch.distributed as initialised at ``rank`` of ``world`` (one process plays every rank)."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)


def test_a_state_loaded_before_init_process_group_is_not_applied_to_another_rank(seven, monkeypatch):
    """load_checkpoint before dist.init_process_group: the dataset was rank 0 of 1 then, so the list of
    every rank's state was split for one rank; once torch.distributed was initialised that split no
    longer fit, and every rank read its whole part of the epoch again (14 of 14 samples where 8 had been
    consumed), without a word."""
    states = []
    for r in range(2):
        dl = rank_loader(seven, r, 2, batch_size=2)
        it = iter(dl)
        next(it)
        states.append(dl.state_dict())
    for loaded in (states, states[1]):
        dl = DataLoader(ShardedDataset(seven), batch_size=2, collate_fn=cls_ids)  # torch.distributed not initialised
        try:
            dl.load_state_dict(loaded)
        except ValueError as e:  # the single state: world_size 2 in the state, 1 here
            assert "world_size=2 in the state, 1 here (torch.distributed is not initialised" in str(e)
            continue
        with monkeypatch.context() as m:
            _fake_dist(m, 1, 2)
            with pytest.raises(ValueError, match=r"loaded while this dataset was rank 0 of world_size=1; it now runs "
                                                 r"as rank 1 of world_size=2.*init_process_group"):
                list(dl)
    good = DataLoader(ShardedDataset(seven), batch_size=2, collate_fn=cls_ids)
    with monkeypatch.context() as m:
        _fake_dist(m, 1, 2)
        good.load_state_dict(states)  # after init: the rest of rank 1
        assert [x for b in good for x in b] == [6, 0]  # 4, 5 consumed; 0 pads rank 1's part to 4


def test_torchrun_without_init_process_group_warns_that_every_process_reads_everything(seven, monkeypatch):
    """Under torchrun (WORLD_SIZE=4) with torch.distributed not initialised, each of the 4 processes read
    all 7 samples and len() sized a schedule for one rank, without a word."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    ds = ShardedDataset(seven)  # built before init_process_group: fine, nothing is sized yet
    with pytest.warns(UserWarning, match=r"WORLD_SIZE='4' and RANK='2' are set .*not initialised.*reads every "
                                         r"sample.*init_process_group"):
        assert len(DataLoader(ds, batch_size=2)) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(ds)) == 7  # once per dataset
        assert len(list(ShardedDataset(seven, rank=0, world_size=1))) == 7  # on purpose: no warning
        with monkeypatch.context() as m:
            _fake_dist(m, 2, 4)
            assert len(list(ShardedDataset(seven))) == 2


def test_persistent_workers_started_before_init_process_group_read_the_new_split(seven, monkeypatch):
    """Persistent workers keep the dataset copy they started with: a loader iterated once before
    torch.distributed was initialised (rank 0 of 1) went on reading every sample on every rank, while
    len() said one rank's share (and a next-epoch preload of the old split was served as well)."""
    ds = ShardedDataset(seven)
    dl = DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=True, collate_fn=cls_ids,
                    multiprocessing_context="fork")
    assert sorted(x for b in dl for x in b) == list(range(7))
    with monkeypatch.context() as m:
        _fake_dist(m, 1, 2)
        dl.set_epoch(1)
        want = [x for b in DataLoader(ShardedDataset(seven, rank=1, world_size=2), batch_size=2, collate_fn=cls_ids)
                for x in b]
        assert [x for b in dl for x in b] == want and len(want) == 4
    del dl


def test_an_explicit_rank_that_contradicts_torch_distributed_is_warned_about(seven, monkeypatch):
    """rank=LOCAL_RANK on a 2-node job (world_size=WORLD_SIZE): rank 0 of each node read the same part and
    the parts of ranks 4-7 were never read, without a word."""
    with monkeypatch.context() as m:
        _fake_dist(m, 5, 8)
        with pytest.warns(UserWarning, match=r"rank=1 was passed, but torch.distributed says this process is rank 5 "
                                             r"of the same world_size=8.*LOCAL_RANK"):
            ShardedDataset(seven, rank=1, world_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ShardedDataset(seven, rank=5, world_size=8)  # agrees
            ShardedDataset(seven, rank=1, world_size=2)  # a data-parallel group of its own (tensor parallel): fine


WORLD = 2
N = 23  # uneven on purpose: 23 samples, 2 ranks -> one padded sample


def _rank_main(rank: int, init_file: str, shards: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    try:
        ds = ShardedDataset(shards, shuffle=True, seed=0)  # rank and world size from torch.distributed
        # the rank processes were spawned, so their default start method is spawn; fork is faster
        dl = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork")
        result = {"rank": ds.rank, "world_size": ds.world_size, "len": len(dl), "epochs": []}
        for epoch in range(2):
            ds.set_epoch(epoch)
            ids, batches, waited = [], 0, 0.0
            for batch in dl:
                t = torch.tensor([len(batch["cls"])])
                t0 = time.perf_counter()
                dist.all_reduce(t)  # blocks if the other rank has no batch left
                waited = max(waited, time.perf_counter() - t0)
                ids += [int(i) for i in batch["cls"]]
                batches += 1
            result["epochs"].append({"ids": ids, "batches": batches, "max_wait_s": waited})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_gloo_equal_batches(tmp_path):
    shards = tmp_path / "ds"
    with ShardWriter(shards, max_samples=4) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:03d}", "cls": i})
    ctx = mp.start_processes(_rank_main, args=(str(tmp_path / "init"), str(shards), str(tmp_path)),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("distributed run did not finish in 90 s: a rank is waiting on another")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["rank"] for r in results] == [0, 1] and all(r["world_size"] == WORLD for r in results)
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in results]
        assert per_rank[0]["batches"] == per_rank[1]["batches"] == results[0]["len"]
        ids = per_rank[0]["ids"] + per_rank[1]["ids"]
        assert len(ids) == 24 and set(ids) == set(range(N))  # one sample repeated as padding
        assert max(r["max_wait_s"] for r in per_rank) < 20  # a hang guard: a rank short of a batch blocks for good
    assert results[0]["epochs"][0]["ids"] != results[0]["epochs"][1]["ids"]
