"""Stage attribution: which stage bounds a job, by how much, and what to change (``fastdata doctor``).

``diagnose(source, DoctorOptions(...))`` copies the first ``samples`` samples of ``source`` into a
temporary shard folder (timing the read), then measures on that subset:

- each stage on its own: decode, preprocess and collate in one thread (CPU seconds per image),
  collate + the worker -> main hand-off with samples that cost nothing to make, packing a batch
  into pinned memory, the host-to-device copy, the GPU transforms (``Normalize``), and the training
  step on a resident batch;
- together: the loader alone with the configured workers, the same with more workers (never more
  than the cores), the thread decoder on as many cores (``decode_threads``, no worker processes),
  the loader from a filled cache, and the whole job (loader -> CUDAPrefetcher -> step) under a
  :class:`StallMeter`.

A stage's capacity is the images/s it could deliver alone with the parallelism it has; its use is
the share of the cores (or of the GPU, or of the copy engine) it keeps busy at the job's measured
rate. The job is loader-bound when it waited for input more than ``LOADER_BOUND_SHARE`` of the time;
the bounding stage is then the input stage of least capacity, otherwise the training step. Every
recommendation quotes the measurement it rests on.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastdata.monitor import _stages as st

log = logging.getLogger(__name__)
from fastdata.monitor._stall import StallMeter, StallReport

TOGETHER = "loader: the stages together"  # the row measuring the worker-side stages as one
DECODE_BACKENDS = ("pil", "torchcodec", "torchvision", "device")
MAX_DEPTH = 8  # the deepest prefetch queue doctor recommends (each batch ahead holds pinned and device memory)


@dataclass(frozen=True)
class DoctorOptions:
    """The pipeline to measure (the loader settings of the job) and the step it feeds."""

    field: str | None = None  # image field (default: the manifest's first)
    label: str | None = None  # label field (default: the first cls-like field)
    size: int = 224  # ResizeCenterCrop output side
    batch_size: int = 32
    num_workers: int = 2
    depth: int = 2  # CUDAPrefetcher depth
    samples: int = 512  # samples copied from the source and measured
    model: str | None = None  # torchvision model name (random weights)
    step_ms: float | None = None  # or a synthetic step of this duration
    device: str | None = None  # default: CUDA when available
    decode: str = "pil"  # "pil", "torchcodec", "torchvision" (CPU decoders) or "device" (the prefetcher's transform)
    job_steps: int = 20  # training steps of the whole-job measurement
    device_decode: bool | None = None  # measure the device-decode input path (None: on CUDA only)

    def __post_init__(self) -> None:
        for name in ("size", "batch_size", "depth", "samples", "job_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {self.num_workers!r}")
        if self.job_steps < 2:  # the rate leaves out the first step (start-up): one step measures nothing
            raise ValueError(f"job_steps must be >= 2 (the first step is left out of the rate), got {self.job_steps}")
        step = self.step_ms  # a day at most: inf slept into an OverflowError, 1e12 ms was a 31-year step
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                                 or not 0 < step <= 86_400_000):
            raise ValueError(f"step_ms must be a finite number > 0 (milliseconds, at most a day), got {step!r}")
        for name in ("field", "label", "model", "device"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a str or None, got {value!r}")
        if self.device_decode is not None and not isinstance(self.device_decode, bool):
            raise ValueError(f"device_decode must be a bool or None, got {self.device_decode!r}")
        if self.model is not None and self.step_ms is not None:
            raise ValueError("give a model or a step time (step_ms), not both")
        if self.decode not in DECODE_BACKENDS:
            raise ValueError(f"decode must be one of {DECODE_BACKENDS}, got {self.decode!r}")


@dataclass(frozen=True)
class StageRow:
    """One line of the table: a stage's capacity and what it uses at the job's rate."""

    name: str
    capacity: float | None  # images/s; None: does not apply here
    uses: float | None  # share of ``resource`` busy at the job's rate
    resource: str  # "cores", "GPU", "copy engine"
    detail: str
    input_stage: bool = True


@dataclass
class Diagnosis:
    """Everything ``fastdata doctor`` measured, and its verdict."""

    options: DoctorOptions
    device: str
    cores: int
    rows: list[StageRow]
    verdict: str  # "loader-bound", "compute-bound" or "input only" (no step given)
    bound: str  # the stage that bounds the job
    job_rate: float | None  # images/s of the whole job
    step_rate: float | None  # images/s of the step alone
    wait_share: float | None
    speedup_if_fed: float | None  # step alone / job: by how much the job is loader-bound
    recommendations: list[str]
    measurements: dict[str, Any] = field(default_factory=dict)
    stall: StallReport | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (what ``fastdata doctor --json`` prints under ``diagnosis``)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("options", "rows", "stall")}
        out["options"] = asdict(self.options)
        out["rows"] = [asdict(r) for r in self.rows]
        out["stall"] = None if self.stall is None else self.stall.to_dict()
        return out


def _dataset(subset: Path, fields: st.Fields, preprocess: Any, backend: str, cache: Path | None = None) -> Any:
    """The dataset measured: shuffled, as training reads it and as ``python_snippet`` prints it."""
    from fastdata.dataset import ShardedDataset

    keep = [fields.image] + ([fields.label] if fields.label else [])
    if backend == "device":  # images travel encoded; the prefetcher's transform decodes them (device_transform)
        return ShardedDataset(subset, shuffle=True, fields=keep, image_decode="device")
    decode: Any = True
    if backend != "pil" and fields.encoded:
        decode = {fields.image: st.decoder(backend, None)}
    return ShardedDataset(subset, shuffle=True, fields=keep, preprocess=preprocess, decode=decode, cache=cache)


def device_transform(fields: st.Fields, preprocess: Any, device: torch.device) -> Any:
    """The device-side equivalent of decode + ``ResizeCenterCrop`` + ``Normalize``, for ``image_decode="device"``."""
    from fastdata.gpu import CenterCrop, Compose, DecodeImages, Normalize, Resize

    return Compose(DecodeImages(keys=[fields.image], device=device), Resize(preprocess.resize),
                   CenterCrop(preprocess.size), Normalize(keys=[fields.image], channels_last=device.type == "cuda"))


def no_step(batch: Any) -> None:
    """The step of an input-side measurement: consume the batch, compute nothing."""


def _loader(ds: Any, batch_size: int, workers: int, threads: int = 0) -> Any:
    from fastdata.loader import DataLoader

    # the loader python_snippet prints: the default next-epoch preload (every measurement closes its loader
    # at once, so preloading workers do not load on into the next one) and drop_last=False (with it, a subset
    # of a few batches per worker would lose a batch's worth of samples per worker, or all its batches)
    return DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0 and not threads,
                      decode_threads=threads)


def _close(loader: Any) -> None:
    st.shutdown_workers(loader)


def run_job(ds: Any, opts: DoctorOptions, device: torch.device, step: Any, transform: Any,
            workers: int | None = None, depth: int | None = None, sample_gpu: bool = False, threads: int = 0,
            ) -> tuple[float, StallReport]:
    """Images/s of loader -> CUDAPrefetcher -> step over ``job_steps`` steps, and the StallMeter's report.

    The rate leaves out the first batch (worker start-up) and its step: images after it over the time after it.
    ``threads``: the loader's ``decode_threads`` (0: worker processes).
    """
    from fastdata.prefetch import CUDAPrefetcher

    loader = _loader(ds, opts.batch_size, opts.num_workers if workers is None else workers, threads)
    meter = StallMeter(sample_gpu=sample_gpu and device.type == "cuda")
    images = first = 0
    first_step_s = 0.0  # the first batch's step, left out with the batch (warm-up, compilation)
    try:
        with CUDAPrefetcher(loader, device=device, depth=opts.depth if depth is None else depth,
                            transform=transform) as batches:
            steps, out = 0, None
            while steps < opts.job_steps:
                before = steps
                for batch in meter.wrap(batches):
                    t0 = time.perf_counter()
                    out = step(batch)
                    n = st.batch_images(batch)
                    images += n
                    if not first:
                        first, first_step_s = n, time.perf_counter() - t0
                    steps += 1
                    if steps >= opts.job_steps:
                        break
                if steps == before:
                    raise ValueError("the loader yielded no batch: fewer samples than one batch?")
            del out
            st.sync(device)
    finally:
        _close(loader)
    rep = meter.report()
    timed = rep.wall_s - rep.first_wait_s - first_step_s
    return ((images - first) / timed if timed > 0 else 0.0), rep


def _have_nvml() -> bool:
    try:
        import pynvml  # noqa: F401  nvidia-ml-py, optional
    except ImportError:
        return False
    return True


def _device_decode(subset: Path, fields: st.Fields, pre: Any, opts: DoctorOptions, device: torch.device,
                   norm: Any) -> dict[str, Any]:
    """The input side (loader -> prefetcher -> transforms, no step) with CPU decode and with device decode."""
    cpu = run_job(_dataset(subset, fields, pre, opts.decode), opts, device, no_step, norm)[0]
    try:
        transform = device_transform(fields, pre, device)
        dev = run_job(_dataset(subset, fields, pre, "device"), opts, device, no_step, transform)[0]
    except Exception as e:  # noqa: BLE001  a measurement of an option: its failure is reported, not fatal
        return {"images/s": None, "cpu images/s": cpu, "note": f"device decode failed: {type(e).__name__}: {e}"}
    name = transform.transforms[0].resolved_device_decoder
    return {"images/s": dev, "cpu images/s": cpu, "note": "ShardedDataset(image_decode='device') + "
            f"fastdata.gpu.Compose(DecodeImages (device decoder {name}), Resize, CenterCrop, Normalize) in the "
            "CUDAPrefetcher"}


def diagnose(source: str | os.PathLike[str], opts: DoctorOptions) -> Diagnosis:
    """Measure every stage of the pipeline ``opts`` describes over ``source`` (see the module docstring)."""
    from fastdata.gpu import Normalize
    from fastdata.manifest import Manifest
    from fastdata.prefetch import resolve_device
    from fastdata.transforms import ResizeCenterCrop

    if not isinstance(opts, DoctorOptions):
        raise TypeError(f"opts must be a fastdata.monitor.DoctorOptions, got {type(opts).__name__}")
    if opts.decode == "device":
        raise ValueError("doctor measures a CPU decode pipeline (decode 'pil', 'torchcodec' or 'torchvision'); decoding on the "
                         "device is measured beside it where CUDA is available")
    device = resolve_device(opts.device)
    source = st.shard_folder(source)  # the shards are read from the folder, also when given its manifest.json
    ncores = st.cores()
    workers = opts.num_workers
    par = max(1, min(workers, ncores))
    fields = st.pick_fields(Manifest.load(source), opts.field, opts.label)
    pre = ResizeCenterCrop(opts.size)
    step = st.make_step(opts.model, opts.step_ms, device, fields)  # first: a bad model name fails fast
    B = opts.batch_size
    meas: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fastdata-doctor-") as tmp:
        subset = Path(tmp) / "subset"
        read = st.copy_subset(source, subset, fields, opts.samples)
        log.info("doctor: read %d samples; timing decode, preprocess and collate", read.samples)
        raws = st.raw_samples(subset, fields, min(64, read.samples))
        costs = st.cpu_costs(raws, fields, pre, opts.decode, B)
        st.check_one_batch(source, read, opts.samples, B)  # after cpu_costs: an image that does not decode is named
        shape = (3, *pre.size) if fields.encoded else tuple(torch.as_tensor(raws[0][fields.image]).shape)
        handoff = st.handoff_run(read.samples, shape, fields, B, workers)
        ds = _dataset(subset, fields, pre, opts.decode)
        loader = _loader(ds, B, workers)
        try:
            lrun = st.time_loader(loader, passes=2)
        finally:
            _close(loader)
        meas["loader"] = asdict(lrun)
        log.info("doctor: loader with %d workers: %.0f images/s", workers, lrun.rate)
        more = min(ncores, max(2, 2 * workers))  # more workers, never more than the cores; above them: the cores
        if workers > ncores or (workers < ncores and more > workers):
            loader = _loader(ds, B, more)
            try:
                meas["scaling"] = {"workers": [workers, more], "rate": [lrun.rate, st.time_loader(loader, passes=2).rate]}
            finally:
                _close(loader)
        if workers > 0:  # the thread decoder on the same cores: same batches, no worker processes
            loader = _loader(ds, B, workers, threads=par)
            try:
                trun = st.time_loader(loader, passes=2)
            finally:
                _close(loader)
            meas["threads"] = {"decode_threads": par, **asdict(trun)}
            log.info("doctor: thread decoder, %d threads: %.0f images/s", par, trun.rate)
        cached_loader = _loader(_dataset(subset, fields, pre, opts.decode, cache=Path(tmp) / "cache"), B, workers)
        try:
            crun = st.time_loader(cached_loader, warmup="pass", passes=3)  # the warm-up fills the cache
        finally:
            _close(cached_loader)
        meas["cached"] = asdict(crun)
        log.info("doctor: loader from a filled cache: %.0f images/s", crun.rate)

        batch = next(iter(_loader(ds, B, 0)))
        img = batch[fields.image]
        bpi = img[0].numel() * img.element_size()
        pack_s = h2d = None
        if device.type == "cuda":
            pack_s = st.time_pack(img)
            h2d = st.measure_h2d(img.numel() * img.element_size(), repeats=5)["pinned"]
            meas["h2d_pinned_GBps"] = h2d
        dev_batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        norm = Normalize(keys=[fields.image], channels_last=device.type == "cuda")
        t_norm = st.time_transform(norm, dev_batch, device)
        if fields.encoded:
            gpu_rate, gpu_note = st.probe_gpu_decode([r[fields.image] for r in raws], device)
            meas["nvjpeg_probe"] = {"images/s": gpu_rate, "note": gpu_note}
            if opts.device_decode or (opts.device_decode is None and device.type == "cuda"):
                meas["gpu_decode"] = _device_decode(subset, fields, pre, opts, device, norm)

        step_rate = job_rate = None
        stall = None
        if step is not None:
            step_rate = B / st.time_step(step, norm(dev_batch), device)
            log.info("doctor: training step alone: %.0f images/s; now the whole job", step_rate)
            job_rate, stall = run_job(ds, opts, device, step, norm, sample_gpu=_have_nvml())
    rate_for_use = job_rate if job_rate is not None else lrun.rate
    per_image = read.cpu_s / read.samples + (costs.decode_s or 0.0) + (costs.preprocess_s or 0.0) + costs.collate_s
    meas["loader_predicted"] = par / per_image  # what the worker stages' CPU costs allow on ``par`` cores
    meas["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meas["samples"] = read.samples  # measured: fewer than opts.samples when the source is smaller

    def use(cost_s: float | None, per: float = 1.0) -> float | None:
        return None if cost_s is None else rate_for_use * cost_s / per

    cpu = "cores"
    rows = [
        StageRow("shard read", par * read.samples / read.cpu_s if read.cpu_s > 0 else None,
                 use(read.cpu_s / read.samples, ncores), cpu,
                 f"{read.nbytes / max(read.wall_s, 1e-9) / 1e6:.0f} MB/s, {read.nbytes / read.samples / 1e3:.0f} kB/image "
                 f"(first {read.samples} samples; repeated reads may come from the page cache)"),
        StageRow("decode", par / costs.decode_s if costs.decode_s else None, use(costs.decode_s, ncores), cpu,
                 {"pil": "Pillow, reduced-scale JPEG decoding", "torchcodec": "torchcodec.decoders, CPU",
                  "torchvision": "torchvision.io.decode_image"}[opts.decode]
                 if costs.decode_s else "stored decoded"),
        StageRow("preprocess", par / costs.preprocess_s if costs.preprocess_s else None,
                 use(costs.preprocess_s, ncores), cpu,
                 repr(pre) if costs.preprocess_s else f"not applied: {fields.image} is stored as an array"),
        StageRow("collate + worker hand-off", handoff.rate, use(costs.collate_s + handoff.main_cpu_s, ncores), cpu,
                 f"{workers} workers -> main process" if workers else "in process (num_workers=0)"),
        StageRow(TOGETHER, lrun.rate,
                 use((read.cpu_s / read.samples) + (costs.decode_s or 0) + (costs.preprocess_s or 0)
                     + costs.collate_s + lrun.main_cpu_s, ncores), cpu, f"measured together, {workers} workers, batch {B}"),
        StageRow("pin/pack", B / pack_s if pack_s else None, use(pack_s, B * ncores) if pack_s else None, cpu,
                 "one pageable batch into pinned memory" if pack_s else "no CUDA: batches stay in host memory"),
        StageRow("host-to-device copy", h2d * 1e9 / bpi if h2d else None, use(bpi / (h2d * 1e9)) if h2d else None,
                 "copy engine", f"pinned, {h2d:.1f} GB/s, {bpi / 1e3:.0f} kB/image" if h2d else "no CUDA"),
        StageRow("GPU transforms" if device.type == "cuda" else "device transforms (on the CPU)", B / t_norm,
                 use(t_norm, B if device.type == "cuda" else B * ncores), "GPU" if device.type == "cuda" else cpu,
                 "Normalize" + (" (channels_last)" if device.type == "cuda"
                                else ", in the prefetch thread (timed with one torch thread)")),
    ]
    if step is not None:
        rows.append(StageRow("training step", step_rate, job_rate / step_rate if step_rate and job_rate else None,
                             "GPU" if device.type == "cuda" else "step time", f"{step!r}, batch {B}, resident batch",
                             input_stage=False))
    singles = [r for r in rows if r.input_stage and r.capacity and r.name != TOGETHER]
    weakest = min(singles, key=lambda r: r.capacity or math.inf)
    if lrun.rate < 0.5 * meas["loader_predicted"]:  # the stages' summed costs do not explain it: the loader as a whole
        weakest = rows[4]
    diag = Diagnosis(opts, str(device), ncores, rows, "input only", weakest.name, job_rate, step_rate,
                     None, None, [], meas, stall)
    if stall is not None and step_rate and job_rate:
        diag.wait_share = stall.wait_share
        diag.speedup_if_fed = max(1.0, step_rate / job_rate)
        diag.verdict = "loader-bound" if stall.loader_bound else "compute-bound"
        if not stall.loader_bound:
            diag.bound = "training step"
    diag.recommendations = recommend(diag, lrun, crun, costs, weakest, par)
    return diag


def recommend(d: Diagnosis, lrun: st.LoaderRun, crun: st.LoaderRun, costs: st.CpuCosts, weakest: StageRow,
              par: int) -> list[str]:
    """Changes that the measurements just made support, each quoting its measurement."""
    o = d.options
    out: list[str] = []
    if d.verdict == "compute-bound":
        out.append(f"compute-bound: the loader alone delivers {lrun.rate:,.0f} images/s, {lrun.rate / d.job_rate:.1f}x "
                   f"what the job consumed ({d.job_rate:,.0f}); input changes will not make this job faster")
        return out
    scaling = d.measurements.get("scaling")
    if o.num_workers > d.cores and scaling:
        (w1, w2), (r1, r2) = scaling["workers"], scaling["rate"]
        if r2 >= 0.95 * r1:
            out.append(f"num_workers={w2}: {w1} workers on {d.cores} cores measured {r1:,.0f} images/s, {w2} measured "
                       f"{r2:,.0f}: the extra workers cost memory and start-up time and add nothing")
        else:
            out.append(f"num_workers={w1} exceeds the {d.cores} cores but measured faster than {w2} "
                       f"({r1:,.0f} vs {r2:,.0f} images/s): keep it; more would not help")
    elif o.num_workers >= d.cores:
        out.append(f"num_workers={o.num_workers} already uses all {d.cores} cores: more workers cannot help")
    elif scaling:
        (w1, w2), (r1, r2) = scaling["workers"], scaling["rate"]
        if r2 > 1.1 * r1:
            out.append(f"num_workers={w2}: the loader measured {r1:,.0f} -> {r2:,.0f} images/s ({r2 / r1:.2f}x) "
                       f"going from {w1} to {w2} workers on {d.cores} cores")
        else:
            out.append(f"more workers did not help: {w1} -> {w2} workers measured {r1:,.0f} -> {r2:,.0f} images/s "
                       f"(the {d.cores} cores are busy)")
    if crun.path == "cached" and crun.rate > 1.1 * lrun.rate:
        out.append(f"cache= on ShardedDataset: from a filled cache the loader measured {crun.rate:,.0f} images/s, "
                   f"{crun.rate / lrun.rate:.1f}x uncached ({lrun.rate:,.0f}); the first epoch fills it "
                   f"(`fastdata cache build` does it ahead of time)")
    threads = d.measurements.get("threads")
    if threads is not None and threads["rate"]:
        t, n = threads["rate"], threads["decode_threads"]
        if t > 1.1 * lrun.rate:
            out.append(f"decode_threads={n} on DataLoader: the thread decoder (no worker processes, samples written "
                       f"straight into the batch) measured {t:,.0f} images/s, {t / lrun.rate:.2f}x the {o.num_workers} "
                       f"worker processes ({lrun.rate:,.0f}) on the same cores; the batches stay the same "
                       f"(num_workers={o.num_workers} still sets their order)")
        else:
            d.measurements["threads_note"] = (
                f"thread decoder: decode_threads={n} measured {t:,.0f} images/s against {lrun.rate:,.0f} with "
                f"{o.num_workers} worker processes: no gain here")
    gpu = d.measurements.get("gpu_decode")
    if gpu is not None and gpu["images/s"]:
        if gpu["images/s"] > 1.1 * gpu["cpu images/s"]:
            out.append(f"decode on the device: the input side measured {gpu['images/s']:,.0f} images/s with "
                       f"{gpu['note']}, {gpu['images/s'] / gpu['cpu images/s']:.1f}x CPU decoding "
                       f"({gpu['cpu images/s']:,.0f}, same {o.num_workers} workers)")
        else:
            d.measurements["gpu_decode_note"] = (
                f"device decode: measured {gpu['images/s']:,.0f} images/s against {gpu['cpu images/s']:,.0f} with CPU "
                "decoding: no gain here")
    else:
        probe = d.measurements.get("nvjpeg_probe") or {}
        why = gpu["note"] if gpu is not None else probe.get("note", "not measured")
        rate = f": {probe['images/s']:,.0f} images/s alone" if probe.get("images/s") else ""
        d.measurements["gpu_decode_note"] = f"device decode: {why}{rate}"
    if d.step_rate and d.job_rate and d.stall is not None:
        step_s = o.batch_size / d.step_rate
        gaps = (f"batches arrive p50 {lrun.interval_p50_s * 1e3:.1f} ms / p99 {lrun.interval_p99_s * 1e3:.1f} ms "
                f"apart against {step_s * 1e3:.1f} ms steps")
        need = max(o.depth + 1, math.ceil(lrun.interval_p99_s / step_s) + 1)
        if d.stall.periodic is not None:
            need = max(need, d.stall.periodic.period + 1)
        teeth = f"; {d.stall.periodic.describe()}" if d.stall.periodic else ""
        if need > MAX_DEPTH:  # batches held ahead cost pinned and device memory: past this, fix the loader
            teeth += f"; gaps of {need - 1} steps are longer than any sensible queue (capped at {MAX_DEPTH})"
            need = MAX_DEPTH
        if lrun.rate >= d.step_rate:
            out.append(f"prefetch depth {o.depth} -> {need}: the loader keeps up on average ({lrun.rate:,.0f} >= "
                       f"{d.step_rate:,.0f} images/s) but {gaps}{teeth}; a queue of {need} absorbs that jitter")
        elif lrun.rate >= 0.9 * d.step_rate:
            out.append(f"prefetch depth {o.depth} -> {need} evens out the gaps ({gaps}{teeth}), but the loader is just "
                       f"slower than the step ({lrun.rate:,.0f} < {d.step_rate:,.0f} images/s): the job cannot run "
                       f"faster than the loader")
        else:
            out.append(f"a deeper prefetch queue would not help: the loader is slower on average "
                       f"({lrun.rate:,.0f} < {d.step_rate:,.0f} images/s); {gaps}")
    if d.verdict == "loader-bound":
        out.insert(0, f"loader-bound: waited {d.wait_share:.0%} of the time; fed fully the job would run "
                      f"{d.speedup_if_fed:.1f}x faster ({d.step_rate:,.0f} vs {d.job_rate:,.0f} images/s). "
                      f"Weakest input stage: {weakest.name} ({weakest.capacity:,.0f} images/s)")
    return out
