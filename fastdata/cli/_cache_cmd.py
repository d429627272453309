"""``fastdata cache list|rm|build``: housekeeping and ahead-of-time filling of a cache directory."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any

from fastdata.cli._args import (
    byte_size,
    nonempty_path,
    nonempty_text,
    nonneg_int,
    positive_int,
)
from fastdata.errors import CacheError


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


def _cache(args: argparse.Namespace) -> Any:
    from fastdata.io import local_path
    from fastdata.cache import Cache

    return Cache(local_path(args.cache), max_bytes=getattr(args, "max_bytes", None))  # ~ and file:// read


def _store_json(i: Any) -> dict[str, Any]:
    import numpy as np

    return {"key": i.key, "fingerprint": i.fingerprint, "path": str(i.path), "format_version": i.format_version,
            "num_samples": i.num_samples, "num_valid": i.num_valid, "fill_ratio": i.fill_ratio,
            "size_bytes": i.size_bytes, "sample_nbytes": i.sample_nbytes, "last_used": i.last_used,
            "in_use": i.in_use, "problem": i.problem,
            "fields": None if i.fields is None else [
                {"name": f.name, "dtype": np.dtype(f.dtype).name, "shape": list(f.shape)} for f in i.fields]}


def cmd_list(args: argparse.Namespace) -> int:
    import numpy as np

    cache = _cache(args)
    infos = cache.list()
    if args.json:  # one object per store; sizes in bytes, times in seconds since the epoch
        print(json.dumps([_store_json(i) for i in infos], indent=1))
        return 0
    if not infos:
        print(f"no stores in {args.cache}" + ("" if cache.directory.exists() else " (no such directory)"))
        return 0
    now = time.time()
    print(f"{'FINGERPRINT':<24} {'SAMPLES':>9} {'FILLED':>7} {'SIZE':>10} {'PER SAMPLE':>11} "
          f"{'LAST USED':>10}  {'OPEN':<4} KEY")
    for i in infos:
        print(f"{i.fingerprint[:24]:<24} {i.num_samples:>9d} {i.fill_ratio:>7.1%} {human_bytes(i.size_bytes):>10} "
              f"{human_bytes(i.sample_nbytes):>11} {_age(now - i.last_used):>10}  {'yes' if i.in_use else 'no':<4} "
              f"{i.key}")
        if i.problem is not None:
            print(f"    DAMAGED     {i.problem}")
        if args.long:
            print(f"    fingerprint {i.fingerprint}")
            print(f"    path        {i.path}")
            for f in i.fields or ():
                print(f"    field       {f.name} {np.dtype(f.dtype).name} {tuple(f.shape)}")
    total = sum(i.size_bytes for i in infos)
    damaged = sum(i.problem is not None for i in infos)
    print(f"{len(infos)} store(s), {human_bytes(total)} in {args.cache}"
          + (f"; {damaged} damaged (remove with `fastdata cache rm KEY`)" if damaged else ""))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    for info in _cache(args).remove(args.fingerprint):
        print(f"removed {info.key} ({info.fingerprint[:24]}, {human_bytes(info.size_bytes)})")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from fastdata.dataset import ShardedDataset
    from fastdata.transforms import ResizeCenterCrop

    from fastdata.decode import is_image_field
    from fastdata.io import redact_url

    preprocess = ResizeCenterCrop(args.size, resize=args.resize, interpolation=args.interpolation)
    dataset = ShardedDataset(args.source, preprocess=preprocess, cache=_cache(args), rank=0, world_size=1)
    fields = list(dataset.source.fields)
    if not any(is_image_field(f) for f in fields):  # the store would hold nothing: say so rather than exit 1
        raise ValueError(f"{redact_url(args.source)}: no image field among {fields}: nothing for ResizeCenterCrop "
                         "to cache")
    _check_store_fits(args, dataset, preprocess)  # before any worker or store exists
    info = dataset.build_cache(num_workers=args.workers, progress=not args.quiet)  # stops its workers on errors
    print(f"{info.key}: {info.num_valid}/{info.num_samples} samples ({info.fill_ratio:.1%}), "
          f"{human_bytes(info.size_bytes)} on disk, {human_bytes(info.sample_nbytes)} per sample")
    if info.num_valid != info.num_samples:
        raise CacheError(f"{redact_url(args.source)}: {info.num_samples - info.num_valid} of {info.num_samples} "
                         f"samples were not filled into store {info.key}")
    return 0


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not on Linux/macOS
        return None


def _check_store_fits(args: argparse.Namespace, dataset: Any, preprocess: Any) -> None:
    """Refuse up front what cannot work: a crop no worker can hold in memory (``--size 100000``: 30 GB per
    image; the worker was killed), or a store larger than ``--max-bytes`` or the free disk."""
    from fastdata.cache import Cache

    h, w = preprocess.size
    per_image = 3 * h * w  # RGB uint8: the store holds at least one image per sample
    what = f"--size {args.size}: one image is 3x{h}x{w} uint8 = {human_bytes(per_image)}"
    memory = _memory_bytes()
    if memory is not None and 2 * per_image > memory:  # the resized PIL image and its array
        raise ValueError(f"{what}; a worker holds at least two copies of it, more than this machine's memory "
                         f"({human_bytes(memory)})")
    n = dataset.num_samples
    if n is None:
        return
    need = n * (per_image + 1)  # and one valid byte per sample
    sizing = f"a store of at least {need} bytes ({human_bytes(need)}: {n} samples x {human_bytes(per_image)})"
    if args.max_bytes is not None and need > args.max_bytes:
        raise CacheError(f"cache directory {args.cache}: {sizing} does not fit in --max-bytes {args.max_bytes}")
    folder = Cache(args.cache).directory
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    held = Cache(args.cache).total_bytes()  # an existing store of this data set needs no new space
    if need > free + held:
        raise CacheError(f"cache directory {args.cache}: {sizing} does not fit on its disk "
                         f"({human_bytes(free)} free)")


def add_cache_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``cache`` with ``list``, ``rm`` and ``build`` to the ``fastdata`` command's subparsers.

    Each leaf sets ``func`` to a handler ``(args) -> exit status``.
    """
    cache = subparsers.add_parser("cache", help="list, remove or fill preprocessing cache stores")
    sub = cache.add_subparsers(dest="cache_command", required=True, metavar="{list,rm,build}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cache", required=True, metavar="DIR", help="cache directory (required)")

    ls = sub.add_parser("list", help="list stores with size, fill ratio and fingerprint")
    common(ls)
    ls.add_argument("-l", "--long", action="store_true",
                    help="also full fingerprint, path and fields (default: off)")
    ls.add_argument("--json", action="store_true",
                    help="print the stores as a JSON list instead of a table (default: off)")
    ls.set_defaults(func=cmd_list)

    rm = sub.add_parser("rm", help="remove the stores whose fingerprint (or key) starts with FINGERPRINT")
    rm.add_argument("fingerprint", metavar="FINGERPRINT", type=nonempty_text, help="fingerprint or key prefix, as `cache list` shows it")
    common(rm)
    rm.set_defaults(func=cmd_rm)

    build = sub.add_parser(
        "build", help="fill the cache for SOURCE ahead of time (decode, resize, centre crop)",
        description="Fill the store that ShardedDataset(SOURCE, preprocess=ResizeCenterCrop(SIZE, resize=RESIZE, "
                    "interpolation=...), cache=DIR) reads, by iterating SOURCE once.")
    build.add_argument("source", metavar="SOURCE", type=nonempty_path, help="shard folder with manifest.json")
    common(build)
    build.add_argument("--size", type=positive_int, default=224,
                       help="output side of the centre crop in pixels (default: 224)")
    build.add_argument("--resize", type=positive_int, default=None,
                       help="shorter side before cropping (default: SIZE * 256 / 224, i.e. 256 for 224)")
    build.add_argument("--interpolation", default="bilinear", choices=("bilinear", "bicubic", "lanczos", "nearest"),
                       help="resampling filter (default: bilinear)")
    build.add_argument("--workers", type=nonneg_int, default=2,
                       help="DataLoader worker processes, 0 = in process (default: 2)")
    build.add_argument("--max-bytes", type=byte_size, default=None, metavar="SIZE",
                       help="size limit of the cache directory (e.g. 50GB); least recently used stores are evicted "
                            "(default: no limit)")
    build.add_argument("-q", "--quiet", action="store_true", help="no progress bar (default: off)")
    build.set_defaults(func=cmd_build)
    return cache
