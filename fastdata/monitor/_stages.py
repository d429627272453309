"""Measuring one pipeline stage at a time: the primitives behind ``fastdata doctor`` and ``fastdata tune``.

CPU stages (read, decode, preprocess, collate) are timed in one thread with ``time.thread_time``:
the CPU seconds one image costs, which a busy machine does not inflate the way wall time is
inflated. A stage run by ``w`` workers on ``c`` cores can then deliver ``min(w, c) / cost`` images/s,
and at a job rate ``r`` it keeps ``r * cost / c`` of the cores busy. Stages whose cost is a
hand-off between processes (the worker -> main queue) and the stages together are measured end to
end in wall time, after a warm-up pass. Device stages are timed with ``torch.cuda.synchronize``.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdata._util import check_int, quantile
from fastdata._util import usable_cores as cores  # noqa: F401 - the name other modules use
from fastdata.decode import ImageDecoder, is_image_field, suffix
from fastdata.errors import DecodeError, FastdataError, MissingFieldError, SourceError
from fastdata.io import is_url, local_path

_LABEL_SUFFIXES = ("cls", "cls2", "index", "inx")


@dataclass(frozen=True)
class Fields:
    """The image field a pipeline decodes and the label field next to it (if any)."""

    image: str
    label: str | None
    encoded: bool  # bytes to decode (tar image members), not stored arrays


def _is_image(f: Any) -> bool:
    """An encoded image (jpg, png, ...) or a stored uint8 (C, H, W) array (``fastdata shard --resize``)."""
    return is_image_field(f.name) or (f.kind == "array" and f.dtype == "uint8" and f.shape is not None
                                      and len(f.shape) == 3)


def _is_label(f: Any) -> bool:
    """A class index: an int field (``cls``, ...) or an integer array holding one value per sample."""
    if f.kind == "int" or suffix(f.name) in _LABEL_SUFFIXES:
        return True
    return (f.kind == "array" and f.dtype is not None and f.dtype.lstrip("<>=|").startswith(("int", "uint"))
            and f.shape is not None and math.prod(f.shape) == 1)


def pick_fields(manifest: Any, image: str | None = None, label: str | None = None) -> Fields:
    """The manifest's first image field and first label field, or the named ones (checked)."""
    names = [f.name for f in manifest.fields]
    by_name = {f.name: f for f in manifest.fields}
    images = [f.name for f in manifest.fields if is_image_field(f.name)]
    images += [f.name for f in manifest.fields if _is_image(f) and f.name not in images]
    if image is None:
        if not images:
            raise FastdataError(f"no image field among the manifest's fields {names}: name one with --field")
        image = images[0]
    elif image not in names:
        raise FastdataError(f"field {image!r} is not in the manifest (fields: {names})")
    elif not _is_image(by_name[image]):
        raise FastdataError(f"field {image!r} is not an image field (an encoded image such as jpg or png, or a "
                            f"uint8 (C, H, W) array); image fields here: {images or 'none'}")
    if label is None:
        label = next((n for n in names if suffix(n) in _LABEL_SUFFIXES), None)
    elif label not in names:
        raise FastdataError(f"label field {label!r} is not in the manifest (fields: {names})")
    elif not _is_label(by_name[label]):
        labels = [f.name for f in manifest.fields if _is_label(f)]
        raise FastdataError(f"label field {label!r} is not a class label (an int field such as cls); "
                            f"label fields here: {labels or 'none'}")
    return Fields(image, label, encoded=by_name[image].kind != "array")


# ------------------------------------------------------------------------------- subset and read

def shard_folder(source: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """The local shard folder of ``source``: its folder when it names the ``manifest.json`` file (as
    ``Manifest.load`` and ``ShardedDataset`` accept), else ``source``; ``~`` and ``file://`` read as
    everywhere. A URL is a :class:`SourceError`: doctor, tune and bench measure a local copy."""
    from fastdata.manifest import MANIFEST_NAME
    from fastdata.io import redact_url

    if isinstance(source, str):
        if is_url(source):
            raise SourceError(f"{redact_url(source)}: a URL; doctor, tune and bench measure a local shard folder "
                              "with manifest.json: measure a local copy of the dataset (its manifest.json and shards)")
        source = local_path(source)
    path = Path(source)
    return path.parent if path.name == MANIFEST_NAME and path.is_file() else source


@dataclass(frozen=True)
class ReadResult:
    samples: int
    cpu_s: float  # thread CPU seconds of reading them
    wall_s: float
    nbytes: int


def copy_subset(source: str | os.PathLike[str], dest: Path, fields: Fields, samples: int) -> ReadResult:
    """Read the first ``samples`` samples of ``source`` (timed) and write them as shards into ``dest``.

    Every later measurement runs on this subset, so a cache for it stays small whatever the
    size of the user's dataset. Each sample is also decoded once (untimed; JPEGs at a reduced scale):
    one that does not load fails here, naming its shard of ``source``, rather than a measurement
    later naming the subset's temporary copy.
    """
    from fastdata.decode import SampleDecoder
    from fastdata.manifest import Manifest
    from fastdata.shards.reader import open_shard
    from fastdata.shards.writer import ShardWriter

    m = Manifest.load(source)
    keep = [fields.image] + ([fields.label] if fields.label else [])
    check = SampleDecoder(draft_size=16)
    cpu = wall = 0.0
    nbytes = count = 0
    with ShardWriter(dest, format=m.format, max_samples=max(16, samples // 8)) as writer:
        for shard in m.shards:
            if count >= samples:
                break
            reader = open_shard(source, shard, format=m.format)
            it = reader.iter_range(0, min(len(reader), samples - count), fields=keep)
            while True:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    sample = next(it)
                except StopIteration:
                    break
                sample = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}
                cpu += time.thread_time() - c0
                wall += time.perf_counter() - t0
                where = Path(source) / shard.name
                missing = [f for f in keep if f not in sample]
                if missing:  # e.g. image fields of two formats (jpg or png): the collate would fail on the subset
                    raise MissingFieldError(f"{where}: sample {sample.get('__key__', '?')!r} has no field "
                                            f"{missing[0]!r} (fields here: {[f.name for f in m.fields]}): doctor and "
                                            "tune measure fields every sample has (--field, --label); samples "
                                            "mixing image formats cannot be batched as one field (re-encode them)")
                check(sample, shard=str(where))  # a DecodeError naming shard, key and field
                value = sample[fields.image]
                nbytes += len(value) if isinstance(value, (bytes, bytearray)) else int(getattr(value, "nbytes", 0))
                writer.write(sample)
                count += 1
            reader.close()
    if count == 0:
        raise FastdataError(f"{source}: no samples to measure")
    return ReadResult(count, cpu, wall, nbytes)


def check_one_batch(source: Any, read: ReadResult, samples: int, batch_size: int) -> None:
    """Refuse a subset smaller than one batch: every batch would have fewer images than the ``batch_size``
    that the step's rate (and so the verdict) is computed for."""
    if read.samples >= batch_size:
        return
    if read.samples < samples:
        raise FastdataError(f"{source} has only {read.samples} samples, fewer than one batch (batch_size="
                            f"{batch_size}, --batch-size): lower the batch size")
    raise FastdataError(f"samples={samples} (--samples) is fewer than one batch (batch_size={batch_size}, "
                        "--batch-size): raise samples or lower the batch size")


# ------------------------------------------------------------------------------- per-image CPU costs

def raw_samples(subset: Path, fields: Fields, n: int) -> list[dict[str, Any]]:
    """Up to ``n`` samples of the subset with their encoded images undecoded (stored arrays, such as
    ``fastdata shard --resize``'s ``img.npy`` in tar shards, and labels decoded)."""
    from fastdata.decode import SampleDecoder
    from fastdata.manifest import Manifest
    from fastdata.shards.reader import open_shard

    m = Manifest.load(subset)
    decode = SampleDecoder({fields.image: None} if fields.encoded else True)
    out: list[dict[str, Any]] = []
    for shard in m.shards:
        reader = open_shard(subset, shard, format=m.format)
        for s in reader.iter_range(0, min(len(reader), n - len(out))):
            s = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()}
            out.append(decode(s, shard=shard.name))
        reader.close()
        if len(out) >= n:
            break
    return out


def decoder(backend: str, draft_size: int | None) -> Callable[[bytes], Any]:
    """The image decoder of a backend: "pil" (fastdata's default: Pillow, reduced-scale JPEG
    decoding where the output is small), "torchcodec" or "torchvision" (that library on the CPU,
    :class:`fastdata.gpu.HostImageDecoder`: a class, so workers receive it under spawn too)."""
    if backend == "pil":
        dec = ImageDecoder(draft_size=draft_size)
        return lambda data: dec.pil(data)
    if backend in ("torchcodec", "torchvision"):
        from fastdata.gpu import DecoderUnavailableError, HostImageDecoder

        try:  # checked here: a decode failure must not look like a broken install
            return HostImageDecoder(backend)
        except DecoderUnavailableError as e:
            raise FastdataError(f"decode {backend!r} needs {backend}, which cannot be used here: {e}") from e
    raise ValueError(f"decode backend must be 'pil', 'torchcodec' or 'torchvision', got {backend!r}")


@dataclass(frozen=True)
class CpuCosts:
    """CPU seconds per image of each worker-side stage, measured in one thread."""

    decode_s: float | None  # None: stored decoded
    preprocess_s: float | None  # None: not applied (stored arrays)
    collate_s: float
    images: int


def cpu_costs(samples: Sequence[dict[str, Any]], fields: Fields, preprocess: Callable[[Any], Any],
              backend: str, batch_size: int) -> CpuCosts:
    """Decode, preprocess and collate ``samples`` once each, timing every stage on its own."""
    from torch.utils.data import default_collate

    decode = decoder(backend, getattr(preprocess, "target_size", None)) if fields.encoded else None
    images: list[Any] = [s[fields.image] for s in samples]
    dec_s = None
    if decode is not None:
        _named(decode, samples[0], fields.image)  # warm-up (library loading)
        c0 = time.thread_time()
        images = [_named(decode, s, fields.image) for s in samples]
        dec_s = (time.thread_time() - c0) / len(images)
    pre_s: float | None = None
    outs = images
    if fields.encoded:  # ShardedDataset applies ``preprocess`` to image fields (jpg, png, ...), not to arrays
        preprocess(images[0])
        c0 = time.thread_time()
        outs = [preprocess(img) for img in images]
        pre_s = (time.thread_time() - c0) / len(outs)
    outs = [torch.as_tensor(o) for o in outs]
    items = [{fields.image: o, **({fields.label: int(s.get(fields.label, 0) or 0)} if fields.label else {})}
             for o, s in zip(outs, samples)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in DataLoader workers; with 2 threads on a busy 2-core machine the calling
    try:  # thread spin-waits for the other: 0.03 ms of stacking per 224 px image became 3.7 ms of CPU
        c0 = time.thread_time()
        for i in range(0, len(items), batch_size):
            default_collate(items[i:i + batch_size])
        col_s = (time.thread_time() - c0) / len(items)
    finally:
        torch.set_num_threads(threads)
    return CpuCosts(dec_s, pre_s, col_s, len(items))


def _named(decode: Callable[[Any], Any], sample: dict[str, Any], field: str) -> Any:
    """``decode(sample[field])``; a failure names the sample and field (the decoder's own message does not)."""
    try:
        return decode(sample[field])
    except FastdataError:
        raise
    except Exception as e:  # noqa: BLE001  any decoder failure on shard bytes
        raise DecodeError(f"sample {sample.get('__key__', '?')!r} field {field!r}: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------- loaders end to end

@dataclass(frozen=True)
class LoaderRun:
    """A timed pass of a loader after one warm-up pass (workers started, caches warm)."""

    rate: float  # images/s over the timed pass
    images: int
    interval_p50_s: float  # time between consecutive batches
    interval_p99_s: float
    main_cpu_s: float  # CPU seconds of this process (all threads) per image
    path: str | None  # fastdata.DataLoader.last_path


def time_loader(loader: Any, *, warmup: str = "start", passes: int = 1, max_batches: int | None = None) -> LoaderRun:
    """The fastest of ``passes`` timed passes of ``loader`` after a warm-up.

    ``warmup``: "start" (the first ``num_workers + 1`` batches: the workers are up), "pass" (a whole
    pass, e.g. to fill a cache) or "none". The best pass is the one least disturbed by other
    processes on a shared machine.
    """
    if warmup != "none":
        limit = None if warmup == "pass" else getattr(loader, "num_workers", 0) + 1
        for i, _ in enumerate(loader):
            if limit is not None and i + 1 >= limit:
                break
    runs = [_one_pass(loader, max_batches) for _ in range(passes)]
    return max(runs, key=lambda r: r.rate)


def _one_pass(loader: Any, max_batches: int | None) -> LoaderRun:
    images, intervals = 0, []
    c0 = time.process_time()
    t0 = last = time.perf_counter()
    for i, batch in enumerate(loader):
        now = time.perf_counter()
        intervals.append(now - last)
        last = now
        images += batch_images(batch)
        if max_batches is not None and i + 1 >= max_batches:
            break
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    intervals.sort()
    return LoaderRun(images / wall if wall > 0 else 0.0, images, quantile(intervals, 0.5), quantile(intervals, 0.99),
                     cpu / max(images, 1), getattr(loader, "last_path", None))


def batch_images(batch: Any) -> int:
    """Number of samples in a collated batch (dict, sequence or tensor)."""
    if isinstance(batch, dict):
        batch = next((v for k, v in batch.items() if k != "__key__"), None)
    elif isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return int(batch.shape[0])
    return len(batch) if hasattr(batch, "__len__") else 1


class _ConstantSamples(torch.utils.data.IterableDataset):
    """Yields ``n`` fresh preprocessed-size samples: isolates collate and the worker hand-off."""

    def __init__(self, n: int, shape: tuple[int, ...], fields: Fields) -> None:
        self.n, self.shape, self.fields = n, shape, fields

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            sample = {self.fields.image: torch.full(self.shape, i % 251, dtype=torch.uint8)}
            if self.fields.label:
                sample[self.fields.label] = i % 10
            yield sample


def handoff_run(n: int, shape: tuple[int, ...], fields: Fields, batch_size: int, workers: int) -> LoaderRun:
    """Collate plus the worker -> main hand-off, measured with samples that cost nothing to make."""
    loader = torch.utils.data.DataLoader(_ConstantSamples(n, shape, fields), batch_size=batch_size,
                                         num_workers=workers, persistent_workers=workers > 0)
    try:
        return time_loader(loader)
    finally:
        shutdown_workers(loader)


def shutdown_workers(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now (torch keeps them until the loader is collected)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


# ------------------------------------------------------------------------------- training steps

class SyntheticStep:
    """A training step that keeps the device busy for ``ms`` milliseconds and nothing else.

    On CUDA it queues a spin kernel (``torch.cuda._sleep``, calibrated once), so the host runs
    ahead like with a real model; on the CPU it sleeps, leaving the cores to the loader, as a
    GPU-bound step would.
    """

    def __init__(self, ms: float, device: torch.device) -> None:
        if not ms > 0:
            raise ValueError(f"step_ms must be > 0, got {ms!r}")
        self.ms, self.device = float(ms), device
        self._cycles = None
        if device.type == "cuda" and hasattr(torch.cuda, "_sleep"):
            self._cycles = int(ms * _cycles_per_ms(device))

    def __call__(self, batch: Any) -> None:
        if self._cycles is not None:
            torch.cuda._sleep(self._cycles)
        else:
            time.sleep(self.ms / 1e3)

    def __repr__(self) -> str:
        return f"synthetic {self.ms:g} ms"


def _cycles_per_ms(device: torch.device) -> float:
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(10_000_000)
        torch.cuda.synchronize()
        return 10_000_000 / ((time.perf_counter() - t0) * 1e3)


def torchvision_model(name: str, num_classes: int = 1000) -> torch.nn.Module:
    """A torchvision model by name with random weights (nothing is downloaded)."""
    try:
        import torchvision
    except Exception as e:  # a broken install raises RuntimeError/OSError, not only ImportError
        raise FastdataError(f"--model {name!r} needs torchvision, which cannot be imported here: {e}") from e
    try:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError:
        known = ", ".join(sorted(torchvision.models.list_models(torchvision.models))[:12])
        raise ValueError(f"unknown torchvision model {name!r} (e.g. {known}, ...)") from None


class ModelStep:
    """One ``fastdata.TrainStep`` (SGD, cross-entropy) of a model: a torchvision name (random weights)
    or the user's own ``torch.nn.Module``."""

    def __init__(self, model: str | torch.nn.Module, device: torch.device, fields: Fields,
                 num_classes: int = 1000) -> None:
        from fastdata.train import TrainStep

        self.name = model if isinstance(model, str) else type(model).__name__
        module = torchvision_model(model, num_classes) if isinstance(model, str) else model
        module = module.to(device)
        if device.type == "cuda":
            module = module.to(memory_format=torch.channels_last)
        self.device, self.fields, self.num_classes = device, fields, num_classes
        self.model = module
        self.step = TrainStep(module, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9),
                              torch.nn.functional.cross_entropy, input_key=fields.image, target_key="__target__")

    def __call__(self, batch: dict[str, Any]) -> Any:
        x = batch[self.fields.image]
        label = batch.get(self.fields.label) if self.fields.label else None
        if not isinstance(label, torch.Tensor):
            label = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return self.step({self.fields.image: x, "__target__": label.to(torch.long) % self.num_classes})

    def __repr__(self) -> str:
        return f"{self.name} (TrainStep)"


def make_step(model: str | torch.nn.Module | None, step_ms: float | None, device: torch.device, fields: Fields) -> Any:
    """The training step to measure, or None when neither a model nor a step time is given."""
    if model is not None and step_ms is not None:
        raise ValueError("give a model or a step time, not both")
    if model is not None:
        return ModelStep(model, device, fields)
    if step_ms is not None:
        return SyntheticStep(step_ms, device)
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Any, batch: Any, device: torch.device, *, min_s: float = 0.5, max_steps: int = 30) -> float:
    """Seconds per call of ``step(batch)`` on a resident batch (median of up to ``max_steps``, after 2 warm-ups)."""
    for _ in range(2):
        step(batch)
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_steps and (len(times) < 3 or time.perf_counter() - start < min_s):
        t0 = time.perf_counter()
        step(batch)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------- device stages

def measure_h2d(nbytes: int, *, repeats: int) -> dict[str, float]:
    """Host-to-device GB/s of one ``nbytes`` copy from pinned and from pageable memory (medians); needs CUDA."""
    check_int("nbytes", nbytes, 1)
    check_int("repeats", repeats, 1)
    if not torch.cuda.is_available():  # torch's own error is an AssertionError, "Torch not compiled with CUDA"
        raise FastdataError("measure_h2d needs a CUDA device; none is available here")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = {}
    for label, pin in (("pinned", True), ("pageable", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        dst.copy_(src, non_blocking=pin)  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rates[label] = nbytes / statistics.median(times) / 1e9
    return rates


def time_pack(batch: torch.Tensor, repeats: int = 5) -> float:
    """Seconds to pack one pageable batch into pinned memory (the prefetcher's staging copy)."""
    dst = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
    dst.copy_(batch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(batch)
        times.append(time.perf_counter() - t0)
    return min(times)  # the capacity: the copy undisturbed by other processes


def time_transform(transform: Callable[[Any], Any], batch: Any, device: torch.device, repeats: int = 10) -> float:
    """Seconds per call of a batch transform on ``device``: the fastest of ``repeats`` (its capacity,
    undisturbed by other processes). On the CPU it runs with one torch thread, so the figure is the
    CPU seconds it costs, like the other CPU stages: with several intra-op threads on a busy machine
    every parallel region waits for the scheduler to run all of them (a 0.2 ms op took 20-30 ms at a
    load average of 7 on 2 cores)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        transform(batch)
        sync(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            transform(batch)
            sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return min(times)


def probe_gpu_decode(encoded: Sequence[bytes], device: torch.device) -> tuple[float | None, str]:
    """Images/s of the device decode stage a pipeline built with defaults runs (``fastdata.gpu.DecodeImages``,
    whose ``device_decoder="auto"`` is the environment variable ``FASTDATA_DEVICE_DECODER``, else TorchCodec)
    on ``encoded``, or None and why not; the note names the decoder."""
    from fastdata.dataset import EncodedImage, PackedImages
    from fastdata.gpu import DecodeImages

    try:
        stage = DecodeImages(device=device if device.type == "cuda" else "cpu")
        name = stage.resolved_device_decoder
    except Exception as e:  # noqa: BLE001  a probe: a decoder that cannot load is reported, with the reason
        return None, f"device decoder not available: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if device.type != "cuda":
        return None, f"no CUDA device (device decoder: {name})"

    def batch(datas: Sequence[bytes]) -> dict[str, Any]:
        return {"img": PackedImages.pack([EncodedImage(bytes(b), shard="doctor-probe", key=str(i), index=i, epoch=0)
                                          for i, b in enumerate(datas)])}
    try:
        full = batch(encoded)
        stage(batch(encoded[:4]))  # warm-up (library loading, decoder state)
        torch.cuda.synchronize(device)
        host = stage.host_decoded
        t0 = time.perf_counter()
        stage(full)
        torch.cuda.synchronize(device)
        rate = len(encoded) / (time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  a probe: any failure means "not available here", with the reason
        return None, (f"device decoder {name}: not available: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120] if str(e) else ''}")
    on_host = stage.host_decoded - host
    where = f"; {on_host} of {len(encoded)} images decoded on the host" if on_host else ""
    return rate, f"DecodeImages with device decoder {name} on the GPU{where}"
