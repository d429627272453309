"""Shard-reader reuse of ShardedDataset: reader opens per epoch and samples/s, two source trees compared.

A reader open is an index parse (sidecar load + identity check: three tar header reads) and a
memory map. The dataset keeps a cache of open readers; this measures how often an epoch opens
one and what that costs, for the default shuffle (``ShuffleOptions()``: 8 open shard pieces, a
1000-sample buffer; ``--no-shuffle``: manifest order, no churn, i.e. the cache's own cost) over
tar shards of ``--per-shard`` samples (``--bytes`` random bytes plus a ``cls`` label, decoded:
cls -> int, the bytes stay bytes).

Rows per shard count and tree: ``list``: ``list(ds)`` in this process; ``loader``:
``fastdata.DataLoader(ds, batch_size=32, num_workers=--workers)`` (fresh worker processes every
epoch, fork); ``threads``: the same with ``decode_threads=--workers`` (no worker processes).
Opens are counted by wrapping the source's shard opener (a shared counter reaches the worker
processes). Each tree runs in its own child process (``--tree NAME=PATH``: the fastdata source
tree to import, e.g. a ``git worktree`` of the commit before), the trees' children alternate
epoch by epoch, and figures are medians over ``--reps`` epochs (the first epoch of each is a
warm-up and not counted).

    flock /tmp/bench.lock python benchmarks/reader_reuse.py --tree before=/tmp/readers-before \\
        --tree after=. --shards 16 64 --reps 7 --json /tmp/reader_reuse.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def make_data(root: Path, shards: int, per_shard: int, nbytes: int) -> Path:
    """Tar shards with a manifest (written once, reused)."""
    import numpy as np

    dest = root / f"{shards}x{per_shard}x{nbytes}"
    if (dest / "manifest.json").is_file():
        return dest
    sys.path.insert(0, str(HERE.parents[1]))
    from fastdata.shards.writer import ShardWriter

    rng = np.random.default_rng(0)
    tmp = dest.with_name(dest.name + ".tmp")
    with ShardWriter(tmp, max_samples=per_shard) as w:
        for i in range(shards * per_shard):
            w.write({"__key__": f"s{i:07d}", "bin": rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes(),
                     "cls": str(i % 1000).encode()})
    tmp.rename(dest)
    return dest


class _Counter:
    """Shard opener wrapper counting opens in a shared (fork-inherited) value."""

    def __init__(self, inner: Any, value: Any):
        self.inner, self.value = inner, value

    def __call__(self, i: int) -> Any:
        with self.value.get_lock():
            self.value.value += 1
        return self.inner(i)


def child(tree: str, data: str, kind: str, workers: int, shuffle: bool) -> None:
    """Serve epochs of one (tree, data set, row kind) on stdin/stdout: a line in, a JSON line out."""
    sys.path.insert(0, os.path.abspath(tree))
    import multiprocessing as mp
    import warnings

    import fastdata
    from fastdata.dataset import ShardedDataset

    assert Path(fastdata.__file__).resolve().is_relative_to(Path(tree).resolve()), fastdata.__file__
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    opens = mp.get_context("fork").Value("q", 0)
    ds = ShardedDataset(data, shuffle=shuffle, seed=0)
    object.__setattr__(ds.source, "_opener", _Counter(ds.source._opener, opens))
    for epoch, _line in enumerate(sys.stdin):
        ds.set_epoch(epoch)
        before = opens.value
        t0 = time.perf_counter()
        if kind == "list":
            n = len(list(ds))
        elif kind == "loader":
            loader = fastdata.DataLoader(ds, batch_size=32, num_workers=workers, multiprocessing_context="fork")
            n = sum(len(b["cls"]) for b in loader)
        else:  # threads: the thread decoder, num_workers virtual workers in this process
            loader = fastdata.DataLoader(ds, batch_size=32, num_workers=workers, decode_threads=workers)
            n = sum(len(b["cls"]) for b in loader)
        dt = time.perf_counter() - t0
        print(json.dumps({"epoch": epoch, "samples": n, "seconds": dt, "opens": opens.value - before}), flush=True)


def _loadavg() -> list[str]:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a fastdata source tree (repeatable)")
    ap.add_argument("--shards", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--per-shard", type=int, default=32)
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7, help="timed epochs per row (after one warm-up epoch)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rows", nargs="+", default=["list", "loader"], choices=["list", "loader", "threads"])
    ap.add_argument("--data", default="/tmp/fastdata-bench-readers")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-shuffle", action="store_true", help="manifest order (no reader churn: the cost of the cache itself)")
    ap.add_argument("--child", nargs=5, metavar=("TREE", "DATA", "KIND", "WORKERS", "SHUFFLE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2], int(args.child[3]), args.child[4] == "1")
        return
    trees = [t.split("=", 1) for t in (args.tree or [f"current={HERE.parents[1]}"])]
    results: list[dict[str, Any]] = []
    print(f"load average at start: {_loadavg()}", flush=True)
    for shards in args.shards:
        data = make_data(Path(args.data), shards, args.per_shard, args.bytes)
        for kind in args.rows:
            cmd = [sys.executable, str(HERE), "--child", "", str(data), kind, str(args.workers),
                   "0" if args.no_shuffle else "1"]
            procs = {name: subprocess.Popen([*cmd[:3], path, *cmd[4:]], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True) for name, path in trees}
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
            try:
                for _ in range(args.reps + 1):  # alternate the trees epoch by epoch
                    for name, _ in trees:
                        p = procs[name]
                        p.stdin.write("\n")  # type: ignore[union-attr]
                        p.stdin.flush()  # type: ignore[union-attr]
                        line = p.stdout.readline()  # type: ignore[union-attr]
                        if not line:
                            raise RuntimeError(f"child for {name} ({kind}, {shards} shards) died")
                        runs[name].append(json.loads(line))
            finally:
                for p in procs.values():
                    p.stdin.close()  # type: ignore[union-attr]
                    p.wait(60)
            for name, _ in trees:
                timed = runs[name][1:]
                rate = statistics.median(r["samples"] / r["seconds"] for r in timed)
                row = {"tree": name, "row": kind, "shards": shards, "per_shard": args.per_shard,
                       "shuffle": not args.no_shuffle,
                       "samples": timed[0]["samples"], "opens_per_epoch": statistics.median(r["opens"] for r in timed),
                       "opens": [r["opens"] for r in runs[name]], "samples_per_s": rate,
                       "epoch_s": [round(r["seconds"], 4) for r in timed]}
                results.append(row)
                print(f"{kind:6} {shards:3d} shards x {args.per_shard:4d}  {name:8} opens: first epoch "
                      f"{runs[name][0]['opens']:6d}, then median {row['opens_per_epoch']:6.0f}/epoch  "
                      f"{rate:9.0f} samples/s", flush=True)
    print(f"load average at end: {_loadavg()}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
