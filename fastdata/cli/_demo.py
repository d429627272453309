"""``fastdata demo`` (the README's main job) and ``fastdata bench`` (a quick self-measurement).

The demo runs the whole path of a sample on generated data: photo-like JPEGs -> shards
(``tools/shard.py``'s engine, verified) -> ShardedDataset with a preprocessing cache ->
fastdata.DataLoader -> CUDAPrefetcher with device-side normalisation -> TrainStep, watched by a
StallMeter. It prints one line per epoch and ends with the stall verdict.
"""
from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fastdata")

IMAGE_SIZE = 224


@contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path is not None:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    with tempfile.TemporaryDirectory(prefix="fastdata-demo-") as tmp:
        yield Path(tmp)


def _make_shards(root: Path, num_images: int, workers: int, labels: tuple[str, str] = ("[1/4]", "[2/4]"),
                 ) -> tuple[Path, Any]:
    from fastdata.cli._synth import make_image_folder
    from fastdata.shards.convert import ConvertOptions, convert
    from fastdata.shards.reader import verify

    images = root / "images"
    t0 = time.perf_counter()
    make_image_folder(images, num_images, num_classes=10, seed=0)
    print(f"{labels[0]} {num_images} photo-like JPEGs (300-640 px, 10 classes) in {images} "
          f"({time.perf_counter() - t0:.1f} s)")
    shards = root / "shards"
    opts = ConvertOptions(samples_per_shard=max(64, num_images // 8), workers=max(1, workers),
                          overwrite=True, progress=False)
    result = convert(images, shards, opts)
    m = result.manifest
    problems = verify(shards)
    if problems:
        raise RuntimeError("verification failed: " + "; ".join(problems))
    size = sum(s.bytes for s in m.shards)
    print(f"{labels[1]} {m.num_samples} samples -> {len(m.shards)} tar shards, {size / 1e6:.1f} MB in {shards} "
          f"({result.seconds:.1f} s, {m.num_samples / result.seconds:.0f} samples/s), checksums verified")
    return shards, m


def _model(num_classes: int) -> torch.nn.Module:
    # Small on purpose: the demo is about the input pipeline, and it must run on a laptop CPU.
    return torch.nn.Sequential(
        torch.nn.AvgPool2d(4),
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, num_classes),
    )


def run_demo(*, workdir: str | None, num_images: int, num_workers: int, epochs: int, batch_size: int) -> int:
    """Generate, shard, cache and train; print per-epoch throughput and the stall verdict."""
    from fastdata.dataset import ShardedDataset
    from fastdata.gpu import Normalize
    from fastdata.loader import DataLoader
    from fastdata.monitor import StallMeter
    from fastdata.prefetch import CUDAPrefetcher
    from fastdata.train import TrainStep
    from fastdata.transforms import ResizeCenterCrop

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with _workdir(workdir) as root:
        shards, manifest = _make_shards(root, num_images, num_workers)
        ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"],
                            preprocess=ResizeCenterCrop(IMAGE_SIZE), cache=root / "cache")
        loader = DataLoader(ds, batch_size=batch_size, num_workers=num_workers,
                            persistent_workers=num_workers > 0, drop_last=True)
        batches = CUDAPrefetcher(loader, device=device, depth=2,
                                 transform=Normalize(keys=["jpg"], channels_last=device.type == "cuda"))
        model = _model(10).to(device)
        if device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                         torch.nn.functional.cross_entropy, input_key="jpg", target_key="cls")
        print(f"[3/4] training on {device} ({step.precision}): ShardedDataset(preprocess=ResizeCenterCrop"
              f"({IMAGE_SIZE}), cache) -> DataLoader(workers={num_workers}, batch={batch_size}) -> "
              f"CUDAPrefetcher(Normalize) -> TrainStep")
        print(f"      {'epoch':>5} {'images/s':>9} {'input wait':>10} {'loss':>7}  note")
        with batches:
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                meter = StallMeter(sample_gpu=device.type == "cuda")
                t0 = time.perf_counter()
                losses, seen = [], 0
                for batch in meter.wrap(batches):
                    losses.append(step(batch))
                    seen += int(batch["cls"].shape[0])
                mean_loss = torch.stack(losses).mean().item()  # the epoch's only sync
                dt = time.perf_counter() - t0
                note = ("read from the cache (in-process fast path)" if loader.last_path == "cached"
                        else "decode + resize in the workers, filling the cache")
                print(f"      {epoch + 1:>5} {seen / dt:>9.0f} {meter.report().wait_share:>10.0%} "
                      f"{mean_loss:>7.3f}  {note}")
        rep = meter.report()
        stats = batches.stats()
        moved = f"{stats['bytes'] / 1e6:.0f} MB copied to the GPU as uint8, " if device.type == "cuda" else ""
        print(f"[4/4] prefetcher: {stats['batches']} batches, {moved}"
              f"consumer wait p50 {stats['wait_p50_s'] * 1e3:.2f} ms / p99 {stats['wait_p99_s'] * 1e3:.2f} ms")
        print("      last epoch: " + rep.summary().replace("\n", "\n      "))
    return 0


def _timed_epochs(make_iter: Any, repeats: int) -> list[float]:
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


def run_bench(*, workdir: str | None, num_images: int, num_workers: int, repeats: int,
              json_path: str | None) -> int:
    """Measure raw shard reads, the decode pipeline, the cached pipeline and (with CUDA) H2D copies."""
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.manifest import Manifest
    from fastdata.shards.reader import open_shard
    from fastdata.transforms import ResizeCenterCrop

    results: dict[str, Any] = {"images": num_images, "workers": num_workers, "repeats": repeats,
                               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    with _workdir(workdir) as root:
        shards, manifest = _make_shards(root, num_images, num_workers, labels=("data:", "shards:"))
        m = Manifest.load(shards)
        readers = [open_shard(shards, s, format=m.format) for s in m.shards]
        nbytes = sum(s.bytes for s in m.shards)

        def raw() -> Iterator[Any]:
            for r in readers:
                yield from r.iter_range(0, len(r))

        t_raw = statistics.median(_timed_epochs(raw, repeats))
        results["raw_read"] = {"GB/s": nbytes / t_raw / 1e9, "samples/s": m.num_samples / t_raw}

        def pipeline(cache: Path | None) -> Any:
            ds = ShardedDataset(shards, fields=["jpg", "cls"], preprocess=ResizeCenterCrop(IMAGE_SIZE), cache=cache)
            loader = DataLoader(ds, batch_size=64, num_workers=num_workers, persistent_workers=num_workers > 0)
            return lambda: iter(loader)

        t_dec = statistics.median(_timed_epochs(pipeline(None), repeats))
        results["decode_pipeline"] = {"images/s": m.num_samples / t_dec}
        t_cached = statistics.median(_timed_epochs(pipeline(root / "cache"), repeats))
        results["cached_pipeline"] = {"images/s": m.num_samples / t_cached, "speedup": t_dec / t_cached}
        if torch.cuda.is_available():
            from fastdata.cli._doctor import measure_h2d

            # one uint8 batch of 256 images
            rates = measure_h2d(256 * 3 * IMAGE_SIZE * IMAGE_SIZE, repeats=max(repeats, 5))
            results["h2d"] = {f"{k}_GB/s": v for k, v in rates.items()}
    print(f"{'measurement':<18} result")
    print(f"{'raw shard read':<18} {results['raw_read']['GB/s']:.2f} GB/s, {results['raw_read']['samples/s']:.0f} samples/s")
    print(f"{'decode pipeline':<18} {results['decode_pipeline']['images/s']:.0f} images/s "
          f"(JPEG decode + resize {IMAGE_SIZE}, {num_workers} workers)")
    print(f"{'cached pipeline':<18} {results['cached_pipeline']['images/s']:.0f} images/s "
          f"({results['cached_pipeline']['speedup']:.1f}x the decode pipeline)")
    if "h2d" in results:
        h = results["h2d"]
        print(f"{'host-to-device':<18} pinned {h['pinned_GB/s']:.1f} GB/s, pageable {h['pageable_GB/s']:.1f} GB/s")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return 0
