"""``fastdata demo``: the before and after, on the same generated data and the same model.

Generates photo-like JPEGs (``_synth``), shards and verifies them, then trains the same model with
the same :class:`fastdata.TrainStep` from each input pipeline: a tuned torch DataLoader, fastdata
uncached, fastdata cached and, where the device decode path runs, fastdata with GPU decode. Each
pipeline's first epoch is a warm-up reported on its own; images/s, input wait
(:class:`fastdata.StallMeter`) and GPU utilisation are over the later epochs. Prints one table with
the speed-up against the tuned DataLoader; with ``json_path`` also writes the rows, settings,
machine and every step's input wait as JSON (for ``benchmarks/plot.py``).

The pipelines and what each measures: docs/design/demo.md.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when the demo runs, so that `fastdata --help` stays fast
    import torch

IMAGE_SIZE = 224
RESIZE = 256
NUM_CLASSES = 10
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MODELS = ("auto", "small", "resnet18", "resnet50")


def default_workers() -> int:
    """One DataLoader worker per available core, at most 8 (the demo's default)."""
    from fastdata._util import usable_cores

    return max(1, min(8, usable_cores()))


WORKDIR_MARK = ".fastdata-workdir"  # in a --dir that demo/bench made: theirs to replace parts of


def claim_workdir(root: Path, command: str) -> Path:
    """``root`` (created) as the ``--dir`` of ``command``, which replaces its ``images``, ``shards``,
    ``subset`` and ``cache``: refused (:class:`~fastdata.errors.FastdataError`) when it already holds
    other files that no demo or bench put there, e.g. a user's own ``shards`` or ``cache``."""
    if root.is_dir() and not (root / WORKDIR_MARK).exists():
        held = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        if held and not _made_before_marks(root, held):
            from fastdata.errors import FastdataError

            raise FastdataError(
                f"--dir {root}: holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}, which fastdata "
                f"{command} did not write; it replaces {root}/images, shards, subset and cache: choose an empty "
                "or new folder")
    root.mkdir(parents=True, exist_ok=True)
    (root / WORKDIR_MARK).touch()
    return root


def _made_before_marks(root: Path, held: list[str]) -> bool:
    """Whether ``root`` is a demo's or bench's --dir from before the mark: only their folders, and
    ``shards`` converted from ``root/images`` (whose generated files ``make_image_folder`` checks)."""
    if not set(held) <= {"images", "shards", "subset", "cache"} or "images" not in held:
        return False
    try:
        text = (root / "shards" / "manifest.json").read_text(encoding="utf-8")
        source = json.loads(text)["extra"]["source"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(source, str) and os.path.realpath(source) == os.path.realpath(root / "images")


@contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path is not None:
        yield claim_workdir(Path(path), "demo")
        return
    with tempfile.TemporaryDirectory(prefix="fastdata-demo-") as tmp:
        yield Path(tmp)


class _Progress:
    """``label: done/total`` on one rewritten line on a terminal; a line per quarter otherwise."""

    def __init__(self, label: str) -> None:
        self.label, self.tty, self.next_quarter, self.t0 = label, sys.stdout.isatty(), 1, time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            end = "\n" if done >= total else ""
            print(f"\r{self.label}: {done}/{total} ({time.perf_counter() - self.t0:.1f} s)", end=end, flush=True)
        elif done * 4 >= self.next_quarter * total:
            while done * 4 >= self.next_quarter * total:
                self.next_quarter += 1
            print(f"{self.label}: {done}/{total} ({time.perf_counter() - self.t0:.1f} s)", flush=True)


def _make_shards(root: Path, num_images: int, workers: int, labels: tuple[str, str] = ("[1/4]", "[2/4]"),
                 *, show_paths: bool = True) -> tuple[Path, Any]:
    """Generate ``num_images`` JPEGs under ``root/images`` and shard them into ``root/shards`` (verified)."""
    from fastdata.cli._synth import make_image_folder
    from fastdata.shards.convert import ConvertOptions, convert
    from fastdata.shards.reader import verify

    images = root / "images"
    where = f" in {images}" if show_paths else ""
    make_image_folder(images, num_images, num_classes=NUM_CLASSES, seed=0, workers=max(1, workers),
                      progress=_Progress(f"{labels[0]} generating photo-like JPEGs (300-640 px, "
                                         f"{NUM_CLASSES} classes){where}"))
    shards = root / "shards"
    opts = ConvertOptions(samples_per_shard=max(64, num_images // 8), workers=max(1, workers),
                          overwrite=True, progress=False)
    result = convert(images, shards, opts)
    m = result.manifest
    problems = verify(shards)
    if problems:
        raise RuntimeError("verification failed: " + "; ".join(problems))
    size = sum(s.bytes for s in m.shards)
    where = f" in {shards}" if show_paths else ""
    print(f"{labels[1]} {m.num_samples} samples -> {len(m.shards)} tar shards, {size / 1e6:.1f} MB{where} "
          f"({result.seconds:.1f} s, {m.num_samples / result.seconds:.0f} samples/s), checksums verified")
    return shards, m


# ----- the model ------------------------------------------------------------------------------------
def _small_model() -> torch.nn.Module:
    """A small CNN on every 8th pixel of the 224 px input (28 x 28): cheap enough on a laptop CPU that
    the demo measures the input pipelines, not the model."""
    import torch

    class Subsample(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[..., ::8, ::8]

    return torch.nn.Sequential(
        Subsample(),
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, NUM_CLASSES),
    )


def _torchvision_model(name: str) -> torch.nn.Module | str:
    """The torchvision model, or why torchvision cannot give it here."""
    try:
        import torchvision.models
    except ImportError:
        return ("torchvision is not installed (its models only: pip install \"fastdata[models]\", which takes the "
                "torchvision release paired with your torch)")
    except Exception as e:  # noqa: BLE001  installed but built for another torch: the import raises RuntimeError
        return f"torchvision does not import here ({type(e).__name__}: {e})"
    return getattr(torchvision.models, name)(num_classes=NUM_CLASSES)


def build_model(name: str, device: torch.device) -> tuple[str, torch.nn.Module]:
    """``auto``: torchvision's resnet18 on CUDA (the small CNN without torchvision), the small CNN on the CPU."""
    import torch

    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if name == "auto":
        name = "resnet18" if device.type == "cuda" else "small"
        if name == "resnet18" and isinstance(_torchvision_model(name), str):
            name = "small"
    torch.manual_seed(0)
    model = _small_model() if name == "small" else _torchvision_model(name)
    if isinstance(model, str):
        raise ValueError(f"--model {name}: {model}")
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return name, model


# ----- the "before": the tuned torch.utils.data.DataLoader recipe --------------------------------------
class ImageFolderRecipe:
    """``ImageFolder`` + ``Resize(256), CenterCrop(224), ToTensor(), Normalize(mean, std)`` in plain PIL/torch.

    The same operations, in the same order and with the same resampling, as torchvision's classic
    transforms, written out so the demo does not depend on torchvision. A map-style dataset.
    """

    def __init__(self, root: Path) -> None:
        import torch

        # hidden entries (.DS_Store) are skipped, as `fastdata shard` skips them
        classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        self.items = [(str(f), i) for i, c in enumerate(classes) for f in sorted((root / c).iterdir())
                      if not f.name.startswith(".")]
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import numpy as np
        import torch
        from PIL import Image

        path, cls = self.items[i]
        with Image.open(path) as f:
            img = f.convert("RGB")
        w, h = img.size
        nw, nh = (RESIZE, int(RESIZE * h / w)) if w <= h else (int(RESIZE * w / h), RESIZE)
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = round((nw - IMAGE_SIZE) / 2), round((nh - IMAGE_SIZE) / 2)
        img = img.crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))
        x = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).float().div_(255)
        return x.sub_(self.mean).div_(self.std), cls


def _tuned_torch_loader(images: Path, batch_size: int, workers: int, device: torch.device) -> Iterable[Any]:
    import torch

    loader = torch.utils.data.DataLoader(
        ImageFolderRecipe(images), batch_size=batch_size, shuffle=True, drop_last=True,
        num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format

    class _ToDevice:
        def __len__(self) -> int:
            return len(loader)

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for x, y in loader:
                yield (x.to(device, non_blocking=True, memory_format=fmt), y.to(device, non_blocking=True))

    return _ToDevice()


# ----- running one pipeline -------------------------------------------------------------------------------
@dataclass
class Row:
    """One pipeline's result."""

    pipeline: str
    recipe: str
    first_epoch_s: float | None  # the warm-up epoch's seconds; None with one epoch (no warm-up)
    images_per_s: float
    wait_share: float
    gpu_util: float | None
    final_loss: float
    loader_bound: bool
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, wait s) per step
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _train(name: str, recipe: str, batches: Iterable[Any], make_step: Callable[[], Any], epochs: int,
           device: torch.device, set_epoch: Callable[[int], None] | None = None) -> Row:
    import torch

    from fastdata.monitor import LOADER_BOUND_SHARE, StallMeter

    step = make_step()
    meter = StallMeter(sample_gpu=device.type == "cuda")
    first_s: float | None = None
    measured_s, measured_images = 0.0, 0
    timeline: list[tuple[float, float]] = []
    t_start = time.perf_counter()
    loss = float("nan")
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(epoch)
        warmup = epoch == 0 and epochs > 1
        losses, seen = [], 0
        t0 = time.perf_counter()
        source = batches if warmup else meter.wrap(batches)
        for batch in source:
            losses.append(step(batch))
            seen += int((batch[1] if isinstance(batch, tuple) else batch["cls"]).shape[0])
            if not warmup:
                timeline.append((time.perf_counter() - t_start, meter.waits[-1]))
        loss = torch.stack(losses).mean().item() if losses else float("nan")  # the epoch's only sync
        dt = time.perf_counter() - t0
        if warmup:
            first_s = dt
        else:
            measured_s += dt
            measured_images += seen
    rep = meter.report()
    # Every wait of the measured epochs, their first batches included: after the warm-up epoch an
    # epoch's first wait is a refill stall, not worker start-up (which StallMeter's share leaves out).
    share = sum(meter.waits) / measured_s if measured_s > 0 else 0.0
    return Row(name, recipe, first_s, measured_images / measured_s if measured_s > 0 else 0.0, share,
               rep.gpu_util_mean, loss, share > LOADER_BOUND_SHARE, timeline)


def _fastdata_row(label: str, recipe: str, dataset: Any, transform: Any, *, device: torch.device, batch_size: int,
                  workers: int, epochs: int, make_step: Callable[[], Any], pin: bool = False) -> tuple[Row, Any]:
    from fastdata.loader import DataLoader
    from fastdata.prefetch import CUDAPrefetcher

    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0,
                        drop_last=True, pin_memory=pin)
    # the prefetcher's set_epoch: it starts the next epoch's iterator ahead, so epochs run back to back
    with CUDAPrefetcher(loader, device=device, depth=2, transform=transform) as batches:
        row = _train(label, recipe, batches, make_step, epochs, device, batches.set_epoch)
    return row, loader


def _run_pipelines(root: Path, shards: Path, *, device: torch.device, model_name: str, batch_size: int,
                   workers: int, epochs: int, gpu_decode: bool = False) -> list[Row]:
    """The table's rows: tuned torch DataLoader, fastdata uncached, fastdata cached (and with
    ``gpu_decode`` fastdata decoding the JPEGs on the device, nvJPEG through TorchCodec)."""
    import torch

    from fastdata.dataset import ShardedDataset
    from fastdata.gpu import Normalize
    from fastdata.train import TrainStep
    from fastdata.transforms import ResizeCenterCrop

    def make_step(input_key: str | int, target_key: str | int) -> Callable[[], TrainStep]:
        def make() -> TrainStep:
            _, model = build_model(model_name, device)
            return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                             torch.nn.functional.cross_entropy, tf32=device.type == "cuda",
                             input_key=str(input_key), target_key=str(target_key))
        return make

    rows = []
    w = f"{workers} worker{'s' if workers != 1 else ''}"
    plain = _tuned_torch_loader(root / "images", batch_size, workers, device)
    rows.append(_train("torch DataLoader, tuned",
                       f"PIL decode+resize+normalise in {w}, {'pin_memory, ' if device.type == 'cuda' else ''}"
                       "persistent, prefetch_factor=4",
                       plain, make_step(0, 1), epochs, device))
    del plain  # its persistent workers stop now rather than idle through the other pipelines
    _report(rows[-1])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    norm = Normalize(keys=["jpg"], dtype=dtype, channels_last=device.type == "cuda")
    cache = root / "cache"
    if cache.exists():
        shutil.rmtree(cache)  # a cache left by an earlier run would make the first epoch a cached one
    to = str(dtype).replace("torch.", "")
    for label, cache_dir in (("fastdata, uncached", None), ("fastdata, cached", cache)):
        ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"],
                            preprocess=ResizeCenterCrop(IMAGE_SIZE), cache=cache_dir)
        recipe = (f"ShardedDataset -> DataLoader({w}) -> CUDAPrefetcher(Normalize to {to})"
                  + (": 1st epoch fills the cache, later ones read it in-process" if cache_dir else ""))
        row, loader = _fastdata_row(label, recipe, ds, norm, device=device, batch_size=batch_size, workers=workers,
                                    epochs=epochs, make_step=make_step("jpg", "cls"))
        if cache_dir is not None:
            row.note = f"last epoch: {loader.last_path} path"
        rows.append(row)
        _report(row)
    if gpu_decode:
        from fastdata import gpu

        ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"], image_decode="device")
        stage = gpu.Compose(gpu.DecodeImages(keys=["jpg"], device=device), gpu.Resize(RESIZE),
                            gpu.CenterCrop(IMAGE_SIZE), norm)
        recipe = (f"ShardedDataset(image_decode='device') -> DataLoader({w}, JPEG bytes) -> CUDAPrefetcher("
                  f"DecodeImages, Resize, CenterCrop, Normalize to {to})")
        try:
            row, _ = _fastdata_row("fastdata, GPU decode", recipe, ds, stage, device=device, batch_size=batch_size,
                                   workers=workers, epochs=epochs, make_step=make_step("jpg", "cls"),
                                   pin=device.type == "cuda")
        except Exception as e:  # noqa: BLE001  the other rows stand; say why this one is missing
            print(f"      fastdata, GPU decode: not measured: {type(e).__name__}: {e}", flush=True)
        else:
            rows.append(row)
            _report(row)
    return rows


def gpu_decode_available(device: torch.device) -> bool:
    """Whether the device decode path (``image_decode="device"`` + ``fastdata.gpu.DecodeImages``) can run here."""
    if device.type != "cuda":
        return False
    try:
        from fastdata.gpu import DecodeImages  # noqa: F401
    except ImportError:
        return False
    return True


def _report(row: Row) -> None:
    print(f"      {row.pipeline:<24} {row.images_per_s:>8.0f} images/s, input wait {row.wait_share:.0%}"
          f"   ({row.recipe})", flush=True)


def _table(rows: list[Row], device: torch.device) -> list[str]:
    base = rows[0].images_per_s
    gpu = device.type == "cuda"
    head = f"{'pipeline':<24} {'images/s':>9} {'input wait':>10} {'GPU util':>8} {'speed-up':>8} {'1st epoch':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        util = f"{r.gpu_util:.0f}%" if gpu and r.gpu_util is not None else "-"
        speed = r.images_per_s / base if base > 0 else math.nan
        first = f"{r.first_epoch_s:>8.1f}s" if r.first_epoch_s is not None else f"{'-':>9}"
        lines.append(f"{r.pipeline:<24} {r.images_per_s:>9.0f} {r.wait_share:>10.0%} {util:>8} {speed:>7.2f}x {first}")
    return lines


def _machine(device: torch.device) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu_cores": default_workers() if os.cpu_count() is None else os.cpu_count(),
                            "platform": platform.platform(), "device": str(device),
                            "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_demo(*, workdir: str | None, num_images: int, num_workers: int | None, epochs: int, batch_size: int,
             model: str = "auto", json_path: str | None = None) -> int:
    """Generate and shard a JPEG set, train the same model from three pipelines, print one table."""
    import torch

    from fastdata.monitor import LOADER_BOUND_SHARE

    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    workers = default_workers() if num_workers is None else num_workers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if num_images < batch_size:
        raise ValueError(f"--images ({num_images}) must be at least --batch-size ({batch_size})")
    t_all = time.perf_counter()
    model_name, m = build_model(model, device)  # before any work: a model that cannot be built fails now
    if model == "auto" and model_name != "resnet18" and device.type == "cuda":
        warnings.warn(f"resnet18 needs torchvision ({_torchvision_model('resnet18')}); the demo trains a small CNN "
                      "instead", RuntimeWarning, stacklevel=2)
    with _workdir(workdir) as root:
        shards, _ = _make_shards(root, num_images, workers, show_paths=workdir is not None)
        precision = "bf16 autocast" if device.type == "cuda" and torch.cuda.is_bf16_supported() else (
            "fp16 autocast" if device.type == "cuda" else "fp32")
        params = sum(p.numel() for p in m.parameters())
        del m
        print(f"[3/4] training {model_name} ({params / 1e6:.2f} M parameters) on {device} ({precision}), "
              f"batch {batch_size}, {workers} worker{'s' if workers != 1 else ''}"
              f"{', 1 intra-op thread' if device.type == 'cpu' else ''}, "
              f"{epochs} epochs per pipeline "
              f"({'the first is warm-up, the rest measured' if epochs > 1 else 'one measured epoch'})", flush=True)
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)  # the step's intra-op threads would fight the workers for the cores
        try:
            rows = _run_pipelines(root, shards, device=device, model_name=model_name, batch_size=batch_size,
                                  workers=workers, epochs=epochs, gpu_decode=gpu_decode_available(device))
        finally:
            torch.set_num_threads(threads)
    if json_path:  # first: a reader of stdout that went away (`| head`) does not lose the file
        out = {"benchmark": "demo", "machine": _machine(device), "settings": {"images": num_images, "workers": workers, "epochs": epochs,
                                                        "batch_size": batch_size, "model": model_name,
                                                        "image_size": IMAGE_SIZE},
               "rows": [r.to_json() for r in rows]}
        Path(json_path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"[4/4] {num_images} images, {device}" + (f" ({torch.cuda.get_device_name(device)})"
                                                     if device.type == "cuda" else f", {os.cpu_count()} CPU cores"))
    for line in _table(rows, device):
        print("      " + line)
    plain, cached = rows[0], next(r for r in rows if r.pipeline == "fastdata, cached")
    first = ("1st epoch = warm-up (worker start, cache fill), not in images/s." if epochs > 1
             else "One epoch each: worker start and the cache fill are in images/s.")  # no warm-up epoch
    print(f"      fastdata cached runs {cached.images_per_s / max(plain.images_per_s, 1e-9):.1f}x the tuned "
          f"DataLoader; its loop waits for input {cached.wait_share:.0%} of the time (the tuned DataLoader's: "
          f"{plain.wait_share:.0%}). {first}")
    bound = [r.pipeline for r in rows if r.loader_bound]
    print(f"      loader-bound (waits > {LOADER_BOUND_SHARE:.0%}): " + (", ".join(bound) if bound else "none") +
          f"; total {time.perf_counter() - t_all:.0f} s")
    return 0


def _cmd_demo(args: Any) -> int:
    return run_demo(workdir=args.dir, num_images=args.images, num_workers=args.workers, epochs=args.epochs,
                    batch_size=args.batch_size, model=args.model, json_path=args.json)


def add_demo_subparser(sub: Any) -> None:
    """Register ``fastdata demo`` on the ``fastdata`` command's subparsers."""
    from fastdata.cli._args import nonneg_int, output_file, positive_int, work_folder

    demo = sub.add_parser(
        "demo", help="before/after: the same model trained from a tuned torch DataLoader and from fastdata",
        description="Generate photo-like JPEGs, shard them, and train the same model from a tuned "
                    "torch.utils.data.DataLoader, fastdata uncached and fastdata cached; print one table "
                    "(images/s, input wait, GPU utilisation, speed-up).")
    demo.add_argument("--dir", type=work_folder, default=None, metavar="DIR",
                      help="keep the images, shards and cache in DIR: a new or empty folder, or one an earlier demo or "
                           "bench used (default: a temporary folder, removed after)")
    demo.add_argument("--images", type=positive_int, default=1024, metavar="N",
                      help="number of JPEGs to generate (default: 1024)")
    demo.add_argument("--workers", type=nonneg_int, default=None, metavar="N",
                      help="DataLoader workers for every pipeline (default: one per CPU core, at most 8; "
                           f"{default_workers()} here)")
    demo.add_argument("--epochs", type=positive_int, default=3, metavar="N",
                      help="epochs per pipeline; the first is warm-up and reported apart (default: 3)")
    demo.add_argument("--batch-size", type=positive_int, default=64, metavar="N", help="batch size (default: 64)")
    demo.add_argument("--model", choices=MODELS, default="auto",
                      help="model to train: auto = resnet18 on a GPU (needs torchvision), a small CNN on the "
                           "CPU (default: auto)")
    demo.add_argument("--json", type=output_file, default=None, metavar="PATH",
                      help="also write the rows, settings, machine and per-step input waits as JSON "
                           "(for benchmarks/plot.py; default: none)")
    demo.set_defaults(func=_cmd_demo)
