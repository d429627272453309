"""Per-batch cost of the DataLoader's stall watchdog (``stall_warning=``), from one run.

``fastdata.DataLoader``'s iterator takes one ``time.monotonic()`` and stores it twice per batch while
the watchdog is on (``_iteration.WatchedIter``; with ``stall_warning=None`` the iterator is the plain one, whose
``next()`` is unchanged by this feature). This measures that cost where nothing else hides it: the
loader's iterator over an inner generator that hands out ready batches (the cached fast path's
``FastBatch``: no store, no workers), off and on (the default, 60 s), interleaved, ``--repeats``
times each; it prints the median nanoseconds per ``next()`` of both and their difference. A real
batch costs tens of microseconds (cached path) to milliseconds (worker IPC).

    flock /tmp/bench.lock python3 benchmarks/stall_watchdog.py --batches 200000 --repeats 7
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader, _cached, _iteration
from fastdata.shards.writer import ShardWriter


def per_batch_ns(loader: DataLoader, batches: int) -> float:
    ds = loader.dataset
    start = ds.loader_seam.epoch_start(1)
    run = _iteration.Run(start, list(start.consumed))
    ready = [_cached.FastBatch(i, 0, i) for i in range(batches)]
    it = _iteration.loader_iter(loader, (b for b in ready), run, batches, _iteration.gather_helpers)  # as the cached path
    t0 = time.perf_counter_ns()
    for _ in it:
        pass
    return (time.perf_counter_ns() - t0) / batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with ShardWriter(Path(tmp) / "ds", max_samples=8) as w:
            for i in range(8):
                w.write({"__key__": f"s{i}", "cls": i})
        ds = ShardedDataset(Path(tmp) / "ds", shuffle=False)
        loaders = {"off": DataLoader(ds, batch_size=1, stall_warning=None), "on": DataLoader(ds, batch_size=1)}
        times: dict[str, list[float]] = {k: [] for k in loaders}
        per_batch_ns(loaders["on"], 1000)  # warm up
        for _ in range(args.repeats):
            for name, loader in loaders.items():
                times[name].append(per_batch_ns(loader, args.batches))
    med = {k: statistics.median(v) for k, v in times.items()}
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"next() over ready batches, median of {args.repeats} x {args.batches:,} (load {load}):")
    print(f"  stall_warning=None  {med['off']:8.0f} ns/batch")
    print(f"  stall_warning=60    {med['on']:8.0f} ns/batch")
    print(f"  watchdog cost       {med['on'] - med['off']:8.0f} ns/batch")
    if args.json is not None:
        args.json.write_text(json.dumps({"ns_per_batch": times, "median": med, "load": load}, indent=1))


if __name__ == "__main__":
    main()
