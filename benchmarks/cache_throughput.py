"""Preprocessing cache throughput: uncached epoch vs cached epoch, cached reading per core, store size.

On a photo-like JPEG corpus (``fastdata.cli._synth.make_image_folder``, 300-640 px) written to tar
shards, ``ShardedDataset(shards, preprocess=ResizeCenterCrop(size), cache=...)`` through
``fastdata.DataLoader`` with the same settings (workers, persistent workers, batch size) for
every pipeline:

- ``uncached``: no cache; every epoch decodes and resizes every JPEG in the workers;
- ``fill``: the first cached epoch (decode, resize, write into the store; through the workers);
- ``cached``: later epochs with ``cached_fast_path="auto"``: the store is complete, so the
  loader gathers each batch from the store in this process (``--gather-threads`` numpy threads) instead of
  handing it over from a worker; ``cached_gb_per_cpu_s`` is its image bytes per CPU second
  of this process (all its threads), i.e. cached reading per core;
- ``cached_workers``: the same cached epoch forced through the workers
  (``cached_fast_path=False``), for reference: bounded by the per-batch worker-to-main hand-off
  (a 64 x 150 kB batch is 9.6 MB of fresh shared memory), not by the cache;
- ``raw_read``: one thread, ``Store.get`` per sample copied into a reused batch buffer, warm
  (page cache) and cold (pages dropped with ``posix_fadvise``), GB/s;
- ``gather_read``: one thread, ``Store.get_batch`` of shuffled indices into a reused buffer.

Uncached and cached epochs alternate, so that load changes on a shared machine hit both alike;
figures are medians over ``--repeats`` epochs. ``cached_over_uncached`` is the headline ratio.

    python benchmarks/cache_throughput.py --quick --json /tmp/cache.json
    python benchmarks/cache_throughput.py --json /tmp/cache.json        # 2048 images, 3 repeats
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdata.cli._synth import make_image_folder  # noqa: E402
from fastdata.cache import Cache  # noqa: E402


class Pipelines:
    """Tar shards of the corpus and ``fastdata.DataLoader``s over them, uncached and cached."""

    def __init__(self, corpus: Path, work: Path, *, size: int, cache: Cache) -> None:
        from fastdata.shards.writer import ShardWriter
        from fastdata.transforms import ResizeCenterCrop

        files = sorted(corpus.rglob("*.jpg"))
        self.shards = work / f"shards-{corpus.name}"
        if not (self.shards / "manifest.json").exists():
            with ShardWriter(self.shards, max_bytes=64 << 20, overwrite=True) as w:
                for i, f in enumerate(files):
                    w.write({"__key__": f"{f.parent.name}/{f.stem}", "jpg": f.read_bytes(), "cls": i % 10})
        self.preprocess = ResizeCenterCrop(size)
        self.cache = cache
        self._store: Any = None

    def loader(self, *, cached: bool, **kw: Any) -> Any:
        from fastdata.dataset import ShardedDataset
        from fastdata.loader import DataLoader

        ds = ShardedDataset(self.shards, preprocess=self.preprocess, cache=self.cache if cached else None,
                            rank=0, world_size=1)
        if cached and self._store is None:
            self._store = ds.loader_seam.cache_store()
        return DataLoader(ds, **kw)

    def store(self) -> Any:
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def epoch(loader: Any, *, path: str | None = None) -> tuple[int, float, float]:
    """(samples, wall seconds, CPU seconds of this process) of one pass over ``loader``."""
    n = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for batch in loader:
        n += len(batch["jpg"])
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if path is not None and loader.last_path != path:
        raise RuntimeError(f"expected the {path} path, the loader took {loader.last_path}: {loader.fallback_reason}")
    return n, wall, cpu


def raw_read(store: Any, *, batch_size: int) -> dict[str, float]:
    """One process, one core: per-sample ``Store.get`` copied into a reused batch buffer (what
    collation does with the zero-copy tensors)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core: torch would split each 150 kB copy across threads
    out = {k: torch.empty((batch_size, *v.shape), dtype=v.dtype) for k, v in store.get(0).items()}
    n, nbytes = store.num_samples, 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for start in range(0, n, batch_size):
        for j, i in enumerate(range(start, min(start + batch_size, n))):
            for k, t in store.get(i).items():
                out[k][j].copy_(t)
                nbytes += t.nbytes
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    torch.set_num_threads(threads)
    return {"samples_per_s": n / wall, "gb_per_s": nbytes / wall / 1e9, "gb_per_cpu_s": nbytes / max(cpu, 1e-9) / 1e9}


def gather_read(store: Any, *, batch_size: int) -> dict[str, float]:
    """One process, one core: ``Store.get_batch`` of shuffled index batches into a reused buffer."""
    order = np.random.default_rng(0).permutation(store.num_samples)
    out = {f.name: torch.empty((batch_size, *f.shape), dtype=torch.from_numpy(np.empty(0, f.dtype)).dtype)
           for f in store.fields}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core (and immune to thread oversubscription on a busy machine)
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        store.get_batch(order[start:start + batch_size], out=out)
    wall = time.perf_counter() - t0
    torch.set_num_threads(threads)
    nbytes = len(order) * sum(f.nbytes for f in store.fields)
    return {"samples_per_s": len(order) / wall, "gb_per_s": nbytes / wall / 1e9}


def drop_page_cache(info: Any) -> None:
    """Evict the store's pages from the page cache (no root needed: fadvise on unmapped, clean pages)."""
    for f in info.fields:
        fd = os.open(info.path / f.file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small corpus, one repetition (a few seconds)")
    p.add_argument("--images", type=int, default=None, help="corpus size (default 2048, --quick 256)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=None, help="epochs per measurement (default 3, --quick 1)")
    p.add_argument("--gather-threads", type=int, default=None,
                   help="cached fast path gather threads (default: fastdata.DataLoader's own default)")
    p.add_argument("--dir", default=None, help="work folder (corpus is kept and reused); default: temporary")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    args = p.parse_args(argv)
    images = args.images or (256 if args.quick else 2048)
    repeats = args.repeats or (1 if args.quick else 3)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.dir) if args.dir else Path(tmp)
        corpus = make_image_folder(work / f"jpeg-{images}", images, workers=max(1, min(args.workers, 8)))
        cache_dir = work / "cache"
        for info in Cache(cache_dir).list():  # measure a fill from scratch
            Cache(cache_dir).remove(info.key)
        pipe = Pipelines(corpus, work, size=args.size, cache=Cache(cache_dir))
        loader_kw: dict[str, Any] = dict(batch_size=args.batch_size, num_workers=args.workers,
                                         gather_threads=args.gather_threads)
        if args.workers:  # the same persistent workers for every pipeline, as in a training loop
            loader_kw.update(persistent_workers=True, multiprocessing_context="fork")

        uncached_loader = pipe.loader(cached=False, **loader_kw)
        cached_loader = pipe.loader(cached=True, **loader_kw)  # cached_fast_path="auto"
        workers_loader = pipe.loader(cached=True, cached_fast_path=False, **loader_kw)
        epoch(uncached_loader)  # warm-up: worker start, page cache for the shards
        fill = epoch(cached_loader, path="workers")  # first cached epoch: decode, resize, write
        for _ in range(3):  # warm-up of the fast path: this process maps the store, malloc settles
            epoch(cached_loader, path="cached")
        epoch(workers_loader, path="workers")
        unc, cached, cached_workers = [], [], []
        for _ in range(repeats):  # alternate, so that load changes on a shared machine hit all alike
            unc.append(epoch(uncached_loader))
            cached.append(epoch(cached_loader, path="cached"))
            cached_workers.append(epoch(workers_loader, path="workers"))
        cached_threads = cached_loader._gather.threads if cached_loader._gather is not None else None
        del uncached_loader, cached_loader, workers_loader
        gc.collect()
        store = pipe.store()
        if store.num_valid() != store.num_samples:
            raise RuntimeError(f"fill epoch left {store.num_samples - store.num_valid()} samples unfilled")
        sample_nbytes = sum(f.nbytes for f in store.fields)
        warm = [raw_read(store, batch_size=args.batch_size) for _ in range(max(repeats, 3))]
        gather = [gather_read(store, batch_size=args.batch_size) for _ in range(max(repeats, 3))]
        key, fingerprint, n = store.key, store.fingerprint, store.num_samples
        pipe.close()
        gc.collect()
        drop_page_cache(Cache(cache_dir).info(key))
        cold_store = Cache(cache_dir).open_store(fingerprint=fingerprint, num_samples=n)
        cold = raw_read(cold_store, batch_size=args.batch_size)
        cold_store.close()
        info = Cache(cache_dir).info(key)

        def rate(runs: list[tuple[int, float, float]]) -> float:
            return statistics.median(k / wall for k, wall, _ in runs)

        res = {
            "benchmark": "cache_throughput",
            "images": images, "workers": args.workers, "batch_size": args.batch_size, "size": args.size,
            "repeats": repeats,
            "uncached_samples_per_s": rate(unc),
            "fill_samples_per_s": rate([fill]),
            "cached_samples_per_s": rate(cached),
            "cached_gb_per_s": rate(cached) * sample_nbytes / 1e9,
            "cached_gb_per_cpu_s": statistics.median(k * sample_nbytes / cpu / 1e9 for k, _, cpu in cached),
            "cached_workers_samples_per_s": rate(cached_workers),
            "raw_read_warm_gb_per_s": statistics.median(r["gb_per_s"] for r in warm),
            "raw_read_warm_gb_per_cpu_s": statistics.median(r["gb_per_cpu_s"] for r in warm),
            "raw_read_warm_samples_per_s": statistics.median(r["samples_per_s"] for r in warm),
            "raw_read_cold_gb_per_s": cold["gb_per_s"],
            "gather_read_gb_per_s": statistics.median(r["gb_per_s"] for r in gather),
            "gather_read_samples_per_s": statistics.median(r["samples_per_s"] for r in gather),
            "store_bytes_on_disk": info.size_bytes,
            "store_bytes_per_sample": info.size_bytes / info.num_samples,
            "sample_nbytes": info.sample_nbytes,
            "corpus_jpeg_bytes_per_sample": sum(f.stat().st_size for f in corpus.rglob("*.jpg")) / images,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                        "numpy": np.__version__, "load_avg_1m": os.getloadavg()[0]},
        }
        res["cached_gather_threads"] = cached_threads
        res["cached_over_uncached"] = res["cached_samples_per_s"] / res["uncached_samples_per_s"]
        res["cached_workers_over_uncached"] = res["cached_workers_samples_per_s"] / res["uncached_samples_per_s"]

    for k, v in res.items():
        if k != "machine":
            print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
