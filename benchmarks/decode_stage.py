"""Decode stage: decode + RandomResizedCrop 224 + flip + normalise, four ways, equal cores, one run.

Corpus: photo-like JPEGs of 300-640 px per side (``fastdata.cli._synth.make_image_folder``), in an
ImageFolder layout and as pass-through tar shards (jpg + cls) of the same files, cached under
``--data``. Every row yields batches of ``--batch-size`` normalised float32 images of 224 x 224 from
the same images with the same work per image (decode the whole JPEG, a random crop of 8-100% of
the area with aspect 3/4-4/3 resized to 224 x 224 with antialiased bilinear filtering, a
horizontal flip with probability 1/2, normalise with the ImageNet mean/std), shuffled:

- ``workers``: ``fastdata.DataLoader(num_workers=N)`` over ``ShardedDataset(shuffle=True,
  decode={"jpg": DecodeRandomResizedCropFlip()})``: Pillow decodes in N worker processes, the crop
  box is resampled straight to 224 px (``Image.resize(box=...)``); uint8 batches are normalised in the
  consumer as one batched op (``fastdata.gpu.Normalize``, on the GPU when there is one, after the
  copy ``CUDAPrefetcher`` would make);
- ``threads``: the same dataset and consumer, ``DataLoader(num_workers=N, decode_threads=N)``: N
  threads of the loading process, no worker processes (same batches as ``workers``);
- ``gpu``: the same shards with images kept encoded (``image_decode="device"``; min(N, 4) workers
  read bytes), decoded, cropped, flipped and normalised on the GPU inside ``CUDAPrefetcher``
  (``fastdata.gpu.Compose(DecodeImages, RandomResizedCrop, RandomHorizontalFlip, Normalize)``);
  skipped without CUDA or when that API is not in this checkout; ``gpu-threads``: the same, with
  the bytes read by min(N, 4) threads (``decode_threads``) instead of worker processes; the device
  JPEG decoder is ``--device-decoder`` (``auto``: TorchCodec, else torchvision before 0.29, unless
  ``FASTDATA_DEVICE_DECODER`` names another; ``nvimgcodec``: nvImageCodec, when installed), recorded
  in the rows' ``decoder``;
- ``torchvision``: the usual recipe, ``torchvision.datasets.ImageFolder`` with
  ``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``ToTensor()``, ``Normalize(...)`` in
  ``torch.utils.data.DataLoader(num_workers=N, shuffle=True)`` (normalised in the workers). Where
  torchvision cannot be imported, the row runs the same recipe written out with PIL and torch
  (what torchvision's v1 transforms do on PIL images: ``crop`` then ``resize``, ``ToTensor``,
  ``Normalize``) and says so in its ``impl`` field.

Equal cores: the rows of one N run in one process pinned to N cores (``sched_setaffinity``;
worker processes inherit it), so a row with N workers or N threads gets N cores, its consumer
included. Each epoch is timed end to end (worker start included, as in training without
persistent workers): one warm-up epoch per row, then ``--reps`` rounds of one epoch per row
(interleaved, so a change of load hits every row alike); medians reported. ``--budget`` shares
the seconds among the N (at least one round each). Besides
images/s, each row reports the CPU time it spent per image (its process and its worker
processes, user + system), which a busy shared machine distorts far less than wall time.

    python benchmarks/decode_stage.py --workers 2 --json /tmp/decode_stage.json
    python benchmarks/decode_stage.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = ("workers", "threads", "gpu", "gpu-threads", "torchvision")
SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
REPO = Path(__file__).resolve().parents[1]


# ----- the per-sample CPU transform (fastdata rows) ----------------------------------------------
def crop_params(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: (top, left, height, width) of the crop."""
    import math

    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: centre crop of the whole image at a clamped aspect
    if in_ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif in_ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class DecodeRandomResizedCropFlip:
    """``decode={"jpg": ...}``: Pillow decode, RandomResizedCrop(size), RandomHorizontalFlip(0.5) ->
    uint8 (3, size, size) (size 224 unless given).

    Decoded as the dataset's default decoder does (``ImageDecoder``, RGB, whole image); only the
    crop box is resampled (``Image.resize(box=...)``, antialiased bilinear, as torchvision on PIL
    images); the flip is a ``transpose``. All three release the GIL. Random parameters come from
    Python's ``random`` (seeded per worker process by torch's DataLoader). (A decoder rather than
    ``transform=``, which receives tensors unless a ``preprocess=`` is set.)
    """

    def __init__(self, size: int = SIZE) -> None:
        self.size = size

    def __call__(self, data: bytes) -> Any:
        from PIL import Image

        from fastdata.decode import ImageDecoder, image_to_tensor

        img = ImageDecoder().pil(data)
        top, left, h, w = crop_params(img.width, img.height, random._inst)  # type: ignore[attr-defined]
        out = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if random.random() < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return image_to_tensor(out)


def _to_tuple(sample: dict[str, Any]) -> tuple[Any, Any]:
    return sample["jpg"], sample["cls"]


# ----- data ---------------------------------------------------------------------------------------
def prepare(data: Path, n: int, shards: int) -> tuple[Path, Path]:
    """(ImageFolder root, shard folder) with the same ``n`` JPEGs."""
    from fastdata.cli._synth import make_image_folder
    from fastdata.manifest import Manifest
    from fastdata.shards.writer import ShardWriter

    folder = make_image_folder(data / f"images-{n}", n, workers=min(8, os.cpu_count() or 1))
    files = sorted(folder.glob("class_*/img_*.jpg"))
    if len(files) != n:
        raise RuntimeError(f"{folder} holds {len(files)} images, expected {n}; delete it and rerun")
    dest = data / f"shards-{n}-{shards}"
    try:
        ok = Manifest.load(dest).num_samples == n
    except Exception:  # noqa: BLE001 - missing or stale: rebuild
        ok = False
    if not ok:
        with ShardWriter(dest, max_samples=-(-n // shards), overwrite=True) as w:
            for f in files:
                w.write({"__key__": f"{f.parent.name}/{f.stem}", "jpg": f.read_bytes(),
                         "cls": int(f.parent.name.split("_")[1])})
    return folder, dest


# ----- one (row, N) measurement, in a child process pinned to N cores -----------------------------
def _loader(row: str, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(loader, consume(batch) -> number of images) for one row."""
    import torch

    n, batch, device = cfg["workers"], cfg["batch_size"], torch.device(cfg["device"])
    if row in ("workers", "threads"):
        from fastdata.dataset import ShardedDataset
        from fastdata.gpu import Normalize
        from fastdata.loader import DataLoader

        ds = ShardedDataset(cfg["shards"], shuffle=True, decode={"jpg": DecodeRandomResizedCropFlip()},
                            sample_transform=_to_tuple)
        loader = DataLoader(ds, batch_size=batch, num_workers=n, pin_memory=device.type == "cuda",
                            decode_threads=n if row == "threads" else 0)
        norm = Normalize()

        def consume(b: Any) -> int:
            x = norm(b[0].to(device, non_blocking=True))
            if x.dtype != torch.float32 or x.shape[1:] != (3, SIZE, SIZE):
                raise RuntimeError(f"{row}: unexpected batch {x.dtype} {tuple(x.shape)}")
            return len(x)

        return loader, consume
    if row == "torchvision":
        ds = _imagefolder(cfg["images_dir"])
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=n,
                                             pin_memory=device.type == "cuda")

        def consume(b: Any) -> int:
            x = b[0].to(device, non_blocking=True)
            if x.dtype != torch.float32 or x.shape[1:] != (3, SIZE, SIZE):
                raise RuntimeError(f"torchvision: unexpected batch {x.dtype} {tuple(x.shape)}")
            return len(x)

        return loader, consume
    if row in ("gpu", "gpu-threads"):
        return _gpu_loader(cfg, threads=row == "gpu-threads")
    raise ValueError(f"unknown row {row!r}")


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class _RecipeFolder:
    """torchvision's recipe written out (used only where torchvision cannot be imported)."""

    impl = "PIL+torch reimplementation (torchvision not importable here)"

    def __init__(self, root: str, size: int = SIZE):
        import torch

        self.size = size
        self.files = sorted(Path(root).glob("class_*/*.jpg"))
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import numpy as np
        import torch
        from PIL import Image

        path = self.files[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")  # torchvision's pil_loader
        top, left, h, w = crop_params(img.width, img.height, random._inst)  # type: ignore[attr-defined]
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1).float().div(255)  # ToTensor
        return (x - self.mean) / self.std, int(path.parent.name.split("_")[1])


def _imagefolder(root: str, size: int = SIZE) -> Any:
    try:
        import torchvision
        from torchvision import transforms as T
    except Exception:  # noqa: BLE001 - a broken install (ops not loadable) raises RuntimeError
        return _RecipeFolder(root, size)
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(root, transform=tf)
    ds.impl = f"torchvision {torchvision.__version__}"
    return ds


def _gpu_loader(cfg: dict[str, Any], *, threads: bool = False) -> tuple[Any, Any]:
    """decode-gpu's pipeline: encoded JPEGs read by min(N, 4) workers (``threads``: by as many
    threads of this process, ``decode_threads``), decoded and augmented on the GPU inside
    ``CUDAPrefetcher``; raises _Skip with the reason when it cannot run here."""
    import torch

    if cfg["device"] != "cuda":
        raise _Skip("no CUDA device")
    try:
        from fastdata import gpu
        from fastdata.dataset import ShardedDataset
        from fastdata.loader import DataLoader
        from fastdata.prefetch import CUDAPrefetcher

        stage = gpu.Compose(gpu.DecodeImages(keys=["jpg"], device="cuda",
                                             device_decoder=cfg.get("device_decoder", "auto")),
                            gpu.RandomResizedCrop(SIZE),
                            gpu.RandomHorizontalFlip(), gpu.Normalize())
        ds = ShardedDataset(cfg["shards"], shuffle=True, fields=["jpg", "cls"], image_decode="device")
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise _Skip(f"the GPU decode API of this checkout does not fit: {type(e).__name__}: {e}") from e
    readers = min(cfg["workers"], 4)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], num_workers=readers, pin_memory=True,
                        decode_threads=readers if threads else 0)
    # seamless=False: each epoch timed end to end like the other rows; a seamless prefetcher would start
    # this row's next epoch (gpu-threads: in its thread, no fork) while the other rows' epochs are timed
    prefetcher = CUDAPrefetcher(loader, device="cuda", transform=stage, seamless=False)

    def consume(b: Any) -> int:
        x = b["jpg"]
        if not x.is_cuda or x.dtype != torch.float32 or x.shape[1:] != (3, SIZE, SIZE):
            raise RuntimeError(f"gpu: unexpected batch {x.device} {x.dtype} {tuple(x.shape)}")
        return len(x)

    return prefetcher, consume  # CUDAPrefetcher.set_epoch drives the loader


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the epoch's worker processes)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class _Skip(Exception):
    pass


def _epoch(loader: Any, consume: Any, epoch: int, cfg: dict[str, Any]) -> tuple[float, float]:
    """(seconds, CPU ms per image) of one epoch."""
    import torch

    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    c0 = _cpu_s()
    t0 = time.perf_counter()
    count = sum(consume(b) for b in loader)
    if cfg["device"] == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if count != cfg["count"]:
        raise RuntimeError(f"{count} images in epoch {epoch}, expected {cfg['count']}")
    return dt, (_cpu_s() - c0) / count * 1e3


def child(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """All rows at one N in this process (pinned to N cores), epochs interleaved row by row, so a
    change of load on a shared machine hits every row alike."""
    cores = cfg["cores"]
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    sys.path.insert(0, str(REPO))
    deadline = time.perf_counter() + cfg["seconds"]
    res: dict[str, dict[str, Any]] = {}
    runs: dict[str, Any] = {}
    for row in cfg["rows"]:
        res[row] = {"row": row, "workers": cfg["workers"], "cores": len(cores) if cores else None}
        try:
            loader, consume = _loader(row, cfg)
            _epoch(loader, consume, 0, cfg)  # warm-up: page cache, imports, first fork
        except _Skip as e:
            res[row]["skipped"] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 - one failing row must not end the run
            res[row]["error"] = f"{type(e).__name__}: {e}"
            continue
        runs[row] = (loader, consume, [], [])
        res[row]["path"] = getattr(loader, "last_path", None)
        res[row]["impl"] = getattr(getattr(loader, "dataset", None), "impl", None)
        if row in ("gpu", "gpu-threads"):  # what the stage's device_decoder resolved to here
            from fastdata.gpu._codec import device_backend

            res[row]["decoder"] = device_backend(cfg.get("device_decoder", "auto"))
    print(json.dumps(list(res.values())), flush=True)  # partial results survive a kill by the parent
    for rep in range(1, cfg["reps"] + 1):
        if time.perf_counter() > deadline and rep > 1:
            break
        for row, (loader, consume, secs, cpu) in list(runs.items()):
            try:
                dt, c = _epoch(loader, consume, rep, cfg)
            except Exception as e:  # noqa: BLE001
                res[row]["error"] = f"{type(e).__name__}: {e}"
                del runs[row]
                continue
            secs.append(dt)
            cpu.append(c)
            per_s = [cfg["count"] / s for s in secs]
            res[row].update(epoch_s=secs, runs=per_s, images_per_s=statistics.median(per_s),
                            cpu_ms_per_image=statistics.median(cpu), load_avg=os.getloadavg()[0])
        print(json.dumps(list(res.values())), flush=True)
    return list(res.values())


def gil_share(shards: Path, count: int = 256) -> dict[str, float]:
    """One thread loads ``count`` samples of the fastdata rows (``cursor.load``: read, decode, crop,
    flip, to tensor): CPU microseconds per sample in all, and outside the calls that release the GIL
    (Pillow's JPEG decoders' ``decode`` calls, ``Image.resize``, ``Image.transpose``, ``numpy.copyto``), plus
    those calls' own fixed cost measured on 1-pixel inputs (their Python and argument handling,
    GIL held). That bounds the GIL-held time per sample from above (it also counts GIL-free work
    this does not wrap, e.g. ``paste``), except for what those calls do with the GIL held beyond
    their 1-pixel cost (resize's filter coefficients, a few microseconds), so ``1 / held_share``
    bounds how many threads' worth of decoding one process can do. CPU time of the thread (``time.thread_time``), not wall time, so
    other processes' load does not inflate it; best of 3 passes."""
    import collections

    import numpy as np
    import torch
    from PIL import Image

    from fastdata.dataset import ShardedDataset

    torch.set_num_threads(1)
    spent = [0.0]
    calls: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.thread_time() - t
                calls[name] += 1
        return wrapper

    class TimedDecoder:  # Pillow's decoder object, its decode() timed (the GIL-free libjpeg work)
        def __init__(self, decoder: Any):
            self._decoder = decoder
            self.decode = timed("decode", decoder.decode)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._decoder, name)

    def fixed_cost(fn: Any) -> float:
        """CPU seconds per call of ``fn`` (a GIL-releasing call on a 1-pixel input: its overhead)."""
        best = float("inf")
        for _ in range(5):
            t = time.thread_time()
            for _ in range(2000):
                fn()
            best = min(best, (time.thread_time() - t) / 2000)
        return best

    tiny = Image.new("RGB", (2, 2))
    a, b = np.zeros((3, 1, 1), np.uint8), np.zeros((3, 1, 1), np.uint8)
    overhead = {
        "resize": fixed_cost(lambda: tiny.resize((1, 1), Image.Resampling.BILINEAR, box=(0, 0, 1, 1))),
        "transpose": fixed_cost(lambda: tiny.transpose(Image.Transpose.FLIP_LEFT_RIGHT)),
        "copyto": fixed_cost(lambda: np.copyto(a, b)),
        "decode": 0.0,  # argument parsing only; libjpeg's set-up runs without the GIL
    }
    getdecoder, jpeg_decoder = Image._getdecoder, Image.core.jpeg_decoder
    saved = Image.Image.resize, Image.Image.transpose, np.copyto
    ds = ShardedDataset(shards, shuffle=True, decode={"jpg": DecodeRandomResizedCropFlip()},
                        sample_transform=_to_tuple)
    cursor = ds.loader_seam.cursor(ds.loader_seam.epoch_start(1), 0)
    count = min(count, len(cursor.seq))
    sh, loc = cursor.locate(0, count)
    items = list(zip(cursor.seq[:count].tolist(), sh.tolist(), loc.tolist()))
    plain = float("inf")
    for _ in range(3):
        t = time.thread_time()
        for g, s, i in items:
            cursor.load(s, i, g)
        plain = min(plain, time.thread_time() - t)
    # Pillow's own loads go through _getdecoder; fastdata's JPEG short way calls core.jpeg_decoder directly
    Image._getdecoder = lambda *a, **k: (getdecoder(*a, **k) if a[1] == "jpeg"  # type: ignore[assignment]
                                         else TimedDecoder(getdecoder(*a, **k)))
    Image.core.jpeg_decoder = lambda *a, **k: TimedDecoder(jpeg_decoder(*a, **k))
    Image.Image.resize = timed("resize", saved[0])  # type: ignore[method-assign]
    Image.Image.transpose = timed("transpose", saved[1])  # type: ignore[method-assign]
    np.copyto = timed("copyto", saved[2])
    try:
        best = (float("inf"), 0.0)
        for _ in range(3):
            spent[0] = 0.0
            calls.clear()
            t = time.thread_time()
            for g, s, i in items:
                cursor.load(s, i, g)
            total = time.thread_time() - t
            back = sum(n * overhead[name] for name, n in calls.items())
            best = min(best, (total, total - spent[0] + back))
    finally:
        Image._getdecoder, Image.core.jpeg_decoder = getdecoder, jpeg_decoder  # type: ignore[assignment]
        Image.Image.resize, Image.Image.transpose, np.copyto = saved  # type: ignore[method-assign]
    total_us, held_us = best[0] / count * 1e6, best[1] / count * 1e6
    return {"us_per_sample": round(plain / count * 1e6), "us_per_sample_instrumented": round(total_us),
            "held_us_upper": round(held_us), "held_share_upper": round(held_us / total_us, 3),
            "thread_ceiling": round(total_us / held_us, 1), "fixed_costs_us": {k: round(v * 1e6, 2) for k, v in overhead.items()}}


def buffer_cost(reps: int = 40) -> dict[str, dict[str, float]]:
    """ms to fill a batch of 64 / 256 rows of 3x224x224 uint8 (as the pool threads do, NumPy row
    copies) into a fresh tensor per batch vs a ring of three reused ones, while the consumer holds
    the last two batches: the cost of first-touch page faults that a buffer ring avoids."""
    import numpy as np
    import torch

    src = [np.random.default_rng(i).integers(0, 255, (3, SIZE, SIZE), dtype=np.uint8) for i in range(64)]
    out: dict[str, dict[str, float]] = {}
    for rows in (64, 256):
        shape = (rows, 3, SIZE, SIZE)
        res: dict[str, list[float]] = {"fresh": [], "reuse": []}
        for name in ("fresh", "reuse", "fresh", "reuse"):
            ring = [torch.empty(shape, dtype=torch.uint8) for _ in range(3)]
            held: list[torch.Tensor] = []
            ts = []
            for i in range(reps):
                t = time.perf_counter()
                b = torch.empty(shape, dtype=torch.uint8) if name == "fresh" else ring[i % 3]
                arr = b.numpy()
                for j in range(rows):
                    np.copyto(arr[j], src[j % 64])
                ts.append(time.perf_counter() - t)
                held = (held + [b])[-2:]
            res[name].append(statistics.median(ts) * 1e3)
        out[f"batch{rows}"] = {k: round(min(v), 2) for k, v in res.items()}
    return out


def run_child(cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    def fail(msg: str) -> list[dict[str, Any]]:
        return [{"row": row, "workers": cfg["workers"], "error": msg} for row in cfg["rows"]]

    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True,
                              timeout=timeout, cwd=REPO, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("[")]
        if not lines:
            return fail(f"timed out after {timeout:.0f} s")
        got = json.loads(lines[-1])  # the rounds finished before the kill
        for r in got:
            r.setdefault("note", f"killed after {timeout:.0f} s; epochs measured until then")
        return got
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("[")]
    if proc.returncode != 0 or not lines:
        return fail(f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="grid of N (workers = threads = cores)")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--images", type=int, default=None, help="corpus size (default 1024, quick 256)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4,
                    help="tar shards (default 4: hundreds of images each, as 256 MB shards of real photos hold thousands)")
    ap.add_argument("--reps", type=int, default=None, help="timed epochs per row (default 3, quick 1)")
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "fastdata-bench-decode")
    ap.add_argument("--budget", type=float, default=None, help="seconds; configurations past it are skipped")
    ap.add_argument("--quick", action="store_true", help="small corpus, one repetition")
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    ap.add_argument("--device-decoder", default="auto", choices=("auto", "torchvision", "nvimgcodec"),
                    help="JPEG decoder of the gpu rows (auto: torchvision unless FASTDATA_DEVICE_DECODER names another)")
    ap.add_argument("--gil", action="store_true", help="also measure the GIL-held share of one sample's work")
    ap.add_argument("--gil-only", action="store_true", help="only measure the GIL-held share (--gil), no rows")
    ap.add_argument("--buffers", action="store_true", help="only measure fresh vs reused batch buffers")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child(json.loads(args.child))  # prints its results as JSON lines
        return {}
    if args.buffers:
        costs = buffer_cost()
        for k, v in costs.items():
            print(f"{k}: fresh tensor {v['fresh']:.2f} ms, reused {v['reuse']:.2f} ms per batch fill")
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "decode_stage --buffers", "results": costs}, indent=1))
        return costs
    t_start = time.perf_counter()
    sys.path.insert(0, str(REPO))
    import torch

    n = args.images or (256 if args.quick else 1024)
    reps = args.reps or (1 if args.quick else 3)
    images, shards = prepare(args.data, n, args.shards)
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: list[dict[str, Any]] = []
    gil = None
    if args.gil or args.gil_only:
        gil = gil_share(shards)
        print(f"one thread: {gil['us_per_sample']} CPU us per sample, at most {gil['held_us_upper']} us of it with "
              f"the GIL held ({gil['held_share_upper']:.1%}): threads of one process top out near "
              f"{gil['thread_ceiling']}x one core", file=sys.stderr)
    for k, workers in enumerate([] if args.gil_only else args.workers):
        cores = None if available is None else available[:workers]
        if cores is not None and len(cores) < workers:
            print(f"N={workers}: only {len(cores)} cores available; rows share them", file=sys.stderr)
        left = None if args.budget is None else args.budget - (time.perf_counter() - t_start)
        if left is not None and left < 10:
            results += [{"row": row, "workers": workers, "skipped": "time budget spent"} for row in args.rows]
            continue
        # this N's share of what is left; its reps stop early past it (at least one is measured)
        share = 3600.0 if left is None else max(5.0, left / (len(args.workers) - k) - 5)
        cfg = {"rows": args.rows, "workers": workers, "cores": cores, "count": n, "batch_size": args.batch_size,
               "reps": reps, "device": device, "shards": str(shards), "images_dir": str(images), "seconds": share,
               "device_decoder": args.device_decoder}
        for res in run_child(cfg, timeout=share + 20 if left is not None else 7200):
            results.append(res)
            msg = res.get("skipped") or res.get("error") or ("no epoch measured" if "runs" not in res else None) or (
                f"{res['images_per_s']:8.1f} images/s  {res['cpu_ms_per_image']:.2f} CPU ms/image "
                f"({len(res['runs'])} epochs)")
            print(f"N={workers:2d} {res['row']:12s} {msg}", file=sys.stderr)
    paired = {}
    for workers in args.workers:  # threads / workers of the same round: both saw about the same load
        t = next((r for r in results if r["row"] == "threads" and r["workers"] == workers and "runs" in r), None)
        w = next((r for r in results if r["row"] == "workers" and r["workers"] == workers and "runs" in r), None)
        if t and w:
            paired[workers] = statistics.median(a / b for a, b in zip(t["runs"], w["runs"]))
    out = {
        "benchmark": "decode_stage",
        "config": {"images": n, "workers": args.workers, "batch_size": args.batch_size, "shards": args.shards,
                   "reps": reps, "rows": args.rows, "device": device, "size": SIZE, "quick": args.quick,
                   "device_decoder": args.device_decoder},
        "machine": {"cpus": os.cpu_count(), "affinity": len(available) if available else None,
                    "python": platform.python_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                    "load_avg": os.getloadavg()},
        "results": results,
        "threads_over_workers_paired": paired,
        "gil": gil,
        "wall_s": time.perf_counter() - t_start,
    }
    print(table(results))
    if paired:
        print("threads/workers, median of per-round ratios: "
              + ", ".join(f"N={k}: {v:.2f}" for k, v in paired.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return out


def table(results: list[dict[str, Any]]) -> str:
    """images/s per row and N, and threads / workers."""
    by: dict[tuple[str, int], dict[str, Any]] = {(r["row"], r["workers"]): r for r in results}
    ns = sorted({r["workers"] for r in results})
    rows = [r for r in ROWS if any((r, n) in by for n in ns)]
    lines = ["images/s (median)  " + "".join(f"N={n:<10d}" for n in ns)]
    for row in rows:
        cells = []
        for n in ns:
            r = by.get((row, n), {})
            cells.append(f"{r['images_per_s']:<12.0f}" if "images_per_s" in r else f"{'-':<12s}")
        lines.append(f"{row:<19s}" + "".join(cells))
    ratio = []
    for n in ns:
        t, w = by.get(("threads", n), {}), by.get(("workers", n), {})
        ratio.append(f"{t['images_per_s'] / w['images_per_s']:<12.2f}" if "images_per_s" in t and "images_per_s" in w
                     else f"{'-':<12s}")
    lines.append(f"{'threads/workers':<19s}" + "".join(ratio))
    lines.append("CPU ms per image")
    for row in rows:
        cells = []
        for n in ns:
            r = by.get((row, n), {})
            cells.append(f"{r['cpu_ms_per_image']:<12.2f}" if "cpu_ms_per_image" in r else f"{'-':<12s}")
        lines.append(f"{row:<19s}" + "".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
