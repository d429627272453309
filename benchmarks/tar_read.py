"""Raw tar shard reading from the page cache, one process, no decoding: fastdata vs webdataset.

Makes tar shards of random-byte samples with JPEG-like sizes (uniform 50-150 KB ``jpg`` plus a
``cls`` label) with ``fastdata.shards.tar.write_tar_shard``, warms the page cache by reading every
file once, then measures in the same run, median over ``--reps`` repetitions (order alternated):

- ``fastdata``: ``TarShardReader(path).iter_range()`` over every shard (sidecar index loaded inside
  the timing), touching ``len()`` of every value;
- ``fastdata_random``: ``read(i)`` over every shard in a shuffled sample order (random access);
- ``webdataset``: ``webdataset.WebDataset(urls, shardshuffle=False)`` raw iteration (no decode),
  touching ``len()`` of every field value.

GB/s counts member payload bytes (1 GB = 1e9 bytes). Target (issue 2): fastdata >= 1 GB/s and
>= 5x webdataset.

    python benchmarks/tar_read.py --quick --json /tmp/tar_read.json
    python benchmarks/tar_read.py --total-mb 400 --reps 5
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
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdata.shards.tar import TarShardReader, write_tar_shard  # noqa: E402


def make_shards(folder: Path, *, total_mb: float, shard_mb: float, seed: int = 0) -> list[Path]:
    """Write shards of ~``shard_mb`` until ~``total_mb`` of payload; reuse matching ones."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / f"bench-{total_mb}-{shard_mb}-{seed}.json"
    if stamp.exists():
        return [folder / name for name in json.loads(stamp.read_text())]
    rng = np.random.default_rng(seed)
    total, shard_budget = int(total_mb * 1e6), int(shard_mb * 1e6)
    written, paths, i = 0, [], 0
    while written < total:
        samples, size = [], 0
        while size < shard_budget and written + size < total:
            n = int(rng.integers(50_000, 150_001))
            samples.append({"__key__": f"train/c{i % 100:03d}/img{i:08d}", "jpg": rng.bytes(n),
                            "cls": int(i % 100)})
            size += n
            i += 1
        path = folder / f"shard-{len(paths):06d}.tar"
        write_tar_shard(path, samples)
        paths.append(path)
        written += size
    stamp.write_text(json.dumps([p.name for p in paths]))
    return paths


def warm(paths: list[Path]) -> None:
    buf = bytearray(16 << 20)
    for p in paths:
        for q in (p, Path(str(p) + ".idx")):
            if q.exists():
                with open(q, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def _count(samples: Iterable[dict]) -> tuple[int, int]:
    """(samples, payload bytes) of an iterable of samples, touching every value's length."""
    n = nbytes = 0
    for sample in samples:
        n += 1
        for k, v in sample.items():
            if not k.startswith("__"):  # __key__, and webdataset's __url__ etc.
                nbytes += len(v)
    return n, nbytes


def _read_shards(paths: list[Path], order: str) -> Iterator[dict]:
    rng = np.random.default_rng(1)
    for p in paths:
        reader = TarShardReader(p)
        if order == "shard":
            yield from reader.iter_range()
        else:
            for i in rng.permutation(len(reader)).tolist():
                yield reader.read(i)
        reader.close()


def run_fastdata(paths: list[Path]) -> tuple[int, int]:
    return _count(_read_shards(paths, "shard"))


def run_fastdata_random(paths: list[Path]) -> tuple[int, int]:
    return _count(_read_shards(paths, "random"))


def run_webdataset(paths: list[Path]) -> tuple[int, int]:
    import webdataset as wds

    return _count(wds.WebDataset([str(p) for p in paths], shardshuffle=False))


RUNNERS: dict[str, Callable[[list[Path]], tuple[int, int]]] = {
    "fastdata": run_fastdata,
    "fastdata_random": run_fastdata_random,
    "webdataset": run_webdataset,
}


def measure(paths: list[Path], reps: int) -> dict[str, dict[str, Any]]:
    times: dict[str, list[float]] = {name: [] for name in RUNNERS}
    counts: dict[str, tuple[int, int]] = {}
    for rep in range(reps):
        order = list(RUNNERS) if rep % 2 == 0 else list(reversed(RUNNERS))
        for name in order:
            t0 = time.perf_counter()
            counts[name] = RUNNERS[name](paths)
            times[name].append(time.perf_counter() - t0)
    if len({c for c in counts.values()}) != 1:
        raise RuntimeError(f"readers disagree on (samples, bytes): {counts}")
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        samples, nbytes = counts[name]
        out[name] = {"median_s": med, "times_s": ts, "samples": samples, "bytes": nbytes,
                     "gb_per_s": nbytes / med / 1e9, "samples_per_s": samples / med}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="shard folder (kept; default: a temporary folder)")
    ap.add_argument("--total-mb", type=float, default=400.0, help="payload to generate (default 400)")
    ap.add_argument("--shard-mb", type=float, default=64.0, help="payload per shard (default 64)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the median is reported (default 3)")
    ap.add_argument("--quick", action="store_true", help="~50 MB in 16 MB shards")
    ap.add_argument("--json", type=Path, help="write results here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.quick:
        args.total_mb, args.shard_mb = 50.0, 16.0
    warnings.filterwarnings("ignore", module="webdataset")
    with tempfile.TemporaryDirectory(prefix="fastdata-tarbench-") as tmp:
        folder = args.dir or Path(tmp)
        t0 = time.perf_counter()
        paths = make_shards(folder, total_mb=args.total_mb, shard_mb=args.shard_mb)
        made = time.perf_counter() - t0
        warm(paths)
        results = measure(paths, args.reps)
    base = results["webdataset"]["gb_per_s"]
    print(f"{len(paths)} shards, {results['fastdata']['samples']} samples, "
          f"{results['fastdata']['bytes'] / 1e6:.0f} MB payload (made in {made:.1f} s), median of {args.reps}")
    print(f"{'reader':<18}{'GB/s':>8}{'samples/s':>12}{'median s':>10}{'vs wds':>8}")
    for name, r in results.items():
        print(f"{name:<18}{r['gb_per_s']:>8.2f}{r['samples_per_s']:>12.0f}{r['median_s']:>10.3f}"
              f"{r['gb_per_s'] / base:>7.1f}x")
    ratio = results["fastdata"]["gb_per_s"] / base
    print(f"fastdata / webdataset: {ratio:.1f}x (target >= 5x, >= 1 GB/s)")
    if args.json:
        import webdataset

        report = {
            "benchmark": "tar_read",
            "config": {"total_mb": args.total_mb, "shard_mb": args.shard_mb, "reps": args.reps,
                       "quick": args.quick, "num_shards": len(paths)},
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": os.cpu_count(), "webdataset": webdataset.__version__,
                        "numpy": np.__version__},
            "results": results,
            "ratio_vs_webdataset": ratio,
        }
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
