"""tools/shard.py's engine on a JPEG folder: pass-through vs a plain webdataset loop, and --resize scaling.

Data: ``fastdata.cli._synth.make_image_folder`` (photo-like JPEGs, 300-640 px, quality 75-95, 10
classes), cached under ``.bench/`` and read once before timing so every run reads from the page
cache. Measured in the same run, median over ``--reps`` repetitions (order alternated), each into
a fresh output folder:

- ``fastdata_passthrough_w1`` / ``_wN``: ``fastdata.shards.convert.convert`` (planning, header
  check of every image with ``Image.open`` + ``verify``, tar shards of 256 MiB with sidecar
  indexes and sha256, manifest), with 1 and N worker processes;
- ``webdataset_shardwriter``: the plain loop people write: for every file in sorted order, read
  its bytes and ``webdataset.ShardWriter(maxsize=256 MiB).write({"__key__", "jpg", "cls"})``;
- ``fastdata_resize224_w1`` / ``_w2``: ``--resize 224`` (decode, draft, crop-box resize, uint8 CHW
  ``img.npy``) with 1 and 2 workers; shards of 500 samples so both workers have work.

Targets (issue 2): pass-through not slower than the webdataset loop; --resize scales with workers.

    python benchmarks/shard_convert.py --quick --json /tmp/shard_convert.json
    python benchmarks/shard_convert.py --images 4000 --reps 3
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdata.cli._synth import make_image_folder  # noqa: E402
from fastdata.shards.convert import ConvertOptions, convert, default_workers  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]


def image_folder(n: int) -> Path:
    folder = _ROOT / ".bench" / f"jpeg-folder-{n}"
    done = folder / ".complete"
    if not done.exists():
        make_image_folder(folder, n)
        done.write_text("ok")
    return folder


def files_of(folder: Path) -> list[tuple[str, Path, int]]:
    """(key, path, class index) in sorted order, like tools/shard.py lists them."""
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    out = []
    for cls, name in enumerate(classes):
        for path in sorted((folder / name).iterdir()):
            out.append((f"{name}/{path.stem}", path, cls))
    return out


def warm(files: list[tuple[str, Path, int]]) -> int:
    return sum(len(p.read_bytes()) for _, p, _ in files)


def run_webdataset(files: list[tuple[str, Path, int]], dest: Path) -> None:
    import webdataset as wds

    with wds.ShardWriter(str(dest / "shard-%06d.tar"), maxsize=256 << 20, maxcount=10**9, verbose=0) as sink:
        for key, path, cls in files:
            with open(path, "rb") as f:
                sink.write({"__key__": key, "jpg": f.read(), "cls": cls})


def run_fastdata(src: Path, dest: Path, **options: Any) -> None:
    convert(src, dest, ConvertOptions(progress=False, **options))


def measure(cases: dict[str, Callable[[Path], None]], reps: int, scratch: Path) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            dest = scratch / f"{name}-{rep}"
            dest.mkdir()
            t0 = time.perf_counter()
            cases[name](dest)
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(dest)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000, help="JPEGs in the folder (default 2000)")
    p.add_argument("--resize-images", type=int, default=1000, help="JPEGs used for the --resize runs")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1000 images (200 resized), 3 repetitions (about 15 s once the images exist)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.resize_images, args.reps = 1000, 200, 3
    import webdataset  # noqa: F401 - imported before timing (it imports torch: seconds)

    src = image_folder(args.images)
    files = files_of(src)
    total_bytes = warm(files)
    resize_src = image_folder(args.resize_images)
    warm(files_of(resize_src))
    cpus = default_workers()
    per_cpu = len(files) // cpus + 1  # one shard per worker
    resize = {"resize": 224, "samples_per_shard": max(1, args.resize_images // 4)}
    cases: dict[str, Callable[[Path], None]] = {
        "webdataset_shardwriter": lambda d: run_webdataset(files, d),
        "fastdata_passthrough_w1": lambda d: run_fastdata(src, d, workers=1),
        f"fastdata_passthrough_w{cpus}": lambda d: run_fastdata(src, d, workers=cpus, samples_per_shard=per_cpu),
        "fastdata_resize224_w1": lambda d: run_fastdata(resize_src, d, workers=1, **resize),
        "fastdata_resize224_w2": lambda d: run_fastdata(resize_src, d, workers=2, **resize),
    }
    with tempfile.TemporaryDirectory(dir=_ROOT / ".bench") as tmp:
        times = measure(cases, args.reps, Path(tmp))
    results: dict[str, Any] = {}
    for name, ts in times.items():
        n = args.resize_images if "resize" in name else len(files)
        med = statistics.median(ts)
        results[name] = {"images": n, "median_s": round(med, 4), "images_per_s": round(n / med, 1),
                         "runs_s": [round(t, 4) for t in ts]}
        if "resize" not in name:
            results[name]["MB_per_s"] = round(total_bytes / med / 1e6, 1)
    wds_rate = results["webdataset_shardwriter"]["images_per_s"]
    summary = {
        "passthrough_w1_vs_webdataset": round(results["fastdata_passthrough_w1"]["images_per_s"] / wds_rate, 2),
        "resize224_w2_vs_w1": round(results["fastdata_resize224_w2"]["images_per_s"]
                                    / results["fastdata_resize224_w1"]["images_per_s"], 2),
    }
    report = {"benchmark": "shard_convert", "quick": args.quick, "reps": args.reps, "cpus": cpus,
              "folder_MB": round(total_bytes / 1e6, 1), "python": platform.python_version(),
              "machine": platform.machine(), "results": results, "summary": summary}
    for name, r in results.items():
        extra = f"  {r['MB_per_s']:7.1f} MB/s" if "MB_per_s" in r else ""
        print(f"{name:30s} {r['images_per_s']:9.1f} images/s{extra}  (median of {len(r['runs_s'])})")
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
