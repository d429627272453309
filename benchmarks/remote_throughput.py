#!/usr/bin/env python3
"""Remote shards over loopback HTTP with the node-local cache vs the same shards on local disk.

    python3 benchmarks/remote_throughput.py [--shards 16] [--shard-mb 16] [--epochs 3] [--out DIR]

Writes a shard set (random payloads, so nothing compresses), serves it from a separate process on
127.0.0.1 (tests/helpers/loopback_server.py, no Range support, stops by itself), then times full epochs
(shuffled; ``--payload raw``: random bytes, no decoding, the I/O path alone and the hardest case
for remote reads; ``--payload jpeg``: JPEGs decoded and resized, a training input pipeline):

* local: ``ShardedDataset(folder)`` (warm page cache);
* remote: ``ShardedDataset(RemoteShards(url, cache_dir=fresh))``: epoch 0 downloads every shard
  into the node cache (``prefetch`` ahead), later epochs read the cache;
  local and remote epochs alternate, ``--repeat`` rounds with a fresh cache each; the ratio per
  epoch is the median over rounds of local time / remote time (1.0 = as fast as local disk);
* eviction at 2x oversubscription: a cache half the dataset size, ``eviction="future"`` vs
  ``"lru"``; hit rate = shards found in the cache / shards opened, over epochs 1.. (epoch 0 misses
  everything whatever the policy). Every figure is measured by this run; nothing is assumed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastdata.dataset import RemoteShards, ShardedDataset, ShuffleOptions  # noqa: E402
from fastdata.loader import DataLoader  # noqa: E402
from fastdata.shards.writer import ShardWriter  # noqa: E402


def make_set(dest: Path, shards: int, shard_mb: int, sample_kb: int, payload: str) -> int:
    if payload == "jpeg":  # photo-like 500x375 JPEGs (ImageNet's typical size), a few distinct ones reused
        import numpy as np

        from fastdata.cli._synth import jpeg_bytes, synth_image

        rng = np.random.default_rng(0)
        images = [jpeg_bytes(synth_image(rng, 500, 375, cls=k), 92) for k in range(16)]
        sample_kb = max(1, sum(len(b) for b in images) // len(images) // 1024)
    per_shard = max(1, shard_mb * 1024 // sample_kb)
    n = shards * per_shard
    with ShardWriter(dest, max_samples=per_shard) as w:
        for i in range(n):
            if payload == "jpeg":
                w.write({"__key__": f"s{i:07d}", "jpg": images[i % len(images)], "cls": str(i % 10).encode()})
            else:
                w.write({"__key__": f"s{i:07d}", "bin": os.urandom(sample_kb * 1024), "cls": str(i % 10).encode()})
    return n


def serve(root: Path, lifetime: float) -> tuple[subprocess.Popen, str]:
    port_file = root / "url.txt"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "loopback_server.py"), str(root), "--port-file",
                             str(port_file), "--lifetime", str(lifetime), "--no-ranges"])
    t0 = time.monotonic()
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() - t0 > 30:
            raise RuntimeError("the loopback server did not start")
        time.sleep(0.05)
    return proc, port_file.read_text()


def epoch_seconds(ds: ShardedDataset, epoch: int, workers: int) -> tuple[float, int]:
    ds.set_epoch(epoch)
    t0 = time.perf_counter()
    if workers:
        n = sum(len(b) for b in DataLoader(ds, batch_size=32, num_workers=workers, collate_fn=lambda xs: xs))
    else:
        n = sum(1 for _ in ds)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--shard-mb", type=int, default=16)
    ap.add_argument("--sample-kb", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers (0: in-process)")
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--evict-epochs", type=int, default=6, help="epochs of the eviction comparison (0: skip it)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (fresh node cache each)")
    ap.add_argument("--payload", choices=("raw", "jpeg"), default="raw",
                    help="raw: random bytes, read without decoding (I/O only); jpeg: 500x375 JPEGs decoded and "
                         "resized to 224 (a training input pipeline)")
    ap.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="fastdata-remote-bench-") as tmp:
        www = Path(tmp) / "www"
        n = make_set(www / "ds", args.shards, args.shard_mb, args.sample_kb, args.payload)
        if args.payload == "jpeg":
            from fastdata.transforms import ResizeCenterCrop

            work = {"decode": True, "preprocess": ResizeCenterCrop(224)}
        else:
            work = {"decode": False}
        total_mb = sum(p.stat().st_size for p in (www / "ds").glob("*.tar")) / 1e6
        proc, url = serve(www, lifetime=900)
        try:
            shuffle = ShuffleOptions(open_shards=2, buffer_size=256)
            local = ShardedDataset(www / "ds", shuffle=shuffle, **work)
            epoch_seconds(local, 0, args.workers)  # warm the page cache
            rounds = []
            for r in range(args.repeat):  # interleaved, so that load from other processes hits both alike
                remote = ShardedDataset(RemoteShards(url + "/ds", cache_dir=Path(tmp) / f"nodecache{r}",
                                                     prefetch=args.prefetch), shuffle=shuffle, **work)
                row = {"local": [], "remote": []}
                for e in range(args.epochs):
                    row["local"].append(epoch_seconds(local, e, args.workers)[0])
                    s, count = epoch_seconds(remote, e, args.workers)
                    assert count == n, (count, n)
                    row["remote"].append(s)
                rounds.append(row)
            shard_bytes = max(p.stat().st_size for p in (www / "ds").glob("*.tar"))
            limit = shard_bytes * args.shards // 2
            hits = {}
            for policy in (("future", "lru") if args.evict_epochs >= 2 else ()):
                ds = ShardedDataset(RemoteShards(url + "/ds", cache_dir=Path(tmp) / f"evict-{policy}", max_bytes=limit,
                                                 prefetch=0, eviction=policy),
                                    shuffle=ShuffleOptions(open_shards=1, buffer_size=0, within_shard=False),
                                    decode=False)
                first = 0
                for e in range(args.evict_epochs):
                    ds.set_epoch(e)
                    for _ in ds:
                        pass
                    if e == 0:
                        first = ds.source.node_cache.stats.downloads
                later = ds.source.node_cache.stats.downloads - first
                opened = args.shards * (args.evict_epochs - 1)
                hits[policy] = {"downloads_after_epoch0": later, "shards_opened": opened,
                                "hit_rate": round(1 - later / opened, 3)}
        finally:
            proc.terminate()
            proc.wait(10)

    print(f"{n} {args.payload} samples in {args.shards} shards ({total_mb:.0f} MB), workers={args.workers}, "
          f"prefetch={args.prefetch}, server without Range support on 127.0.0.1, {args.repeat} interleaved rounds")
    print(f"{'epoch':>5s} {'local s':>8s} {'remote s':>9s} {'local MB/s':>11s} {'remote MB/s':>12s} "
          f"{'remote/local (median, min-max)':>32s}")
    summary = []
    for e in range(args.epochs):
        loc = [r["local"][e] for r in rounds]
        rem = [r["remote"][e] for r in rounds]
        ratios = sorted(a / b for a, b in zip(loc, rem))
        med = ratios[len(ratios) // 2]
        summary.append({"epoch": e, "local_s": loc, "remote_s": rem, "ratio_median": med})
        print(f"{e:5d} {statistics.median(loc):8.2f} {statistics.median(rem):9.2f} "
              f"{total_mb / statistics.median(loc):11.0f} {total_mb / statistics.median(rem):12.0f} "
              f"{med:>17.0%} ({ratios[0]:.0%}-{ratios[-1]:.0%})")
    if hits:
        print(f"eviction at 2x oversubscription (cache = {limit / 1e6:.0f} MB, {args.evict_epochs} epochs, hit rate over "
              f"epochs 1..): future {hits['future']['hit_rate']:.0%}, LRU {hits['lru']['hit_rate']:.0%}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "remote_throughput.json").write_text(json.dumps({
            "payload": args.payload, "samples": n, "megabytes": total_mb, "workers": args.workers, "prefetch": args.prefetch,
            "epochs": summary, "eviction": hits, "cache_bytes": limit}, indent=1))


if __name__ == "__main__":
    main()
