"""``fastdata tune``: search the loader settings that feed a given step fastest, by measuring them.

One dimension at a time, each fixed before the next, in the order in which they change the
others' optimum:

1. batch size (CUDA and a model only): the largest that fits in GPU memory, less headroom
   (:func:`search_batch_size`); a larger batch raises the images/s the loader must deliver;
2. decode backend: CPU seconds per image of decode + preprocess with each CPU decoder, measured
   in one thread on the same images;
3. ``num_workers``: the loader's measured images/s at 1, 2, 4, ... workers, never more than the
   cores; the search stops when doubling gains less than 5%, and the answer is the fewest
   workers within 5% of the best, or the fewest that deliver 1.25x what the step consumes (the
   two best are measured twice);
3a. the thread decoder (``decode_threads`` = the chosen workers, no worker processes, the same
   batches) against those worker processes, two interleaved rounds; chosen when more than 5% faster;
4. prefetch depth (with a step): the whole job's images/s at depths 1, 2, 4 in two interleaved
   rounds; the starting depth unless another is more than 10% faster (depth only absorbs jitter,
   and a busy machine measures +-10%).

Every figure is the best of interleaved runs (the run least disturbed by other processes), and
the starting and the tuned configuration are measured alternately three times each at the end,
so the speed-up is not an artefact of the machine's load drifting during the search. A tuned
configuration that is not more than 5% faster than the start is reported as such, and the start kept.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
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


def tune(source: str | os.PathLike[str], start: DoctorOptions, *, batch_limit: int = 2048) -> TuneResult:
    """Search batch size (CUDA + model), decode backend, workers and depth; see the module docstring.

    ``start.device_decode`` (None: on CUDA only) adds decoding on the device as a decode candidate.
    """
    from fastdata.gpu import HostImageDecoder, Normalize
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
    trials: list[dict[str, Any]] = []

    def trial(t: dict[str, Any]) -> None:
        trials.append(t)
        log.info("tune: %s", ", ".join(f"{k} {v:,.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))

    notes: list[str] = []
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
                loader = _loader(ds, o.batch_size, o.num_workers, threads)
                try:
                    return st.time_loader(loader).rate
                finally:
                    _close(loader)
            transform = device_transform(fields, pre, device) if o.decode == "device" else norm
            return run_job(ds, o, device, step or no_step, transform, threads=threads)[0]

        # 1. batch size
        if isinstance(step, st.ModelStep) and device.type == "cuda":
            # never above the measured samples: a larger batch would be measured as batches of the subset's size
            limit = min(batch_limit, read.samples)
            batch = search_batch_size(model_fits(step, start.size, device), start=min(start.batch_size, limit),
                                      limit=limit, after_oom=torch.cuda.empty_cache)
            torch.cuda.empty_cache()
            for b, ok in batch.tried:
                trial({"dimension": "batch_size", "value": b, "fits": ok})
            best = dataclasses.replace(best, batch_size=batch.batch_size)
            upto = f"--max-batch {batch_limit}" if limit == batch_limit else f"the {limit} samples measured (--samples)"
            notes.append(f"batch size: {batch.largest_fit} fits in GPU memory"
                         + (f", {batch.first_oom} does not" if batch.first_oom else f" (searched up to {upto})")
                         + f"; {batch.batch_size} leaves {batch.headroom:.0%} headroom")
        else:
            why = "no model to size (--model)" if not isinstance(step, st.ModelStep) else "no GPU memory to fill on the CPU"
            notes.append(f"batch size: kept at {start.batch_size} ({why})")

        # 2. decode backend (CPU seconds per image, one thread: robust on a busy machine)
        if fields.encoded:
            raws = st.raw_samples(subset, fields, 48)
            costs, failed = {}, []
            library = HostImageDecoder().backend  # "auto": TorchCodec where it loads (a deprecated torchvision: none)
            tried = ["pil", start.decode, library]
            for backend in dict.fromkeys(b for b in tried if b not in ("device", "pillow")):
                try:
                    c = st.cpu_costs(raws, fields, pre, backend, best.batch_size)
                except Exception as e:  # noqa: BLE001  a backend that cannot decode these images is no candidate
                    notes.append(f"decode backend {backend}: failed ({type(e).__name__}: {e})")
                    failed.append(f"{backend}: {type(e).__name__}: {e}")
                    continue
                costs[backend] = (c.decode_s or 0.0) + (c.preprocess_s or 0.0)
                trial({"dimension": "decode", "value": backend, "images/s per core": 1 / costs[backend]})
            if not costs:
                raise FastdataError("no CPU decoder could decode and preprocess the measured samples: "
                                    + "; ".join(failed))
            pick = min(costs, key=lambda k: costs[k] * (1.0 if k == start.decode else 1.0 + MIN_GAIN))
            best = dataclasses.replace(best, decode=pick)

        # 3. workers: one run each (stopping when doubling no longer pays), then the two best again
        need = None
        if step is not None:
            need = 1.25 * best.batch_size / st.time_step(step, _resident(subset, fields, pre, best, device, norm),
                                                         device)
        candidates = sorted({w for w in (start.num_workers, 1, 2, 4, 8, 16, 32, 64, ncores) if 1 <= w <= ncores}
                            | ({0} if start.num_workers == 0 else set()))
        rates: dict[int, float] = {}

        def loader_rate(w: int) -> float:
            loader = _loader(_dataset(subset, fields, pre, best.decode), best.batch_size, w)
            try:
                r = st.time_loader(loader).rate
            finally:
                _close(loader)
            trial({"dimension": "num_workers", "value": w, "loader images/s": r})
            rates[w] = max(rates.get(w, 0.0), r)
            return r

        for w in candidates:
            loader_rate(w)
            fewer = [v for v in rates if v < w]
            if fewer and w >= 2 and rates[w] < (1 + MIN_GAIN) * max(rates[v] for v in fewer):
                break  # doubling no longer pays
        for w in sorted(rates, key=rates.__getitem__, reverse=True)[:2]:
            loader_rate(w)  # a second, interleaved look at the two best: one lucky run decides nothing
        top = max(rates.values())
        enough = [w for w in sorted(rates) if rates[w] >= (1 - MIN_GAIN) * top or (need and rates[w] >= need)]
        best = dataclasses.replace(best, num_workers=enough[0])

        # 3a. the thread decoder on the cores of the workers just chosen, two interleaved rounds
        threads = 0
        if best.num_workers > 0 and best.decode != "device":
            got_t = {0: 0.0, best.num_workers: 0.0}
            for _ in range(2):
                for n in (0, best.num_workers):
                    r = rate(best, threads=n)
                    got_t[n] = max(got_t[n], r)
                    trial({"dimension": "decode_threads", "value": n,
                           ("job images/s" if step is not None else "loader images/s"): r})
            if got_t[best.num_workers] > (1 + MIN_GAIN) * got_t[0]:
                threads = best.num_workers

        # 3b. decoding on the device instead, with the workers just chosen, two interleaved rounds
        if fields.encoded and (start.device_decode or (start.device_decode is None and device.type == "cuda")):
            dev = dataclasses.replace(best, decode="device")
            got = {best.decode: 0.0, "device": 0.0}
            for _ in range(2):
                for o in (best, dev):
                    try:
                        r = rate(o, through_prefetcher=True)
                    except Exception as e:  # noqa: BLE001  a candidate that fails here is no candidate
                        notes.append(f"decode on the device: failed ({type(e).__name__}: {e})")
                        got["device"] = -1.0
                        break
                    got[o.decode] = max(got[o.decode], r)
                    trial({"dimension": "decode (input side)", "value": o.decode, "images/s": r})
                if got["device"] < 0:
                    break
            if got["device"] > (1 + MIN_GAIN) * got[best.decode]:
                best, threads = dev, 0  # measured against worker processes reading the bytes

        # 4. prefetch depth, over the whole job, two interleaved rounds
        if step is not None:
            depth_rates: dict[int, float] = {}
            for _ in range(2):
                for d in (1, 2, 4):
                    r = rate(dataclasses.replace(best, depth=d), threads=threads)
                    depth_rates[d] = max(depth_rates.get(d, 0.0), r)
                    trial({"dimension": "depth", "value": d, "job images/s": r})
            top = max(depth_rates.values())
            keep = best.depth if depth_rates.get(best.depth, 0.0) >= (1 - 2 * MIN_GAIN) * top else None
            best = dataclasses.replace(best, depth=keep or min(d for d, r in depth_rates.items()
                                                              if r >= (1 - 2 * MIN_GAIN) * top))
        else:
            notes.append(f"prefetch depth: kept at {start.depth} (without a step there is no jitter to absorb)")

        # 5. the start against the tuned configuration, interleaved, best of three each
        start_rate = best_rate = 0.0
        fair = best.decode == "device"  # then the loader alone does not decode: compare through the prefetcher
        for _ in range(3):
            start_rate = max(start_rate, rate(start, through_prefetcher=fair))
            if best != start or threads:
                best_rate = max(best_rate, rate(best, through_prefetcher=fair, threads=threads))
                log.info("tune: start %.0f, tuned %.0f images/s (best so far)", start_rate, best_rate)
            else:  # the search kept the start: nothing else to measure (it logged "tuned 0 images/s")
                log.info("tune: start (= tuned) %.0f images/s (best so far)", start_rate)
        if best == start and not threads:
            best_rate = start_rate
        elif best_rate < (1 + MIN_GAIN) * start_rate and best.batch_size == start.batch_size:
            notes.append(f"the tuned settings measured {best_rate:,.0f} against {start_rate:,.0f} images/s for the "
                         f"start: within noise, so the start is kept")
            best, best_rate, threads = start, start_rate, 0
    busy = _load_note(ncores, load_before)
    if busy:
        notes.append(busy)
    measured = "job" if step is not None else ("input" if fair else "loader")
    return TuneResult(start, best, start_rate, best_rate, measured, trials, batch, notes, threads)


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
