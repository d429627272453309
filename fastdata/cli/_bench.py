"""``fastdata bench [SHARDS]``: measure raw shard reads, the decode pipeline, the cache and H2D copies.

With SHARDS it measures the user's own shards: raw reads over the first ``--samples`` samples of
SHARDS, and the pipelines over a copy of those samples (so a cache of them stays small whatever
the dataset's size). Without SHARDS it generates a small photo-like JPEG set first.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

IMAGE_SIZE = 224
BATCH_SIZE = 64


def _timed_passes(make_iter: Callable[[], Iterator[Any]], repeats: int) -> list[float]:
    """Seconds per pass of ``make_iter()``, after one warm-up pass."""
    for _ in make_iter():
        pass
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in make_iter():
            pass
        out.append(time.perf_counter() - t0)
    return out


def _raw_read(source: Path, samples: int, repeats: int) -> dict[str, float]:
    """GB/s and samples/s reading every field of the first ``samples`` samples of ``source`` (median pass)."""
    from fastdata.manifest import Manifest
    from fastdata.shards.reader import open_shard

    m = Manifest.load(source)
    readers, left = [], samples
    for s in m.shards:
        if left <= 0:
            break
        readers.append((open_shard(source, s, format=m.format), min(s.num_samples, left)))
        left -= s.num_samples
    count = sum(n for _, n in readers)
    nbytes = 0
    for reader, n in readers:
        for sample in reader.iter_range(0, n):
            nbytes += sum(len(v) if isinstance(v, (bytes, bytearray, memoryview)) else int(getattr(v, "nbytes", 0))
                          for k, v in sample.items() if k != "__key__")

    def passes() -> Iterator[Any]:
        for reader, n in readers:
            yield from reader.iter_range(0, n)

    t = statistics.median(_timed_passes(passes, repeats))
    for reader, _ in readers:
        reader.close()
    return {"GB/s": nbytes / t / 1e9, "samples/s": count / t, "samples": count}


def measure(source: Path, *, samples: int, workers: int, repeats: int, size: int, workdir: Path) -> dict[str, Any]:
    """Every bench measurement over ``source`` (results as a JSON-ready dict)."""
    import torch

    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.manifest import Manifest
    from fastdata.monitor import cores, measure_h2d
    from fastdata.transforms import ResizeCenterCrop

    results: dict[str, Any] = {"source": str(source), "workers": workers, "repeats": repeats, "size": size,
                               "cores": cores(),
                               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    results["raw_read"] = _raw_read(source, samples, repeats)
    subset = _subset(source, workdir / "subset", samples)
    m = Manifest.load(subset)
    results["samples"] = m.num_samples
    fields = [_image_field(m)] + [f.name for f in m.fields if f.name.rsplit(".", 1)[-1] == "cls"][:1]
    # ShardedDataset decodes and resizes encoded images only: stored arrays (`fastdata shard --resize`) are read as stored
    results["stored_arrays"] = next(f.kind for f in m.fields if f.name == fields[0]) == "array"

    def pipeline(cache: Path | None) -> Callable[[], Iterator[Any]]:
        ds = ShardedDataset(subset, fields=fields, preprocess=ResizeCenterCrop(size), cache=cache)
        loader = DataLoader(ds, batch_size=BATCH_SIZE, num_workers=workers, persistent_workers=workers > 0)
        return lambda: iter(loader)

    t_dec = statistics.median(_timed_passes(pipeline(None), repeats))
    results["decode_pipeline"] = {"images/s": m.num_samples / t_dec}
    t_cached = statistics.median(_timed_passes(pipeline(workdir / "cache"), repeats))
    results["cached_pipeline"] = {"images/s": m.num_samples / t_cached, "speedup": t_dec / t_cached}
    if torch.cuda.is_available():
        rates = measure_h2d(BATCH_SIZE * 3 * size * size, repeats=max(repeats, 5))  # one uint8 batch
        results["h2d"] = {f"{k}_GB/s": v for k, v in rates.items()}
    return results


def _image_field(manifest: Any) -> str:
    from fastdata.decode import is_image_field
    from fastdata.errors import FastdataError

    for f in manifest.fields:
        if is_image_field(f.name) or (f.kind == "array" and f.dtype == "uint8" and f.shape and len(f.shape) == 3):
            return f.name
    raise FastdataError(f"no image field among {[f.name for f in manifest.fields]}: bench measures image pipelines")


def _subset(source: Path, dest: Path, samples: int) -> Path:
    """The first ``samples`` samples of ``source`` copied into ``dest`` (the whole source if it is that small).

    Fields other than encoded images are decoded before writing, so that the copy's manifest keeps their
    kinds (an ``img.npy`` array stays a uint8 array, ``cls`` an int) rather than calling every field bytes.
    ``dest`` is bench's own folder: a previous run's copy there is replaced.
    """
    from fastdata.decode import IMAGE_SUFFIXES, PICKLE_SUFFIXES, SampleDecoder
    from fastdata.manifest import Manifest
    from fastdata.shards.reader import open_shard
    from fastdata.shards.writer import ShardWriter

    m = Manifest.load(source)
    if m.num_samples <= samples:
        return source
    decode = SampleDecoder({name: None for name in IMAGE_SUFFIXES | PICKLE_SUFFIXES})
    with ShardWriter(dest, format=m.format, max_samples=max(16, samples // 8), overwrite=True) as writer:
        left = samples
        for shard in m.shards:
            if left <= 0:
                break
            reader = open_shard(source, shard, format=m.format)
            for s in reader.iter_range(0, min(len(reader), left)):
                s = decode(s, shard=shard.name)
                writer.write({k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()})
                left -= 1
            reader.close()
    return dest


def format_results(r: dict[str, Any]) -> list[str]:
    lines = [(f"{'measurement':<18} result  ({r['samples']} samples of {r['source']}, {r['workers']} workers, "
             f"median of {r['repeats']})"),
             f"{'raw shard read':<18} {r['raw_read']['GB/s']:.2f} GB/s, {r['raw_read']['samples/s']:,.0f} samples/s",
             (f"{'decode pipeline':<18} {r['decode_pipeline']['images/s']:,.0f} images/s "
             + (f"(stored arrays, read as stored: no decode or resize; batch {BATCH_SIZE})"
                if r.get("stored_arrays") else f"(decode + ResizeCenterCrop({r['size']}), batch {BATCH_SIZE})")),
             (f"{'cached pipeline':<18} {r['cached_pipeline']['images/s']:,.0f} images/s "
             f"({r['cached_pipeline']['speedup']:.1f}x the decode pipeline)")]
    if "h2d" in r:
        h = r["h2d"]
        lines.append(f"{'host-to-device':<18} pinned {h['pinned_GB/s']:.1f} GB/s, pageable {h['pageable_GB/s']:.1f} GB/s")
    return lines


def run_bench(*, source: str | None, workdir: str | None, num_images: int, samples: int, num_workers: int,
              repeats: int, size: int = IMAGE_SIZE, as_json: bool = False, out: str | None = None) -> int:
    """Measure ``source`` (or a generated set); print a table or, with ``as_json``, JSON on stdout."""
    if source is not None:  # a bad SHARDS is named before --dir is created, which would be left behind empty
        from fastdata.manifest import Manifest
        from fastdata.monitor import shard_folder

        source = str(shard_folder(source))  # ~, file:// and a manifest.json read as everywhere; a URL refused
        Manifest.load(source)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fastdata-bench-")))
        else:
            from fastdata.cli._demo import claim_workdir

            root = claim_workdir(Path(workdir), "bench")
            if (root / "cache").is_dir():  # an earlier run's entries (other data): one per run would pile up
                shutil.rmtree(root / "cache")
        if source is None:
            from fastdata.cli._demo import _make_shards

            with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout):  # stdout carries only JSON
                shards, _ = _make_shards(root, num_images, num_workers, labels=("data:", "shards:"),
                                         show_paths=workdir is not None)  # a temporary folder is gone afterwards
        else:
            shards = Path(source)
        results = measure(shards, samples=samples, workers=num_workers, repeats=repeats, size=size, workdir=root)
        if source is None and workdir is None:  # not the temporary folder's path, gone by now
            results["source"] = f"{num_images} generated photo-like JPEGs (in a temporary folder, deleted)"
    if out:  # first: a reader of stdout that went away (`| head`) does not lose the file
        Path(out).write_text(json.dumps(results, indent=1))
    if as_json:
        print(json.dumps(results, indent=1))
    else:
        print("\n".join(format_results(results)))
    return 0


def _cmd_bench(args: Any) -> int:
    return run_bench(source=args.shards, workdir=args.dir, num_images=args.images, samples=args.samples,
                     num_workers=args.workers, repeats=args.repeats, size=args.size, as_json=args.json, out=args.out)


def add_bench_subparser(subparsers: Any) -> Any:
    """Add ``bench`` to the ``fastdata`` command's subparsers."""
    from fastdata.cli._args import (
        nonempty_path,
        nonneg_int,
        output_file,
        positive_int,
        work_folder,
    )

    p = subparsers.add_parser(
        "bench", help="measure raw reads, the decode pipeline, the cache and H2D copies on your shards",
        description="Measure raw shard reads, the decode + resize pipeline, the cached pipeline and (with CUDA) "
                    "host-to-device copies. With SHARDS, on the first --samples samples of your shards; without, "
                    "on a generated set of --images photo-like JPEGs.")
    p.add_argument("shards", nargs="?", metavar="SHARDS", default=None, type=nonempty_path,
                   help="shard folder with manifest.json (default: generate --images JPEGs)")
    p.add_argument("--samples", type=positive_int, default=2048, metavar="N",
                   help="samples of SHARDS to measure (default: 2048)")
    p.add_argument("--images", type=positive_int, default=1024, metavar="N",
                   help="images to generate when no SHARDS are given (default: 1024)")
    p.add_argument("--dir", type=work_folder, default=None, metavar="DIR", help="working folder: a new or empty one, or one an earlier bench or demo "
                   "used (default: a temporary one, deleted afterwards)")
    p.add_argument("--workers", type=nonneg_int, default=2, metavar="N", help="DataLoader workers (default: 2)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N", help="timed passes, median (default: 3)")
    p.add_argument("--size", type=positive_int, default=IMAGE_SIZE, metavar="PX",
                   help=f"ResizeCenterCrop output side (default: {IMAGE_SIZE})")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table (default: off)")
    p.add_argument("--out", type=output_file, default=None, metavar="PATH", help="also write the JSON results to PATH (default: none)")
    p.set_defaults(func=_cmd_bench)
    return p
