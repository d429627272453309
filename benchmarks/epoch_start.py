"""Epoch starts with persistent workers: does the training loop wait when a new epoch begins?

Uncached JPEG tar shards (``fastdata.cli._synth``) read by ``fastdata.DataLoader`` with
``persistent_workers=True`` through ``CUDAPrefetcher`` (CUDA when available, else the CPU thread
prefetcher); the training step is simulated by ``--step-ms`` of sleep (a GPU step: the training
thread waits and holds no core), chosen so that the loader outpaces the step in steady state.
In steady state the workers are ahead; at each epoch start all of them begin from nothing, and the
first batch takes one worker a whole batch time, more than the prefetcher's ``depth`` steps hide.

Compared in one run, epochs interleaved across repetitions:

- ``preload``: ``DataLoader(preload_next_epoch=True)`` (default): each persistent worker, once its part
  of an epoch is done, loads the first ``prefetch_factor`` batches of its part of the next epoch while
  it waits (epoch predicted from the last epoch change; discarded if another one comes);
- ``no_preload``: ``preload_next_epoch=False`` (workers start each epoch cold: torch's behaviour).

Reported: wait per batch in ``next()`` (p50/p99/max over all batches of the timed epochs), the wait of
the first ``--head`` batches of every epoch (max and sum per epoch start), images/s, and the median
epoch time.

    python benchmarks/epoch_start.py --json /tmp/epoch_start.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdata.cli._synth import make_image_folder  # noqa: E402


def make_shards(work: Path, images: int, side: int) -> Path:
    from fastdata.shards.writer import ShardWriter

    corpus = make_image_folder(work / f"jpeg-{images}-{side}", images, min_side=side, max_side=side + side // 2,
                               workers=min(8, os.cpu_count() or 1))
    shards = work / f"shards-{images}-{side}"
    if not (shards / "manifest.json").exists():
        with ShardWriter(shards, max_samples=max(1, images // 8), overwrite=True) as w:
            for i, f in enumerate(sorted(corpus.rglob("*.jpg"))):
                w.write({"__key__": f"{f.parent.name}/{f.stem}", "jpg": f.read_bytes(), "cls": i % 10})
    return shards


def run(shards: Path, args: argparse.Namespace, preload: bool, device: str) -> dict[str, Any]:
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.prefetch import CUDAPrefetcher
    from fastdata.transforms import ResizeCenterCrop

    ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"], preprocess=ResizeCenterCrop(args.size),
                        rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=True,
                        prefetch_factor=args.prefetch_factor, drop_last=True,
                        multiprocessing_context=args.start_method, preload_next_epoch=preload)
    waits: list[float] = []
    heads: list[float] = []
    epoch_s: list[float] = []
    images = 0
    with CUDAPrefetcher(loader, device=device, depth=args.depth) as pf:
        t_all = None
        for e in range(args.warmup + args.epochs):
            pf.set_epoch(e)
            it = iter(pf)
            timed = e >= args.warmup
            if timed and t_all is None:
                t_all = time.perf_counter()
            t_epoch = time.perf_counter()
            head = 0.0
            j = 0
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                w = time.perf_counter() - t0
                if timed:
                    waits.append(w)
                    images += int(batch["cls"].shape[0])
                    if j < args.head:
                        head += w
                j += 1
                time.sleep(args.step_ms / 1e3)
            if timed:
                heads.append(head)
                epoch_s.append(time.perf_counter() - t_epoch)
        wall = time.perf_counter() - (t_all or time.perf_counter())
    w_ms = np.asarray(waits) * 1e3
    return {"variant": "preload" if preload else "no_preload", "images_per_s": images / wall if wall else 0.0,
            "wait_p50_ms": float(np.percentile(w_ms, 50)), "wait_p99_ms": float(np.percentile(w_ms, 99)),
            "wait_max_ms": float(w_ms.max()), "epoch_start_wait_ms": [h * 1e3 for h in heads],
            "epoch_start_wait_median_ms": statistics.median(heads) * 1e3, "epoch_s_median": statistics.median(epoch_s),
            "batches": len(waits)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--side", type=int, default=160, help="shorter side of the generated JPEGs")
    ap.add_argument("--size", type=int, default=64, help="ResizeCenterCrop size")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--prefetch-factor", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=None,
                    help="simulated step (default: 1.3x the measured steady-state batch interval of the loader)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="untimed epochs (the first epoch change teaches the workers)")
    ap.add_argument("--head", type=int, default=None, help="batches counted as the epoch start (default: workers)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--start-method", default="fork" if sys.platform == "linux" else "spawn")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--variants", nargs="+", default=["no_preload", "preload"], choices=["no_preload", "preload"])
    args = ap.parse_args(argv)
    args.head = args.head or args.workers
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    report: dict[str, Any] = {"benchmark": "epoch_start", "device": device, "python": platform.python_version(),
                              "torch": torch.__version__, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.dir) if args.dir else Path(tmp)
        shards = make_shards(work, args.images, args.side)
        if args.step_ms is None:  # calibrate: the loader's own pace with an idle consumer
            from fastdata.dataset import ShardedDataset
            from fastdata.loader import DataLoader
            from fastdata.transforms import ResizeCenterCrop

            ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"],
                                preprocess=ResizeCenterCrop(args.size), rank=0, world_size=1)
            dl = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=True,
                            drop_last=True, multiprocessing_context=args.start_method, preload_next_epoch=False)
            for e in range(2):
                ds.set_epoch(e)
                t0, n = time.perf_counter(), 0
                for _ in dl:
                    n += 1
                interval = (time.perf_counter() - t0) / n
            del dl
            args.step_ms = 1.3 * interval * 1e3
        report["args"] = {k: str(v) for k, v in vars(args).items()}
        rows: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
        for _ in range(args.reps):
            for variant in args.variants:
                r = run(shards, args, variant == "preload", device)
                rows[r["variant"]].append(r)
                print(f"  {r['variant']:10s} {r['images_per_s']:7.0f} img/s  wait p50/p99/max "
                      f"{r['wait_p50_ms']:.2f}/{r['wait_p99_ms']:.1f}/{r['wait_max_ms']:.1f} ms  epoch-start waits "
                      f"{[round(x, 1) for x in r['epoch_start_wait_ms']]} ms", flush=True)
        for name, rs in rows.items():
            med = {k: statistics.median(r[k] for r in rs) for k in
                   ("images_per_s", "wait_p50_ms", "wait_p99_ms", "wait_max_ms", "epoch_start_wait_median_ms",
                    "epoch_s_median")}
            report["results"].append({"variant": name, **med, "runs": rs})
    print(f"\nstep {args.step_ms:.1f} ms, {args.workers} persistent workers, batch {args.batch_size}, depth {args.depth}")
    for r in report["results"]:
        print(f"{r['variant']:10s} {r['images_per_s']:7.0f} img/s  wait p50 {r['wait_p50_ms']:.2f} p99 {r['wait_p99_ms']:.1f} "
              f"max {r['wait_max_ms']:.1f} ms  epoch-start wait {r['epoch_start_wait_median_ms']:.1f} ms  "
              f"epoch {r['epoch_s_median']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
