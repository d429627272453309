"""End-to-end training throughput: how close does each input pipeline get to the model's own speed?

A torchvision ResNet (``--models``, default resnet18 and resnet50, random init, channels_last)
is trained with ``fastdata.TrainStep`` (bf16 autocast on CUDA, SGD) on a generated photo-like JPEG
corpus (``fastdata.cli._synth``, 300-640 px, written to tar shards), 224 px centre crops, batch
``--batch-size``, over ``--epochs`` timed epochs (``--warmup`` untimed epochs before them, default 2). Compared
for every model:

- ``resident``: the same batch, already on the GPU and normalised, every step: the model's own speed;
- ``torch_loader``: a tuned ``torch.utils.data.DataLoader`` over the JPEG files (the same decode:
  PIL with ``draft`` + ``ResizeCenterCrop``), ``pin_memory=True``, ``persistent_workers=True``,
  ``prefetch_factor=4``, ``.to(device, non_blocking=True)`` and ``Normalize`` on the GPU;
- ``fastdata_uncached``: ``ShardedDataset(preprocess=ResizeCenterCrop)`` -> ``fastdata.DataLoader``
  (the same workers) -> ``CUDAPrefetcher(Normalize)``, epochs through ``set_epoch`` on the prefetcher;
- ``fastdata_cached``: the same with ``cache=``; the first warm-up epoch fills the cache, the second
  memoizes the small uncached fields, the timed epochs take the cached fast path.

With ``--augment random`` the pipelines train with the ImageNet recipe's random augmentation
(RandomResizedCrop to ``--size``, scale 8-100%, aspect 3/4-4/3, and a horizontal flip), which no
cache can serve:

- ``torch_recipe_rrc``: torchvision's usual recipe (``ImageFolder`` with ``RandomResizedCrop``,
  ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize`` in the workers; the same recipe written out
  with PIL where torchvision cannot be imported), tuned as ``torch_loader``;
- ``fastdata_workers_rrc``: Pillow decode + crop + flip in ``fastdata.DataLoader`` workers
  (``decode_stage.py``'s ``DecodeRandomResizedCropFlip``) -> ``CUDAPrefetcher(Normalize)``;
- ``fastdata_threads_rrc``: the same in ``decode_threads`` threads of this process, no workers;
- ``fastdata_gpu_rrc``: ``image_decode="device"``: min(workers, 4) workers read JPEG bytes, the
  prefetcher decodes (``--device-decoder``), crops, flips and normalises on the GPU, the stage run as
  ``--decode-candidate`` says (a row of ``benchmarks/gpu/candidates.py``; default ``DecodeImages.ahead``),
  on a ``--stream-priority`` side stream; on the CPU without CUDA; ``fastdata_gpu_rrc_hiprio``: the same
  with ``stream_priority="high"``.

Reported per run: images/s over the timed epochs (epoch starts included), its share of
``resident``, mean GPU utilisation (NVML, the device looked up by UUID/PCI bus id, sampled over the
timed window), the CPU cores used (CPU time of this process and its workers over the timed window,
with psutil), and the training thread's wait for its next batch (p50/p99/max). JSON with
``--json``; a run that failed has its ``error`` there, and the exit status is 1 when one did. Without
CUDA it runs on the CPU (fp32; utilisation n/a), small, as a smoke test.

    python benchmarks/train_e2e.py --json /tmp/e2e.json                     # CUDA machine
    python benchmarks/train_e2e.py --augment random --models resnet18        # random augmentation
    python benchmarks/train_e2e.py --quick                                    # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdata.cli._synth import make_image_folder  # noqa: E402


class JpegFiles(torch.utils.data.Dataset):
    """Map-style dataset over the corpus files: the same decode + preprocess as fastdata's workers."""

    def __init__(self, files: list[Path], size: int) -> None:
        from fastdata.transforms import ResizeCenterCrop

        self.files, self.rcc = files, ResizeCenterCrop(size)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.files[i]) as im:
            t = self.rcc.target_size
            im.draft("RGB", (t, t))  # reduced-scale JPEG decode for large images, as fastdata does
            return self.rcc(im.convert("RGB")), int(self.files[i].parent.name.split("_")[-1])


def quantiles(waits: list[float]) -> dict[str, float]:
    if not waits:
        return {"wait_p50_ms": 0.0, "wait_p99_ms": 0.0, "wait_max_ms": 0.0}
    a = np.asarray(waits) * 1e3
    return {"wait_p50_ms": float(np.percentile(a, 50)), "wait_p99_ms": float(np.percentile(a, 99)),
            "wait_max_ms": float(a.max())}


class Utilisation:
    """Mean GPU utilisation over a window: fastdata.monitor's NVML sampler (UUID/PCI lookup), or None."""

    def __init__(self, device: torch.device) -> None:
        self.sampler: Any = None
        self.error: str | None = None
        if device.type != "cuda":
            self.error = "no CUDA device"
            return
        try:
            from fastdata.monitor import GPUSampler

            self.sampler = GPUSampler(device.index or 0, 0.05)
        except Exception as e:  # noqa: BLE001  reported in the results, the run goes on
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> tuple[float | None, int]:
        if self.sampler is None:
            return None, 0
        samples = self.sampler.stop()
        if self.sampler.error is not None:  # the mean covers only part of the window: say so in the results
            self.error = f"sampling stopped early: {self.sampler.error!r}"
        return (float(np.mean(samples)) if samples else None), len(samples)


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its live child processes (the loader's persistent
    workers); without psutil, of this process and its finished children only."""
    try:
        import psutil
    except ImportError:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    proc = psutil.Process()
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a worker that ended meanwhile
            total += sum(child.cpu_times()[:2])
    return total


def make_model(name: str, device: torch.device, num_classes: int) -> torch.nn.Module:
    if name == "tiny":  # smoke tests of the harness where torchvision is unavailable
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(16, num_classes))
    else:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def make_step(model: torch.nn.Module, device: torch.device) -> Any:
    from fastdata.train import TrainStep

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return TrainStep(model, opt, torch.nn.functional.cross_entropy, input_key="jpg", target_key="cls",
                     precision="bf16" if device.type == "cuda" else "fp32")


def run_epochs(step: Any, epoch_iter: Any, epochs: int, device: torch.device, *,
               after_warmup: Any = None, warmup: int = 1) -> dict[str, Any]:
    """Epochs 0..``warmup``-1 untimed, then ``epochs`` timed ones. ``epoch_iter(e)`` yields
    (batch, wait seconds) pairs, or batches whose waits the caller measures itself. The cached
    pipeline needs two: the first fills the cache (through the workers), the second is the first
    from the cache, where the loader also reads and memoizes every sample's small uncached fields
    (``__key__``, ``cls``) once; ``epoch_images_per_s`` shows each timed epoch."""
    def one(e: int, waits: list[float]) -> tuple[int, Any]:
        n, loss = 0, None
        for item in epoch_iter(e):
            batch, wait = item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], float) else (item, None)
            if wait is not None:
                waits.append(wait)
            loss = step(batch)
            n += int(batch["cls"].shape[0])
        return n, loss

    for e in range(warmup):
        one(e, [])
    if after_warmup is not None:
        after_warmup()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    util = Utilisation(device)
    cpu0 = tree_cpu_s()
    waits: list[float] = []
    images = 0
    t0 = time.perf_counter()
    loss = None
    per_epoch = []
    for e in range(warmup, warmup + epochs):
        te = time.perf_counter()
        n, loss = one(e, waits)
        images += n
        per_epoch.append(n / (time.perf_counter() - te))  # without a sync: indicative only
    if loss is not None:
        loss = float(loss)  # the one sync (TrainStep never syncs on its own)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    cpu_cores = (tree_cpu_s() - cpu0) / wall
    mean_util, samples = util.stop()
    out = {"images": images, "wall_s": wall, "images_per_s": images / wall, "epoch_images_per_s": per_epoch,
           "warmup_epochs": warmup, "gpu_util_pct": mean_util, "cpu_cores": cpu_cores,
           "gpu_util_samples": samples, "final_loss": loss, **quantiles(waits)}
    if util.error:
        out["gpu_util_error"] = util.error
    return out


def resident(model_name: str, args: argparse.Namespace, device: torch.device, steps_per_epoch: int) -> dict:
    from fastdata.gpu import Normalize

    model = make_model(model_name, device, args.classes)
    step = make_step(model, device)
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (args.batch_size, 3, args.size, args.size), dtype=torch.uint8, generator=g)
    norm = Normalize(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                     channels_last=device.type == "cuda")
    batch = {"jpg": norm(raw.to(device)), "cls": torch.randint(0, args.classes, (args.batch_size,)).to(device)}

    def epoch_iter(_e: int) -> Any:
        return ((batch, 0.0) for _ in range(steps_per_epoch))

    return run_epochs(step, epoch_iter, args.epochs, device, warmup=args.warmup)


def torch_loader(model_name: str, args: argparse.Namespace, device: torch.device, files: list[Path]) -> dict:
    from fastdata.gpu import Normalize

    model = make_model(model_name, device, args.classes)
    step = make_step(model, device)
    loader = torch.utils.data.DataLoader(
        JpegFiles(files, args.size), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        pin_memory=device.type == "cuda", persistent_workers=args.workers > 0, drop_last=True,
        prefetch_factor=4 if args.workers > 0 else None, generator=torch.Generator().manual_seed(0))
    norm = Normalize(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                     channels_last=device.type == "cuda")
    return run_epochs(step, torch_epochs(loader, device, norm), args.epochs, device, warmup=args.warmup)


def torch_epochs(loader: Any, device: torch.device, prepare: Any) -> Any:
    """``epoch_iter`` of a torch DataLoader of ``(images, labels)``: each batch moved with
    ``non_blocking``, the wait for it (next() and the copies' launch) measured, ``prepare(images)`` after."""
    def epoch_iter(_e: int) -> Any:
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                img, cls = next(it)
            except StopIteration:
                return
            img = img.to(device, non_blocking=True)
            cls = cls.to(device, non_blocking=True)
            wait = time.perf_counter() - t0
            yield {"jpg": prepare(img), "cls": cls}, wait

    return epoch_iter


def prefetcher_stats(pf: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """The prefetcher's consumer waits (ms) and the counters ``keys`` of ``pf.stats()``."""
    st = pf.stats()
    return {"wait_p50_ms": st["wait_p50_s"] * 1e3, "wait_p99_ms": st["wait_p99_s"] * 1e3,
            "wait_max_ms": st["wait_max_s"] * 1e3, "prefetcher": {k: st[k] for k in keys}}


def fastdata_run(model_name: str, args: argparse.Namespace, device: torch.device, shards: Path,
                 cache: Path | None) -> dict:
    from fastdata.dataset import ShardedDataset
    from fastdata.gpu import Normalize
    from fastdata.loader import DataLoader
    from fastdata.prefetch import CUDAPrefetcher
    from fastdata.transforms import ResizeCenterCrop

    model = make_model(model_name, device, args.classes)
    step = make_step(model, device)
    ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"], preprocess=ResizeCenterCrop(args.size),
                        cache=cache, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, drop_last=True,
                        persistent_workers=args.workers > 0)
    norm = Normalize(keys=["jpg"], dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                     channels_last=device.type == "cuda")
    pf = CUDAPrefetcher(loader, device=device, depth=args.depth, transform=norm)
    paths: list[str | None] = []

    def epoch_iter(e: int) -> Any:
        pf.set_epoch(e)
        yield from pf
        paths.append(loader.last_path)

    try:
        out = run_epochs(step, epoch_iter, args.epochs, device, after_warmup=pf.reset_stats, warmup=args.warmup)
        out.update(paths=paths, **prefetcher_stats(pf, ("batches", "epochs", "lookahead_epochs", "lookahead_discarded",
                                                         "throttle_s", "load_s", "pack_s", "copy_gbps", "pinned_bytes",
                                                         "pack_threads")))
        return out
    finally:
        pf.close()


AUGMENT_VARIANTS = {
    "center": ["resident", "torch_loader", "fastdata_uncached", "fastdata_cached"],
    "random": ["resident", "torch_recipe_rrc", "fastdata_workers_rrc", "fastdata_threads_rrc", "fastdata_gpu_rrc",
               "fastdata_gpu_rrc_hiprio"],
}


def _decode_stage() -> Any:
    """benchmarks/decode_stage.py as a module: the random-augmentation recipes are defined there
    (imported by name from this folder, so spawned workers find its classes too)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import decode_stage

    return decode_stage


def _candidates() -> Any:
    """benchmarks/gpu/candidates.py: the ways of running the device decode stage, one table."""
    here = str(Path(__file__).resolve().parent / "gpu")
    if here not in sys.path:
        sys.path.insert(0, here)
    import candidates

    return candidates


def torch_recipe_rrc(model_name: str, args: argparse.Namespace, device: torch.device, corpus: Path) -> dict:
    """torchvision's usual random-augmentation recipe, float32 normalised in the workers, tuned loader."""
    ds_mod = _decode_stage()
    model = make_model(model_name, device, args.classes)
    step = make_step(model, device)
    dataset = ds_mod._imagefolder(str(corpus), args.size)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        pin_memory=device.type == "cuda", persistent_workers=args.workers > 0, drop_last=True,
        prefetch_factor=4 if args.workers > 0 else None, generator=torch.Generator().manual_seed(0))
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    out = run_epochs(step, torch_epochs(loader, device, lambda img: img.contiguous(memory_format=fmt)), args.epochs,
                     device, warmup=args.warmup)
    out["impl"] = getattr(dataset, "impl", None)
    return out


def fastdata_rrc(model_name: str, args: argparse.Namespace, device: torch.device, shards: Path, where: str,
                 priority: str = "normal") -> dict:
    """Random augmentation in fastdata: ``where`` = "workers", "threads" (Pillow on the CPU) or "gpu"."""
    from fastdata import gpu
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.prefetch import CUDAPrefetcher

    model = make_model(model_name, device, args.classes)
    step = make_step(model, device)
    norm = gpu.Normalize(keys=["jpg"], dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                         channels_last=device.type == "cuda")
    if where == "gpu":
        ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"], image_decode="device",
                            rank=0, world_size=1)
        readers = min(args.workers, 4)
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=readers, drop_last=True,
                            pin_memory=device.type == "cuda", persistent_workers=readers > 0)
        cand = _candidates().by_name(args.decode_candidate)  # default "ahead1": batch i + 1 decodes while i resamples
        decode = cand.decode_stage(args.device_decoder, device, keys=["jpg"])
        transform = gpu.Compose(decode, gpu.RandomResizedCrop(args.size), gpu.RandomHorizontalFlip(), norm)
        source: Any = cand.source(decode, loader)
    else:
        ds_mod = _decode_stage()
        ds = ShardedDataset(shards, shuffle=True, seed=0, fields=["jpg", "cls"], rank=0, world_size=1,
                            decode={"jpg": ds_mod.DecodeRandomResizedCropFlip(args.size)})
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, drop_last=True,
                            persistent_workers=args.workers > 0,
                            decode_threads=args.workers if where == "threads" else 0)
        transform, source = norm, loader
    pf = CUDAPrefetcher(source, device=device, depth=args.depth, transform=transform, stream_priority=priority)

    def epoch_iter(e: int) -> Any:
        pf.set_epoch(e)
        yield from pf

    try:
        out = run_epochs(step, epoch_iter, args.epochs, device, after_warmup=pf.reset_stats, warmup=args.warmup)
        out.update(stream_priority=priority,
                   **prefetcher_stats(pf, ("batches", "epochs", "load_s", "pack_s", "copy_gbps")))
        if where == "gpu":
            out.update(host_decoded=decode.host_decoded, decoder=decode.resolved_device_decoder,
                       decode_candidate=args.decode_candidate)
        return out
    finally:
        pf.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "resnet50"],
                    help="torchvision model names ('tiny': a 2-layer net for smoke tests)")
    ap.add_argument("--augment", choices=sorted(AUGMENT_VARIANTS), default="center",
                    help="center: 224 px centre crops (cacheable); random: RandomResizedCrop + flip (see above)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="default: every variant of --augment (" + "; ".join(
                        f"{k}: {' '.join(v)}" for k, v in AUGMENT_VARIANTS.items()) + ")")
    ap.add_argument("--images", type=int, default=None, help="corpus size (default 4096; CPU/--quick 128)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 128 (CPU/--quick 16)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs (after the warm-up epochs)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed epochs first, the same for every variant (default 2: the cached pipeline's cache "
                         "fill and its first epoch from the cache, which memoizes the uncached fields)")
    ap.add_argument("--workers", type=int, default=None, help="loader workers (default: cores - 1, at most 15)")
    ap.add_argument("--depth", type=int, default=2, help="CUDAPrefetcher depth")
    ap.add_argument("--device-decoder", default="auto", help="device JPEG decoder of the GPU decode rows "
                    "(DecodeImages(device_decoder=...): auto, torchvision, torchcodec, nvimgcodec)")
    ap.add_argument("--decode-candidate", default="ahead1",
                    help="how the GPU decode rows run the stage: a row of benchmarks/gpu/candidates.py")
    ap.add_argument("--stream-priority", default="normal", choices=("normal", "high"),
                    help="CUDAPrefetcher stream priority of fastdata_gpu_rrc (fastdata_gpu_rrc_hiprio: high)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--dir", default=None, help="work folder (corpus and shards kept and reused)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.variants = args.variants or AUGMENT_VARIANTS[args.augment]
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    small = args.quick or device.type != "cuda"
    args.images = args.images or (128 if small else 4096)
    args.batch_size = args.batch_size or (16 if small else 128)
    if small and args.size == 224:
        args.size = 64
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    args.workers = args.workers if args.workers is not None else max(1, min(15, cores - 1))
    if args.epochs < 1:
        ap.error("--epochs must be >= 1")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first epoch compiles, tunes cuDNN and starts workers)")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    report: dict[str, Any] = {"benchmark": "train_e2e", "device": str(device), "torch": torch.__version__,
                              "python": platform.python_version(), "cores": cores, "args": {
                                  k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "results": []}
    if device.type == "cuda":
        report["device_name"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.dir) if args.dir else Path(tmp)
        t0 = time.perf_counter()
        corpus = make_image_folder(work / f"jpeg-{args.images}", args.images, num_classes=args.classes,
                                   workers=min(args.workers, 8))
        files = sorted(corpus.rglob("*.jpg"))
        shards = work / f"shards-{args.images}"
        if not (shards / "manifest.json").exists():
            from fastdata.shards.writer import ShardWriter

            with ShardWriter(shards, max_bytes=32 << 20, overwrite=True) as w:
                for f in files:
                    w.write({"__key__": f"{f.parent.name}/{f.stem}", "jpg": f.read_bytes(),
                             "cls": int(f.parent.name.split("_")[-1])})
        report["corpus_s"] = time.perf_counter() - t0
        steps_per_epoch = args.images // args.batch_size
        for model_name in args.models:
            base: float | None = None
            for variant in args.variants:
                t1 = time.perf_counter()
                try:
                    if variant == "resident":
                        r = resident(model_name, args, device, steps_per_epoch)
                    elif variant == "torch_loader":
                        r = torch_loader(model_name, args, device, files)
                    elif variant == "fastdata_uncached":
                        r = fastdata_run(model_name, args, device, shards, None)
                    elif variant == "fastdata_cached":
                        cache = work / f"cache-{model_name}"
                        r = fastdata_run(model_name, args, device, shards, cache)
                    elif variant == "torch_recipe_rrc":
                        r = torch_recipe_rrc(model_name, args, device, corpus)
                    elif variant in ("fastdata_workers_rrc", "fastdata_threads_rrc"):
                        r = fastdata_rrc(model_name, args, device, shards, variant.split("_")[1])
                    elif variant == "fastdata_gpu_rrc":
                        r = fastdata_rrc(model_name, args, device, shards, "gpu", priority=args.stream_priority)
                    elif variant == "fastdata_gpu_rrc_hiprio":
                        r = fastdata_rrc(model_name, args, device, shards, "gpu", priority="high")
                    else:
                        raise ValueError(f"unknown variant {variant!r}")
                except Exception as e:  # noqa: BLE001  one failing part never ends the run
                    r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                r.update(model=model_name, variant=variant, elapsed_s=time.perf_counter() - t1)
                if variant == "resident" and "images_per_s" in r:
                    base = r["images_per_s"]
                if base and "images_per_s" in r:
                    r["share_of_resident"] = r["images_per_s"] / base
                report["results"].append(r)
                print(_row(r), flush=True)
                if args.json:  # after every run: a time limit that stops the script keeps what was measured
                    args.json.write_text(json.dumps(report, indent=1))
                gc.collect()  # the variant's loader and its workers go before the next one starts
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print()
    print(_table(report["results"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    failed = [r for r in report["results"] if "error" in r]
    if failed:  # after the JSON: every row is kept, but the run is not reported ok
        print(f"{len(failed)} of {len(report['results'])} runs failed: "
              + ", ".join(f"{r['model']}/{r['variant']}" for r in failed), file=sys.stderr)
    return 1 if failed else 0


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<9} {r['variant']:<23} ERROR {r['error']}"
    util = f"{r['gpu_util_pct']:.0f}%" if r.get("gpu_util_pct") is not None else "n/a"
    share = f"{r['share_of_resident']:.0%}" if "share_of_resident" in r else "-"
    return (f"{r['model']:<9} {r['variant']:<23} {r['images_per_s']:9.0f} img/s  {share:>5} of resident  "
            f"GPU {util:>4}  CPU {r.get('cpu_cores', 0):4.1f} cores  "
            f"wait p50/p99/max {r['wait_p50_ms']:.2f}/{r['wait_p99_ms']:.2f}/{r['wait_max_ms']:.1f} ms")


def _table(results: list[dict]) -> str:
    return "\n".join(_row(r) for r in results)


if __name__ == "__main__":
    sys.exit(main())
