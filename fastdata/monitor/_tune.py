"""``fastdata tune``: search the loader settings that feed a given step fastest, by measuring them.

One function per search dimension, each fixed before the next, in the order in which they change
the others' optimum; ``tune`` composes them and owns the measuring (a copied subset of the shards,
the loaders, the job). In that order:

1. ``batch_size_dimension``: the largest batch that fits in GPU memory, less headroom (CUDA, a model);
2. ``decoder_dimension``: the CPU decoder with the least CPU time per image (decode + preprocess);
3. ``workers_dimension``: the fewest ``num_workers`` within ``MIN_GAIN`` of the best, or enough;
4. ``decode_threads_dimension``: the thread decoder against those worker processes;
5. ``device_decode_dimension``: decoding on the device against the CPU decoder;
6. ``depth_dimension``: the prefetch depth, over the whole job (with a step only);
then ``compare_with_start`` measures the start and the tuned settings alternately.

Invariants: a dimension function measures only through the callables it is given and records each
measurement as a trial; a setting is chosen over the simpler one only when more than ``MIN_GAIN``
faster (depth: ``2 * MIN_GAIN``), and the start is kept unless the tuned settings beat it so.
Reasoning: docs/design/tune.md.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastdata._util import check_int
from fastdata.errors import FastdataError
from fastdata.monitor import _stages as st
from fastdata.monitor._batch import BatchSearch, search_batch_size
from fastdata.monitor._diagnose import (
    DoctorOptions,
    _close,
    _dataset,
    _loader,
    device_transform,
    no_step,
    run_job,
)

log = logging.getLogger(__name__)

# A setting must beat the simpler one by this much to be chosen (measurement noise on a busy machine).
MIN_GAIN = 0.05
# Workers that deliver this many times the images/s the step consumes are enough.
NEED_MARGIN = 1.25


@dataclass
class TuneResult:
    """The configuration ``tune`` found, the one it started from, and every trial."""

    start: DoctorOptions
    best: DoctorOptions
    start_rate: float  # images/s, measured back to back with best_rate
    best_rate: float
    measured: str  # "job" (loader -> prefetcher -> step) or "loader" (no step given)
    trials: list[dict[str, Any]] = field(default_factory=list)
    batch: BatchSearch | None = None
    notes: list[str] = field(default_factory=list)
    decode_threads: int = 0  # the tuned loader's decode_threads (0: worker processes)

    @property
    def speedup(self) -> float:
        """The tuned throughput over the start's (inf when the start measured nothing)."""
        return self.best_rate / self.start_rate if self.start_rate > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (what ``fastdata tune --json`` prints)."""
        return {"start": dataclasses.asdict(self.start), "best": dataclasses.asdict(self.best),
                "start_rate": self.start_rate, "best_rate": self.best_rate, "speedup": self.speedup,
                "measured": self.measured, "trials": self.trials, "notes": self.notes,
                "decode_threads": self.decode_threads,
                "batch": None if self.batch is None else dataclasses.asdict(self.batch)}


def python_snippet(source: str, o: DoctorOptions, fields: st.Fields, device: torch.device,
                   decode_threads: int = 0) -> str:
    """The tuned configuration as code to paste into a training script (``decode_threads``: the
    loader's thread decoder, as :attr:`TuneResult.decode_threads`): the dataset and loader settings
    that were measured (shuffled, default next-epoch preload, ``drop_last`` False)."""
    keep = [fields.image] + ([fields.label] if fields.label else [])
    workers = (f"num_workers={o.num_workers}, decode_threads={decode_threads}" if decode_threads else
               f"num_workers={o.num_workers}, persistent_workers={o.num_workers > 0}")
    if o.decode == "device" and fields.encoded:
        return "\n".join([
            "import fastdata",
            "from fastdata.gpu import CenterCrop, Compose, DecodeImages, Normalize, Resize",
            "",
            f"ds = fastdata.ShardedDataset({source!r}, shuffle=True, fields={keep!r}, image_decode='device')",
            f"loader = fastdata.DataLoader(ds, batch_size={o.batch_size}, {workers})",
            (f"decode = Compose(DecodeImages(keys=[{fields.image!r}]), Resize({round(o.size * 256 / 224)}), "
            f"CenterCrop({o.size}),"),
            f"                 Normalize(keys=[{fields.image!r}], channels_last={device.type == 'cuda'}))",
            f"batches = fastdata.CUDAPrefetcher(loader, depth={o.depth}, transform=decode)"])
    lines = ["import fastdata", "from fastdata.gpu import Normalize"]
    decode = ""
    if o.decode in ("torchcodec", "torchvision") and fields.encoded:  # measured faster than Pillow here
        lines += ["from fastdata.gpu import HostImageDecoder"]
        decode = f", decode={{{fields.image!r}: HostImageDecoder({o.decode!r})}}"
    # preprocess= applies to encoded image fields only: stored arrays (img.npy) go to the batch as stored
    dataset = ([f"ds = fastdata.ShardedDataset({source!r}, shuffle=True, fields={keep!r},",
                f"                             preprocess=fastdata.ResizeCenterCrop({o.size}){decode})"]
               if fields.encoded else [f"ds = fastdata.ShardedDataset({source!r}, shuffle=True, fields={keep!r})"])
    lines += ["", *dataset,
              f"loader = fastdata.DataLoader(ds, batch_size={o.batch_size}, {workers})",
              (f"batches = fastdata.CUDAPrefetcher(loader, depth={o.depth}, "
              f"transform=Normalize(keys=[{fields.image!r}], channels_last={device.type == 'cuda'}))")]
    return "\n".join(lines)


def model_fits(step: st.ModelStep, size: int, device: torch.device) -> Any:
    """``fits(batch)`` for :func:`search_batch_size`: one training step of ``step`` on random inputs."""
    def fits(b: int) -> None:
        x = torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, device=device)
        x = x.float().contiguous(memory_format=torch.channels_last)
        batch: dict[str, Any] = {step.fields.image: x}
        if step.fields.label:
            batch[step.fields.label] = torch.zeros(b, dtype=torch.long, device=device)
        try:
            step(batch)
            st.sync(device)
        finally:
            del x, batch
            step.model.zero_grad(set_to_none=True)  # gradients of a failed step must not crowd the next try
    return fits


class Search:
    """What the dimensions of one search share: the trials they measured and the notes they wrote."""

    def __init__(self) -> None:
        self.trials: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def trial(self, t: dict[str, Any]) -> None:
        self.trials.append(t)
        log.info("tune: %s", ", ".join(f"{k} {v:,.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))


def batch_size_dimension(s: Search, fits: Callable[[int], object], *, start: int, samples: int, batch_limit: int,
                         release: Callable[[], object]) -> BatchSearch:
    """The largest batch ``fits`` runs, less headroom (:func:`search_batch_size`), never above the
    ``samples`` measured (a larger batch would be measured as batches of the subset's size).
    ``release``: frees what a try left (``torch.cuda.empty_cache``), after each out-of-memory and at the end."""
    limit = min(batch_limit, samples)
    batch = search_batch_size(fits, start=min(start, limit), limit=limit, after_oom=release)
    release()
    for b, ok in batch.tried:
        s.trial({"dimension": "batch_size", "value": b, "fits": ok})
    upto = f"--max-batch {batch_limit}" if limit == batch_limit else f"the {limit} samples measured (--samples)"
    s.notes.append(f"batch size: {batch.largest_fit} fits in GPU memory"
                   + (f", {batch.first_oom} does not" if batch.first_oom else f" (searched up to {upto})")
                   + f"; {batch.batch_size} leaves {batch.headroom:.0%} headroom")
    return batch


def decoder_dimension(s: Search, cost: Callable[[str], float], start: str, backends: tuple[str, ...]) -> str:
    """The backend with the least ``cost(backend)`` (CPU seconds per image of decode + preprocess, in
    one thread); ``start`` unless another costs more than ``MIN_GAIN`` less. A backend whose cost
    raises is no candidate (noted); :class:`FastdataError` when none is left."""
    costs, failed = {}, []
    for backend in backends:
        try:
            costs[backend] = cost(backend)
        except Exception as e:  # noqa: BLE001  a backend that cannot decode these images is no candidate
            s.notes.append(f"decode backend {backend}: failed ({type(e).__name__}: {e})")
            failed.append(f"{backend}: {type(e).__name__}: {e}")
            continue
        s.trial({"dimension": "decode", "value": backend, "images/s per core": 1 / costs[backend]})
    if not costs:
        raise FastdataError("no CPU decoder could decode and preprocess the measured samples: " + "; ".join(failed))
    return min(costs, key=lambda k: costs[k] * (1.0 if k == start else 1.0 + MIN_GAIN))


def worker_candidates(start: int, cores: int) -> list[int]:
    """``start``, powers of two and ``cores``, from 1 to ``cores`` (0 too when the start has none)."""
    return sorted({w for w in (start, 1, 2, 4, 8, 16, 32, 64, cores) if 1 <= w <= cores}
                  | ({0} if start == 0 else set()))


def workers_dimension(s: Search, loader_rate: Callable[[int], float], candidates: list[int],
                      need: float | None) -> int:
    """One ``loader_rate(workers)`` per candidate, in order, until doubling gains less than
    ``MIN_GAIN``; then the two best again (one lucky run decides nothing). The answer: the fewest
    workers within ``MIN_GAIN`` of the best rate, or delivering ``need`` images/s."""
    rates: dict[int, float] = {}

    def measure(w: int) -> None:
        r = loader_rate(w)
        s.trial({"dimension": "num_workers", "value": w, "loader images/s": r})
        rates[w] = max(rates.get(w, 0.0), r)

    for w in candidates:
        measure(w)
        fewer = [v for v in rates if v < w]
        if fewer and w >= 2 and rates[w] < (1 + MIN_GAIN) * max(rates[v] for v in fewer):
            break  # doubling no longer pays
    for w in sorted(rates, key=rates.__getitem__, reverse=True)[:2]:
        measure(w)
    top = max(rates.values())
    enough = [w for w in sorted(rates) if rates[w] >= (1 - MIN_GAIN) * top or (need and rates[w] >= need)]
    return enough[0]


def decode_threads_dimension(s: Search, rate: Callable[[int], float], workers: int, measured: str) -> int:
    """``decode_threads=workers`` (no worker processes) against ``workers`` worker processes,
    ``rate(threads)``, two interleaved rounds; ``workers`` when more than ``MIN_GAIN`` faster, else 0.
    ``measured``: what the rate is, for the trials (``"job images/s"``, ``"loader images/s"``)."""
    got = {0: 0.0, workers: 0.0}
    for _ in range(2):
        for n in (0, workers):
            r = rate(n)
            got[n] = max(got[n], r)
            s.trial({"dimension": "decode_threads", "value": n, measured: r})
    return workers if got[workers] > (1 + MIN_GAIN) * got[0] else 0


def device_decode_dimension(s: Search, rate: Callable[[DoctorOptions], float], best: DoctorOptions) -> bool:
    """Decoding on the device (``decode="device"``: the device transform of :mod:`fastdata.gpu`)
    against ``best``'s CPU decoder, ``rate(options)`` through the prefetcher, two interleaved rounds:
    True when more than ``MIN_GAIN`` faster. A failing measurement ends it (noted): False."""
    dev = dataclasses.replace(best, decode="device")
    got = {best.decode: 0.0, "device": 0.0}
    for _ in range(2):
        for o in (best, dev):
            try:
                r = rate(o)
            except Exception as e:  # noqa: BLE001  a candidate that fails here is no candidate
                s.notes.append(f"decode on the device: failed ({type(e).__name__}: {e})")
                got["device"] = -1.0
                break
            got[o.decode] = max(got[o.decode], r)
            s.trial({"dimension": "decode (input side)", "value": o.decode, "images/s": r})
        if got["device"] < 0:
            break
    return got["device"] > (1 + MIN_GAIN) * got[best.decode]


# The prefetch depths compared.
DEPTHS = (1, 2, 4)


def depth_dimension(s: Search, rate: Callable[[int], float], start: int) -> int:
    """``rate(depth)`` of the whole job at each of ``DEPTHS``, two interleaved rounds: ``start``
    unless another depth is more than ``2 * MIN_GAIN`` faster, then the smallest depth within
    ``2 * MIN_GAIN`` of the best (depth only absorbs jitter)."""
    rates: dict[int, float] = {}
    for _ in range(2):
        for d in DEPTHS:
            r = rate(d)
            rates[d] = max(rates.get(d, 0.0), r)
            s.trial({"dimension": "depth", "value": d, "job images/s": r})
    top = max(rates.values())
    keep = start if rates.get(start, 0.0) >= (1 - 2 * MIN_GAIN) * top else None
    return keep or min(d for d, r in rates.items() if r >= (1 - 2 * MIN_GAIN) * top)


def compare_with_start(s: Search, start_rate: Callable[[], float], tuned_rate: Callable[[], float] | None, *,
                       same_batch: bool) -> tuple[float, float, bool]:
    """(start's images/s, tuned images/s, keep the start?): the two measured alternately, best of
    three each (``tuned_rate`` None: the search kept the start). With the batch size unchanged
    (``same_batch``), tuned settings not more than ``MIN_GAIN`` faster are noise: the start is kept."""
    start_r = tuned_r = 0.0
    for _ in range(3):
        start_r = max(start_r, start_rate())
        if tuned_rate is not None:
            tuned_r = max(tuned_r, tuned_rate())
            log.info("tune: start %.0f, tuned %.0f images/s (best so far)", start_r, tuned_r)
        else:  # the search kept the start: nothing else to measure (it logged "tuned 0 images/s")
            log.info("tune: start (= tuned) %.0f images/s (best so far)", start_r)
    if tuned_rate is None:
        return start_r, start_r, False
    if tuned_r < (1 + MIN_GAIN) * start_r and same_batch:
        s.notes.append(f"the tuned settings measured {tuned_r:,.0f} against {start_r:,.0f} images/s for the "
                       f"start: within noise, so the start is kept")
        return start_r, start_r, True
    return start_r, tuned_r, False


def tune(source: str | os.PathLike[str], start: DoctorOptions, *, batch_limit: int = 2048) -> TuneResult:
    """Search batch size (CUDA + model), decode backend, workers, thread decoder, device decode and
    depth, one dimension function each (see the module docstring), and compare with the start.

    ``start.device_decode`` (None: on CUDA only) adds decoding on the device as a decode candidate.
    """
    from fastdata.gpu import Normalize, host_backend
    from fastdata.manifest import Manifest
    from fastdata.prefetch import resolve_device
    from fastdata.transforms import ResizeCenterCrop

    if not isinstance(start, DoctorOptions):
        raise TypeError(f"start must be a fastdata.monitor.DoctorOptions, got {type(start).__name__}")
    check_int("batch_limit", batch_limit, 1)  # only the GPU search reads it, after minutes of measuring
    device = resolve_device(start.device)
    source = st.shard_folder(source)  # the shards are read from the folder, also when given its manifest.json
    ncores = st.cores()
    fields = st.pick_fields(Manifest.load(source), start.field, start.label)
    if fields.encoded and start.decode != "device":
        st.decoder(start.decode, None)  # a start decoder that cannot load fails now, not after the whole search
    pre = ResizeCenterCrop(start.size)
    norm = Normalize(keys=[fields.image], channels_last=device.type == "cuda")
    step = st.make_step(start.model, start.step_ms, device, fields)
    s = Search()
    best = start
    load_before = _load()
    batch: BatchSearch | None = None
    with tempfile.TemporaryDirectory(prefix="fastdata-tune-") as tmp:
        subset = Path(tmp) / "subset"
        read = st.copy_subset(source, subset, fields, start.samples)
        st.check_one_batch(source, read, start.samples, start.batch_size)

        def rate(o: DoctorOptions, *, through_prefetcher: bool = False, threads: int = 0) -> float:
            """The job's images/s; without a step the loader's (through the prefetcher and its transforms
            when asked: device decoding happens there). ``threads``: the loader's ``decode_threads``."""
            ds = _dataset(subset, fields, pre, o.decode)
            if step is None and not through_prefetcher and o.decode != "device":
                return _loader_rate(ds, o.batch_size, o.num_workers, threads)
            transform = device_transform(fields, pre, device) if o.decode == "device" else norm
            return run_job(ds, o, device, step or no_step, transform, threads=threads)[0]

        if isinstance(step, st.ModelStep) and device.type == "cuda":
            batch = batch_size_dimension(s, model_fits(step, start.size, device), start=start.batch_size,
                                         samples=read.samples, batch_limit=batch_limit, release=torch.cuda.empty_cache)
            best = dataclasses.replace(best, batch_size=batch.batch_size)
        else:
            why = "no model to size (--model)" if not isinstance(step, st.ModelStep) else "no GPU memory to fill on the CPU"
            s.notes.append(f"batch size: kept at {start.batch_size} ({why})")

        # each measuring lambda below runs inside its dimension's call, before ``best`` changes
        if fields.encoded:
            raws = st.raw_samples(subset, fields, 48)
            library = host_backend()  # "auto": TorchCodec where it loads (a deprecated torchvision: none)
            backends = tuple(dict.fromkeys(b for b in ("pil", start.decode, library) if b not in ("device", "pillow")))
            best = dataclasses.replace(best, decode=decoder_dimension(
                s, lambda backend: _cpu_cost(raws, fields, pre, backend, best.batch_size), start.decode, backends))

        need = None
        if step is not None:
            need = NEED_MARGIN * best.batch_size / st.time_step(
                step, _resident(subset, fields, pre, best, device, norm), device)
        workers = workers_dimension(
            s, lambda w: _loader_rate(_dataset(subset, fields, pre, best.decode), best.batch_size, w),
            worker_candidates(start.num_workers, ncores), need)
        best = dataclasses.replace(best, num_workers=workers)

        threads = 0
        if best.num_workers > 0 and best.decode != "device":
            threads = decode_threads_dimension(s, lambda n: rate(best, threads=n), best.num_workers,
                                               "job images/s" if step is not None else "loader images/s")

        device_decode = start.device_decode or (start.device_decode is None and device.type == "cuda")
        if fields.encoded and device_decode and device_decode_dimension(
                s, lambda o: rate(o, through_prefetcher=True), best):
            best, threads = dataclasses.replace(best, decode="device"), 0  # measured against worker processes

        if step is not None:
            best = dataclasses.replace(best, depth=depth_dimension(
                s, lambda d: rate(dataclasses.replace(best, depth=d), threads=threads), best.depth))
        else:
            s.notes.append(f"prefetch depth: kept at {start.depth} (without a step there is no jitter to absorb)")

        fair = best.decode == "device"  # then the loader alone does not decode: compare through the prefetcher
        start_rate, best_rate, keep = compare_with_start(
            s, lambda: rate(start, through_prefetcher=fair),
            (lambda: rate(best, through_prefetcher=fair, threads=threads)) if best != start or threads else None,
            same_batch=best.batch_size == start.batch_size)
        if keep:
            best, threads = start, 0
    busy = _load_note(ncores, load_before)
    if busy:
        s.notes.append(busy)
    measured = "job" if step is not None else ("input" if fair else "loader")
    return TuneResult(start, best, start_rate, best_rate, measured, s.trials, batch, s.notes, threads)


def _loader_rate(ds: Any, batch_size: int, workers: int, threads: int = 0) -> float:
    """The images/s of a loader over ``ds`` (closed afterwards)."""
    loader = _loader(ds, batch_size, workers, threads)
    try:
        return st.time_loader(loader).rate
    finally:
        _close(loader)


def _cpu_cost(raws: list[dict[str, Any]], fields: st.Fields, pre: Any, backend: str, batch_size: int) -> float:
    """CPU seconds per image of decode + preprocess with ``backend``, in one thread."""
    c = st.cpu_costs(raws, fields, pre, backend, batch_size)
    return (c.decode_s or 0.0) + (c.preprocess_s or 0.0)


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _load_note(ncores: int, before: float | None) -> str | None:
    """A warning when other processes competed for the cores during the search."""
    after = _load()
    if before is None or after is None or before < 0.75 * ncores:  # ``before``: load that was not ours
        return None
    return (f"the machine was busy (load average {before:.1f} at the start, {after:.1f} at the end, on {ncores} "
            "cores): other processes took CPU time, so these figures are noisy; rerun on a quiet machine")


def _resident(subset: Path, fields: st.Fields, pre: Any, o: DoctorOptions, device: torch.device, norm: Any) -> Any:
    """One batch of ``o.batch_size`` on ``device``, normalised: what the step sees."""
    ds = _dataset(subset, fields, pre, o.decode)
    from fastdata.loader import DataLoader

    batch = next(iter(DataLoader(ds, batch_size=o.batch_size, num_workers=0)))
    return norm({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()})
