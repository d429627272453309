"""Loader throughput: fastdata vs webdataset vs an ImageFolder-style Dataset, same work, one run.

Corpus: photo-like JPEGs of 300-640 px per side (``fastdata.cli._synth.make_image_folder``), written
once as pass-through tar shards (jpg + cls) with ``ShardWriter`` and cached under ``--data``.
Every pipeline produces batches of 64 (uint8 image tensor (64, 3, 224, 224), int labels) with
the same work per image (decode, resize shorter side to 256, centre crop 224) and the same
number of DataLoader workers:

- ``imagefolder``: map-style Dataset over the JPEG files, the usual recipe (``Image.open``,
  ``convert("RGB")``, resize 256, centre crop 224, to tensor), ``torch.utils.data.DataLoader``
  with ``shuffle=True``;
- ``webdataset``: ``wds.WebDataset(shards, shardshuffle=...).shuffle(1000).decode("pil")``, the
  same map, ``wds.WebLoader``;
- ``fastdata``: ``ShardedDataset(shards, shuffle=True, preprocess=ResizeCenterCrop(224))`` and
  ``fastdata.DataLoader`` (mmap random access; decode at reduced DCT scale when the JPEG is at
  least twice the target; resample only the crop box).

Each epoch is timed end to end (worker start included, as in training); one warm-up epoch per
pipeline, then ``--reps`` epochs per pipeline, interleaved, medians reported.

    python benchmarks/loader_throughput.py --quick --json /tmp/loader.json
    python benchmarks/loader_throughput.py --images 3000 --workers 2 --json /tmp/loader.json
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
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdata.loader  # noqa: E402
from fastdata.cli._synth import make_image_folder  # noqa: E402
from fastdata.dataset import ShardedDataset  # noqa: E402
from fastdata.manifest import Manifest  # noqa: E402
from fastdata.shards.writer import ShardWriter  # noqa: E402
from fastdata.transforms import ResizeCenterCrop  # noqa: E402

SIZE, RESIZE = 224, 256


def recipe(img: Image.Image) -> torch.Tensor:
    """The typical torchvision-style recipe: resize shorter side to 256, centre crop 224, to tensor."""
    img = img.convert("RGB")
    w, h = img.size
    nw, nh = (RESIZE, int(RESIZE * h / w)) if w <= h else (int(RESIZE * w / h), RESIZE)
    img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = int(round((nw - SIZE) / 2)), int(round((nh - SIZE) / 2))
    img = img.crop((left, top, left + SIZE, top + SIZE))
    return torch.as_tensor(np.array(img, copy=True)).permute(2, 0, 1)  # like torchvision's PILToTensor


class ImageFolderDataset(torch.utils.data.Dataset):
    def __init__(self, files: list[tuple[Path, int]]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[i]
        with Image.open(path) as img:
            return recipe(img), label


def _to_tuple(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return sample["jpg"], sample["cls"]


def prepare(data: Path, n: int, shards: int) -> tuple[list[tuple[Path, int]], list[str], Path]:
    folder = make_image_folder(data / "images", n)
    files = sorted(folder.glob("class_*/img_*.jpg"))[:n]
    files = [f for f in files if int(f.stem.split("_")[1]) < n]
    labelled = [(f, int(f.parent.name.split("_")[1])) for f in files]
    dest = data / f"shards-{n}-{shards}"
    try:
        ok = Manifest.load(dest).num_samples == n
    except Exception:  # noqa: BLE001 - missing or stale: rebuild
        ok = False
    if not ok:
        per_shard = -(-n // shards)
        with ShardWriter(dest, max_samples=per_shard, overwrite=True) as w:
            for f, label in labelled:
                w.write({"__key__": f"{f.parent.name}/{f.stem}", "jpg": f.read_bytes(), "cls": label})
    urls = [str(dest / s.name) for s in Manifest.load(dest).shards]
    return labelled, urls, dest


def make_loaders(files, urls, shard_dir, workers: int, batch: int) -> dict[str, Any]:
    import webdataset as wds

    def imagefolder():
        return torch.utils.data.DataLoader(ImageFolderDataset(files), batch_size=batch, shuffle=True,
                                           num_workers=workers)

    def webdataset():
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000).decode("pil")
              .to_tuple("jpg", "cls").map_tuple(recipe, lambda c: c).batched(batch, partial=True))
        return wds.WebLoader(ds, batch_size=None, num_workers=workers)

    def fast():
        ds = ShardedDataset(shard_dir, shuffle=True, preprocess=ResizeCenterCrop(SIZE, resize=RESIZE),
                            sample_transform=_to_tuple)
        return fastdata.loader.DataLoader(ds, batch_size=batch, num_workers=workers)

    return {"imagefolder": imagefolder, "webdataset": webdataset, "fastdata": fast}


def run_epoch(make, epoch: int) -> tuple[int, float]:
    loader = make()
    if isinstance(getattr(loader, "dataset", None), ShardedDataset):
        loader.dataset.set_epoch(epoch)
    t0 = time.perf_counter()
    n = 0
    for images, labels in loader:
        assert images.shape[1:] == (3, SIZE, SIZE) and images.dtype == torch.uint8
        n += len(labels)
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small corpus, one repetition (a few seconds)")
    ap.add_argument("--images", type=int, default=None, help="corpus size (default 2000, quick 256)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--shards", type=int, default=8, help="number of tar shards (>= workers for webdataset)")
    ap.add_argument("--reps", type=int, default=None, help="timed epochs per pipeline (default 3, quick 1)")
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "fastdata-bench-loader")
    ap.add_argument("--only", nargs="*", default=None, help="subset of: imagefolder webdataset fastdata")
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    args = ap.parse_args(argv)
    n = args.images or (256 if args.quick else 2000)
    reps = args.reps or (1 if args.quick else 3)

    files, urls, shard_dir = prepare(args.data, n, args.shards)
    loaders = make_loaders(files, urls, shard_dir, args.workers, args.batch_size)
    names = args.only or list(loaders)
    runs: dict[str, list[float]] = {k: [] for k in names}
    for k in names:  # warm-up: page cache, imports, first fork
        run_epoch(loaders[k], 0)
    for rep in range(reps):
        for k in names:
            count, secs = run_epoch(loaders[k], rep + 1)
            if count != n:
                raise RuntimeError(f"{k} yielded {count} images, expected {n}")
            runs[k].append(count / secs)
            print(f"rep {rep + 1}/{reps} {k:12s} {count / secs:8.1f} images/s", file=sys.stderr)
    results = {k: {"images_per_s": statistics.median(v), "runs": v} for k, v in runs.items()}
    out: dict[str, Any] = {
        "benchmark": "loader_throughput",
        "config": {"images": n, "workers": args.workers, "batch_size": args.batch_size, "shards": len(urls),
                   "reps": reps, "size": SIZE, "resize": RESIZE, "quick": args.quick},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "pillow": Image.__version__, "load_avg": os.getloadavg()},
        "results": results,
        "targets": {"fastdata/webdataset": 1.3, "fastdata/imagefolder": 1.0},
    }
    ratios = {}
    if "fastdata" in results:
        for other in ("webdataset", "imagefolder"):
            if other in results:
                ratios[f"fastdata/{other}"] = results["fastdata"]["images_per_s"] / results[other]["images_per_s"]
    out["ratios"] = ratios
    for k, v in results.items():
        print(f"{k:12s} {v['images_per_s']:8.1f} images/s (median of {len(v['runs'])})")
    for k, v in ratios.items():
        print(f"{k:24s} {v:5.2f}x (target >= {out['targets'][k]})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
