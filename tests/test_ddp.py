"""Two real torch.distributed (gloo) processes: equal batch counts, no rank waits on another.

Each rank all-reduces after every batch, as DDP does in backward; a rank with one batch more
than the other would block forever, so the run is time-bounded and must finish.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter

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
