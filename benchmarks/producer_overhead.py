"""GIL-held work per batch on the producer side: what a Python-bound training thread loses.

A training thread that launches GPU kernels is Python-bound: every torch op releases the GIL for its C++
part and must take it back, so each microsecond the loading threads hold the GIL is a microsecond the
training thread may lose. This benchmark measures that work per batch on the CPU, where it is the same
as on a GPU box (up to CPU speed):

- ``cached_first``: the first epoch of a loader on the cached fast path (the loader reads and memoizes
  every sample's small uncached fields, ``__key__`` and ``cls``, once);
- ``cached_steady``: its later epochs (``MetaMemo`` columns: one take per field and batch);
- ``cached_per_sample``: the same epochs with the columns switched off (the per-sample dict loop of
  earlier versions), for the before/after ratio from one run;
  for each: wall microseconds per batch with ``gather_threads=1`` and an idle consumer, and the part
  outside the row copies (GIL released inside them), i.e. the GIL-held Python per batch;
- ``prefetch_handoff``: ``CUDAPrefetcher(device="cpu")`` over prebuilt batches, microseconds per batch;
- ``epoch_plan``: the shuffle of one rank's epoch (``mix_segments`` over ``--plan-samples`` samples in
  pieces of 160, ``open_shards=8``, buffer 1000), vectorised vs the per-piece and per-sample loops of
  earlier versions (kept as the reference in tests/dataset/test_split.py), milliseconds of GIL-held
  work at every epoch start (the cached path and the thread decoder plan every virtual worker's
  sequence in the training process);
- ``consumer``: a Python-bound consumer (``--ops`` tiny torch ops per step) fed a resident batch vs by
  the prefetcher over the cached loader: steps/s ratio. On a machine whose cores slow each other down
  (this 2-vCPU VM: a pure-Python process on the other core halves a spinner's speed) this ratio also
  counts CPU interference, not only the GIL; the per-batch figures above do not.

    python benchmarks/producer_overhead.py --json /tmp/producer.json
"""
from __future__ import annotations

import argparse
import gc
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastdata.cli._synth import make_image_folder  # noqa: E402


def make_data(work: Path, images: int, size: int) -> tuple[Path, Any]:
    from fastdata.cache import Cache
    from fastdata.shards.writer import ShardWriter

    corpus = make_image_folder(work / f"jpeg-{images}", images, min_side=max(size, 120), max_side=max(size, 120) + 80,
                               workers=min(8, os.cpu_count() or 1))
    shards = work / f"shards-{images}"
    if not (shards / "manifest.json").exists():
        with ShardWriter(shards, max_bytes=16 << 20, overwrite=True) as w:
            for i, f in enumerate(sorted(corpus.rglob("*.jpg"))):
                w.write({"__key__": f"{f.parent.name}/{f.stem}", "jpg": f.read_bytes(), "cls": i % 10})
    return shards, Cache(work / f"cache-{size}")


class GatherClock:
    """Time spent inside the row copies (``GatherPool.gather``), to subtract from the batch time."""

    def __init__(self) -> None:
        from fastdata.loader import _gather

        self.mod, self.orig, self.total = _gather, _gather.GatherPool.gather, 0.0
        clock = self

        def timed(pool: Any, *a: Any, **k: Any) -> None:
            t0 = time.perf_counter()
            try:
                clock.orig(pool, *a, **k)
            finally:
                clock.total += time.perf_counter() - t0

        _gather.GatherPool.gather = timed  # type: ignore[method-assign]

    def close(self) -> None:
        self.mod.GatherPool.gather = self.orig  # type: ignore[method-assign]


def per_batch(loader: Any, epoch: int, clock: GatherClock) -> tuple[float, float]:
    loader.dataset.set_epoch(epoch)
    clock.total, n = 0.0, 0
    t0 = time.perf_counter()
    for _ in loader:
        n += 1
    wall = time.perf_counter() - t0
    if n == 0:
        raise SystemExit(f"no full batch: each of the {loader.num_workers} workers has fewer than {loader.batch_size} "
                         "samples (drop_last); raise --images")
    if loader.last_path != "cached":
        raise RuntimeError(f"expected the cached path, got {loader.last_path}: {loader.fallback_reason}")
    return wall / n * 1e6, (wall - clock.total) / n * 1e6


def cached_rows(shards: Path, cache: Any, args: argparse.Namespace) -> dict[str, Any]:
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.loader import _cached
    from fastdata.transforms import ResizeCenterCrop

    def dataset() -> Any:
        return ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"], preprocess=ResizeCenterCrop(args.size),
                              cache=cache, rank=0, world_size=1)

    info = dataset().build_cache(num_workers=min(8, os.cpu_count() or 1))
    clock = GatherClock()
    first, steady, old = [], [], []
    memo_cls = getattr(_cached, "MetaMemo", None)  # absent before the columns (a worktree of an older commit)
    try:
        for rep in range(args.reps):
            loader = DataLoader(dataset(), batch_size=args.batch_size, num_workers=args.workers, drop_last=True,
                                gather_threads=1)
            first.append(per_batch(loader, 0, clock))
            for e in range(1, 4):  # new columns vs the per-sample loop, alternating
                steady.append(per_batch(loader, e, clock))
                if memo_cls is None:
                    continue
                orig_has_all = memo_cls.has_all
                memo_cls.has_all = lambda self, rows: False  # type: ignore[method-assign]
                try:
                    old.append(per_batch(loader, e, clock))
                finally:
                    memo_cls.has_all = orig_has_all  # type: ignore[method-assign]
            del loader
            gc.collect()
    finally:
        clock.close()

    def med(xs: list[tuple[float, float]]) -> dict[str, float]:
        return {"us_per_batch": statistics.median(x[0] for x in xs),
                "python_us_per_batch": statistics.median(x[1] for x in xs)}

    out = {"cache_fill_ratio": info.fill_ratio, "cached_first": med(first), "cached_steady": med(steady)}
    if old:
        out["cached_per_sample"] = med(old)
    return out


def handoff(args: argparse.Namespace) -> dict[str, float]:
    from fastdata.prefetch import CUDAPrefetcher

    batches = [{"jpg": torch.zeros(args.batch_size, 3, 8, 8, dtype=torch.uint8),
                "cls": torch.zeros(args.batch_size, dtype=torch.long)} for _ in range(200)]
    rates = []
    with CUDAPrefetcher(batches, device="cpu", depth=2) as pf:
        for _ in range(args.reps + 1):
            t0, n = time.perf_counter(), 0
            for _b in pf:
                n += 1
            rates.append((time.perf_counter() - t0) / n * 1e6)
    return {"us_per_batch": statistics.median(rates[1:])}


def epoch_plan(args: argparse.Namespace) -> dict[str, Any]:
    from fastdata.dataset._split import ShuffleOptions, mix_segments

    n_pieces = max(1, args.plan_samples // 160)
    segments = [(i, 0, 160) for i in range(n_pieces)]
    offsets = np.arange(n_pieces + 1, dtype=np.int64) * 160
    opts = ShuffleOptions()
    out: dict[str, Any] = {"samples": n_pieces * 160}

    def timed() -> tuple[float, np.ndarray]:
        ts, seq = [], None
        for r in range(3):
            t0 = time.perf_counter()
            seq = mix_segments(segments, offsets, opts, 1234 + r)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3, seq  # type: ignore[return-value]

    out["vectorised_ms"], vec = timed()
    # the sequential loops the vectorised code must equal (ROOT is on sys.path); a failed import is an error,
    # not a missing figure
    from tests.dataset import test_split as ref
    ts = []
    for r in range(3):
        t0 = time.perf_counter()
        loops = ref.ref_mix_segments(segments, offsets, opts, 1234 + r)
        ts.append(time.perf_counter() - t0)
    out["loops_ms"] = statistics.median(ts) * 1e3
    out["same_order"] = bool(np.array_equal(vec, loops))
    return out


def consumer(shards: Path, cache: Any, args: argparse.Namespace) -> dict[str, Any]:
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.prefetch import CUDAPrefetcher
    from fastdata.transforms import ResizeCenterCrop

    ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"], preprocess=ResizeCenterCrop(args.size),
                        cache=cache, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, drop_last=True)
    x = torch.zeros(16)

    def step(_batch: Any) -> None:
        y = x
        for _ in range(args.ops):
            y = y + 1

    nb = len(loader)
    resident = next(iter(loader))
    rows: dict[str, list[float]] = {"resident": [], "prefetcher": []}
    with CUDAPrefetcher(loader, device="cpu", depth=2) as pf:
        for e in range(2):  # warm-up: memo epoch
            pf.set_epoch(e)
            for _b in pf:
                pass
        for rep in range(args.reps):
            t0 = time.perf_counter()
            for _ in range(nb):
                step(resident)
            rows["resident"].append((time.perf_counter() - t0) / nb * 1e3)
            pf.set_epoch(2 + rep)
            t0, n = time.perf_counter(), 0
            for b in pf:
                step(b)
                n += 1
            rows["prefetcher"].append((time.perf_counter() - t0) / n * 1e3)
    res, fed = statistics.median(rows["resident"]), statistics.median(rows["prefetcher"])
    return {"ops_per_step": args.ops, "resident_ms_per_step": res, "fed_ms_per_step": fed,
            "fed_over_resident_speed": res / fed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--size", type=int, default=96, help="cached image side (the row copies scale with it)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2, help="virtual workers of the cached path (num_workers)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--plan-samples", type=int, default=160_000)
    ap.add_argument("--ops", type=int, default=600, help="tiny torch ops per consumer step")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report: dict[str, Any] = {"benchmark": "producer_overhead", "python": platform.python_version(),
                              "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                              "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]
                              if Path("/proc/loadavg").exists() else None}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.dir) if args.dir else Path(tmp)
        shards, cache = make_data(work, args.images, args.size)
        report.update(cached_rows(shards, cache, args))
        report["prefetch_handoff"] = handoff(args)
        report["epoch_plan"] = epoch_plan(args)
        report["consumer"] = consumer(shards, cache, args)
    if Path("/proc/loadavg").exists():
        report["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    b = args.batch_size
    print(f"{'row':22s} {'us/batch':>9s} {'GIL-held Python us/batch':>25s}")
    for k in ("cached_first", "cached_steady", "cached_per_sample"):
        if k not in report:
            continue
        print(f"{k:22s} {report[k]['us_per_batch']:9.0f} {report[k]['python_us_per_batch']:25.0f}")
    print(f"{'prefetch_handoff':22s} {report['prefetch_handoff']['us_per_batch']:9.1f}")
    p = report["epoch_plan"]
    print(f"epoch_plan {p['samples']} samples: vectorised {p['vectorised_ms']:.1f} ms, loops {p['loops_ms']:.1f} ms, "
          f"same order {p['same_order']}")
    c = report["consumer"]
    print(f"consumer ({c['ops_per_step']} ops/step, batch {b}): resident {c['resident_ms_per_step']:.3f} ms/step, "
          f"fed {c['fed_ms_per_step']:.3f} ms/step: {c['fed_over_resident_speed']:.3f}x of resident")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
