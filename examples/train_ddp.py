#!/usr/bin/env python3
"""Multi-GPU / multi-node training with fastdata under torchrun (DDP), resumable at any world size.

One node, 8 GPUs::

    torchrun --nproc_per_node 8 examples/train_ddp.py --data /data/imagenet-shards --ckpt ckpt.pt

Several nodes (run on each; ``--node_rank`` 0..N-1, the first node's address as endpoint)::

    torchrun --nnodes 4 --nproc_per_node 8 --node_rank $NODE_RANK \\
        --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \\
        examples/train_ddp.py --data s3://bucket/imagenet-shards --node-cache /local/ssd/fastdata \\
        --cache-bytes 500GB --ckpt /shared/ckpt.pt

``--data`` is a shard folder written by ``tools/shard.py`` (``jpg`` + ``cls`` fields): a local
path, or a URL (``https://``, ``s3://``, ``gs://``) whose shards each host downloads once into
``--node-cache`` (verified against the manifest's sha256, evicted by next use).

What it shows: ``LOCAL_RANK`` picks the device; ``ShardedDataset`` splits every epoch exactly
between the ranks (it reads rank and world size from ``torch.distributed``); ``fastdata.DataLoader``
workers decode; ``CUDAPrefetcher`` copies batches to the device ahead of the step and normalises them
there; ``TrainStep`` runs the AMP step on the DDP model; the checkpoint holds the model, the
optimizer and *every rank's* loader position, so a job restarted with another number of processes
(``--nproc_per_node``/``--nnodes``) continues the interrupted epoch: each remaining sample once, every
rank the same number of batches. Without a GPU it runs on the CPU with the gloo backend.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import fastdata
from fastdata.gpu import Normalize


def to_example(sample: dict[str, Any]) -> dict[str, Any]:
    """Sample dict -> the batch entries the step reads (top level: picklable for spawned workers)."""
    return {"input": sample["jpg"], "target": sample["cls"], "key": sample["__key__"]}


def build_model(name: str, classes: int) -> torch.nn.Module:
    if name == "tiny":  # a few conv layers: enough to show the wiring, fast on a CPU
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes))
    import torchvision

    return getattr(torchvision.models, name)(num_classes=classes)


class AllRanks:
    """The loader position of every rank, for ``save_checkpoint(loader=...)``: gathered so that a
    restart at another world size can hand each new rank its share of the rest of the epoch."""

    def __init__(self, states: list[Any]):
        self.states = states

    def state_dict(self) -> list[Any]:
        return self.states


def save(path: Path, step: fastdata.TrainStep, prefetcher: fastdata.CUDAPrefetcher, epoch: int) -> None:
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, prefetcher.state_dict())  # a collective: every rank calls save()
    if dist.get_rank() == 0:
        fastdata.save_checkpoint(path, step, loader=AllRanks(states), epoch=epoch)
    dist.barrier()  # nobody runs ahead of a checkpoint that is still being written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="shard folder or URL (manifest.json inside)")
    ap.add_argument("--ckpt", type=Path, required=True, help="checkpoint file (resumed from when it exists)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank")
    ap.add_argument("--size", type=int, default=224, help="images are resized and center-cropped to this")
    ap.add_argument("--model", default="resnet50", help="'tiny' or a torchvision model name")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=500, help="optimizer steps between checkpoints")
    ap.add_argument("--node-cache", default=None, help="node-local shard cache folder (URL data)")
    ap.add_argument("--cache-bytes", default=None, help="byte limit of the node cache, e.g. 500GB")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="checkpoint and exit after this many steps (simulates a preemption)")
    ap.add_argument("--log-keys", type=Path, default=None, help="append the sample keys each rank trained on")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    source: Any = args.data
    if "://" in args.data:  # remote: one download per host into the node-local cache
        source = fastdata.RemoteShards(args.data, cache_dir=args.node_cache, max_bytes=args.cache_bytes)
    dataset = fastdata.ShardedDataset(source, shuffle=True, seed=args.seed, fields=["jpg", "cls"],
                                      preprocess=fastdata.ResizeCenterCrop(args.size), sample_transform=to_example)
    loader = fastdata.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers, pin_memory=cuda,
                                 persistent_workers=args.workers > 0)
    prefetcher = fastdata.CUDAPrefetcher(loader, device=device, transform=Normalize(keys=["input"]),
                                         keep_on_host=["key"])

    model = build_model(args.model, args.classes).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = fastdata.TrainStep(model, optimizer, F.cross_entropy)

    start = 0
    if args.ckpt.is_file():  # every rank loads the same file; the loader takes its share of the epoch
        start = fastdata.load_checkpoint(args.ckpt, step, loader=prefetcher).epoch or 0
        if rank == 0:
            print(f"resumed from {args.ckpt} at epoch {start}, step {step.steps}", flush=True)

    log = None
    if args.log_keys is not None:
        args.log_keys.mkdir(parents=True, exist_ok=True)
        log = open(args.log_keys / f"rank{rank}-of-{dist.get_world_size()}-pid{os.getpid()}.jsonl", "a")
    for epoch in range(start, args.epochs):
        prefetcher.set_epoch(epoch)
        for batch in prefetcher:
            loss = step(batch)
            if log is not None:
                log.write(json.dumps({"epoch": epoch, "keys": list(batch["key"])}) + "\n")
            if args.stop_after is not None and step.steps >= args.stop_after:
                save(args.ckpt, step, prefetcher, epoch)
                if rank == 0:
                    print(f"stopping after {step.steps} steps (checkpoint {args.ckpt})", flush=True)
                if log is not None:
                    log.close()
                prefetcher.close()
                dist.destroy_process_group()
                return
            if step.steps % args.ckpt_every == 0:
                save(args.ckpt, step, prefetcher, epoch)
        save(args.ckpt, step, prefetcher, epoch + 1)
        if rank == 0:
            print(f"epoch {epoch} done: {step.steps} steps, last loss {loss.item():.4f}", flush=True)
    if log is not None:
        log.close()
    prefetcher.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
