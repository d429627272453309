"""Stall diagnostics: is this job loader-bound, by how much, and what to change.

``StallMeter.wrap(loader)`` times every ``next()`` the training thread makes on the loader
(time it spent waiting for input) against the wall time of the loop. From the per-step waits it
finds periodic stalls (the saw-tooth of workers refilling in bursts, :mod:`._periodic`). When the
loop iterates a :class:`fastdata.CUDAPrefetcher`, the prefetcher's counters over the same window
give per-stage times per batch (loader, staging, throttling, device copy). With
``sample_gpu=True`` a background thread also samples GPU utilisation through NVML
(nvidia-ml-py) for the device the job runs on (:mod:`._nvml`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastdata._util import quantile
from fastdata._util import usable_cores as _cores
from fastdata.monitor._nvml import GPUSampler
from fastdata.monitor._periodic import PeriodicStalls, find_periodic_stalls

T = TypeVar("T")
log = logging.getLogger(__name__)

# A loop that spends more than this share of its wall time waiting on input is loader-bound.
# 10% is where input stalls start to cost more than the usual launch and logging overheads.
LOADER_BOUND_SHARE = 0.10

# Per-step waits kept for the percentiles and the periodic-stall search: the last WAITS_KEPT to
# 2 x WAITS_KEPT steps (as CUDAPrefetcher.stats() keeps the last 100k batches); steps, total wait and
# the first wait stay exact over the whole run. Unbounded, a job of a million steps held ~54 MB of
# waits and each report() took ~1.7 s, growing for as long as it ran.
WAITS_KEPT = 100_000


@dataclass(frozen=True)
class StallReport:
    """What a :class:`StallMeter` saw."""

    steps: int
    wall_s: float
    wait_s: float
    wait_p50_s: float  # percentiles of the waits after the first batch (as the share, they leave start-up out)
    wait_p99_s: float
    first_wait_s: float  # the first batch (worker start-up), excluded from the share and the percentiles
    gpu_util_mean: float | None = None  # percent, when sampled
    gpu_util_samples: int = 0
    advice: tuple[str, ...] = field(default_factory=tuple)
    periodic: PeriodicStalls | None = None  # the saw-tooth, when the stalls have a period
    stage_s: tuple[tuple[str, float], ...] = ()  # per-batch seconds by stage (fastdata pipelines)
    loader_path: str | None = None  # fastdata.DataLoader.last_path: "cached" (in-process fast path) or "workers"

    @property
    def wait_share(self) -> float:
        """Share of the steady-state wall time the training thread waited for input."""
        steady_wall = self.wall_s - self.first_wait_s
        return (self.wait_s - self.first_wait_s) / steady_wall if steady_wall > 0 else 0.0

    @property
    def loader_bound(self) -> bool:
        """Whether the loop waited for input more than ``LOADER_BOUND_SHARE`` of its wall time."""
        return self.wait_share > LOADER_BOUND_SHARE

    @property
    def speedup_if_fed(self) -> float:
        """How much faster the loop would run if input were free (the cost of the stalls)."""
        share = min(self.wait_share, 0.999)
        return 1.0 / (1.0 - share)

    def summary(self) -> str:
        """The verdict, the periodic stalls, per-stage times and the advice, one line each."""
        verdict = ("LOADER-BOUND" if self.loader_bound else "not loader-bound")
        lines = [
            (f"{verdict}: waited {self.wait_share:.0%} of {self.wall_s:.2f} s over {self.steps} steps "
            f"(p50 {self.wait_p50_s * 1e3:.2f} ms, p99 {self.wait_p99_s * 1e3:.2f} ms per step; "
            f"first batch {self.first_wait_s:.2f} s)"),
        ]
        if self.loader_bound:
            lines.append(f"fed without waiting, this loop would run {self.speedup_if_fed:.2f}x faster")
        if self.periodic is not None:
            share = self.periodic.total_s / self.wall_s if self.wall_s > 0 else 0.0
            lines.append(f"periodic stalls: {self.periodic.describe()}: {share:.0%} of the wall time")
        if self.loader_path is not None:
            lines.append(f"loader path: {self.loader_path}"
                         + (" (the cached fast path, in this process)" if self.loader_path == "cached" else ""))
        if self.stage_s:
            lines.append("per batch: " + ", ".join(f"{name} {sec * 1e3:.2f} ms" for name, sec in self.stage_s))
        if self.gpu_util_mean is not None:
            few = " (few samples: the window is shorter than NVML's sampling period)" if self.gpu_util_samples < 5 else ""
            lines.append(f"GPU utilisation mean {self.gpu_util_mean:.0f}% over {self.gpu_util_samples} samples{few}")
        lines.extend(f"- {a}" for a in self.advice)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with the derived verdict."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("periodic", "stage_s", "advice")}
        out.update(wait_share=self.wait_share, loader_bound=self.loader_bound, speedup_if_fed=self.speedup_if_fed,
                   advice=list(self.advice), stage_s=dict(self.stage_s),
                   periodic=None if self.periodic is None else dict(self.periodic.__dict__))
        return out


class StallMeter:
    """Measure how long a training loop waits on its input.

    >>> meter = StallMeter()
    >>> for batch in meter.wrap(loader):
    ...     step(batch)
    >>> print(meter.report().summary())

    Memory stays bounded over any run: steps, total and first wait are exact; percentiles and periodic
    stalls come from the last ``WAITS_KEPT`` (100k) to 2x that many steps, which ``waits`` holds.

    Args:
        sample_gpu: also sample GPU utilisation with NVML (nvidia-ml-py) while iterating.
        gpu_interval_s: polling period of the sampler (the driver's buffered samples are
            collected at its own rate where it keeps them; see :mod:`fastdata.monitor._nvml`).
    """

    def __init__(self, *, sample_gpu: bool = False, gpu_interval_s: float = 0.05) -> None:
        interval = gpu_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < float("inf"):
            raise ValueError(f"gpu_interval_s must be > 0, got {interval!r} (a finite number of seconds)")
        if not isinstance(sample_gpu, bool):
            raise ValueError(f"sample_gpu must be a bool, got {sample_gpu!r}")
        self.sample_gpu = sample_gpu
        self.gpu_interval_s = float(gpu_interval_s)
        self.waits: list[float] = []  # the recent per-step waits (see WAITS_KEPT): older ones are folded into
        self._folded_steps = 0  # ... the count,
        self._folded_wait_s = 0.0  # ... the total
        self._first_wait_s = 0.0  # ... and the first (start-up) wait, once folded
        self.wall_s = 0.0  # time inside wrap(), once over nested or interleaved wraps; report() adds the open span
        self._open = 0  # wraps in progress (a validation loop inside the training loop, or report() inside the loop)
        self._span_start = 0.0  # when the first of the wraps in progress started
        self._loader: Any = None
        self._gpu_samples: list[int] = []  # the recent ones; older ones only count in the mean:
        self._gpu_folded = (0, 0)  # (their sum, their count)
        self._stage_totals: dict[str, float] = {}
        self._stage_batches = 0
        self._cpu_stages = False  # the prefetcher ran on the CPU

    def wrap(self, loader: Iterable[T]) -> Iterator[T]:
        """Iterate ``loader``, timing each wait for the next batch.

        A wrap inside another (a validation loop inside the training loop) adds its waits; its time is
        counted once, inside the outer loop's, and the advice stays about the outer loop's loader.
        """
        outer = self._open == 0
        if outer:
            self._loader = loader
        sampler = self._start_sampler(loader) if outer else None  # the outer wrap's samples cover the inner's window
        before = _prefetch_stats(loader)
        if outer:
            self._span_start = time.perf_counter()
        self._open += 1
        try:
            t0 = time.perf_counter()
            it = iter(loader)  # starts a DataLoader's worker processes: part of the first batch's wait
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self.waits.append(time.perf_counter() - t0)
                if len(self.waits) > 2 * WAITS_KEPT:
                    self._fold_waits()
                yield batch
                t0 = time.perf_counter()
        finally:
            self._open -= 1
            if self._open == 0:  # a wrap nested in another is inside the outer one's wall time already
                self.wall_s += time.perf_counter() - self._span_start
            if sampler is not None:
                self._gpu_samples.extend(sampler.stop())
                if len(self._gpu_samples) > 2 * WAITS_KEPT:
                    total, count = self._gpu_folded
                    self._gpu_folded = (total + sum(self._gpu_samples), count + len(self._gpu_samples))
                    self._gpu_samples = []
            self._add_stage_times(before, _prefetch_stats(loader))

    def _fold_waits(self) -> None:
        """Keep the last ``WAITS_KEPT`` waits; the older ones count in the totals only."""
        drop = len(self.waits) - WAITS_KEPT
        if drop <= 0:
            return
        if self._folded_steps == 0:
            self._first_wait_s = self.waits[0]
        self._folded_steps += drop
        self._folded_wait_s += sum(self.waits[:drop])
        del self.waits[:drop]

    def _start_sampler(self, loader: Any) -> GPUSampler | None:
        if not self.sample_gpu:
            return None
        try:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            device = getattr(loader, "device", None)
            index = device.index if isinstance(device, torch.device) and device.type == "cuda" else None
            return GPUSampler(torch.cuda.current_device() if index is None else index, self.gpu_interval_s)
        except Exception as e:  # noqa: BLE001  no NVML, no GPU: measure waits only, say why
            log.warning("GPU utilisation sampling unavailable (%s); measuring input waits only", e)
            return None

    def _add_stage_times(self, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        if before is None or after is None:
            return
        for key in _STAGE_KEYS:
            if key in after and key in before:
                self._stage_totals[key] = self._stage_totals.get(key, 0.0) + after[key] - before[key]
        self._stage_batches += int(after.get("batches", 0) - before.get("batches", 0))
        if after.get("device") == "cpu":  # a thread prefetcher: no pinning, no host-to-device copy to report
            self._cpu_stages = True

    def report(self) -> StallReport:
        """What the waits measured so far say: share, percentiles, periodic stalls and advice (also inside the
        loop: the wall time then runs to now)."""
        wall = self.wall_s + (time.perf_counter() - self._span_start if self._open else 0.0)
        folded = self._folded_steps > 0
        waits = sorted(self.waits if folded else self.waits[1:])  # the first wait is start-up, reported apart:
        # with fewer than 100 steps it would be the p99 itself, and "waits are spiky" advice would rest on it
        steps = self._folded_steps + len(self.waits)
        wait_s = self._folded_wait_s + sum(self.waits)
        gpu = self._gpu_samples
        gpu_sum, gpu_n = self._gpu_folded[0], self._gpu_folded[1] + len(gpu)
        n = self._stage_batches
        stages: tuple[tuple[str, float], ...] = ()
        if n > 0:
            loop = max(wall - wait_s, 0.0) / max(steps, 1)
            stages = (*((label, self._stage_totals[key] / n) for key, label in _STAGE_KEYS.items()
                        if key in self._stage_totals and not (self._cpu_stages and key in _COPY_KEYS)),
                      ("step (loop body)", loop))
        periodic = find_periodic_stalls([0.0, *self.waits] if folded else self.waits)
        if folded and periodic is not None and self.waits:  # found in the recent window: its time, for the whole run
            periodic = replace(periodic, total_s=periodic.total_s * (steps - 1) / len(self.waits))
        rep = StallReport(
            steps=steps, wall_s=wall, wait_s=wait_s,
            wait_p50_s=quantile(waits, 0.5), wait_p99_s=quantile(waits, 0.99),
            first_wait_s=self._first_wait_s if folded else self.waits[0] if self.waits else 0.0,
            gpu_util_mean=(gpu_sum + sum(gpu)) / gpu_n if gpu_n else None, gpu_util_samples=gpu_n,
            periodic=periodic, stage_s=stages, loader_path=_loader_path(self._loader),
        )
        return StallReport(**{**rep.__dict__, "advice": tuple(advise(rep, self._loader))})


# CUDAPrefetcher.stats() counters that are per-stage thread or device time, and their labels.
_STAGE_KEYS = {
    "load_s": "loader next()",
    "stage_s": "pin/pack + copy issue",
    "throttle_s": "held back (depth full)",
    "copy_s": "host-to-device copy (device time)",
    "wait_s": "consumer wait",
}

_COPY_KEYS = ("stage_s", "copy_s")  # counters of a CUDA prefetcher only


def _loader_path(loader: Any) -> str | None:
    """Which path the latest epoch of a fastdata.DataLoader (possibly inside a CUDAPrefetcher) took."""
    for candidate in (loader, getattr(loader, "iterable", None)):
        path = getattr(candidate, "last_path", None)
        if isinstance(path, str):
            return path
    return None


def _prefetch_stats(loader: Any) -> dict[str, Any] | None:
    """The counters of a fastdata CUDAPrefetcher (None for any other iterable)."""
    stats = getattr(loader, "stats", None)
    if type(loader).__name__ != "CUDAPrefetcher" or not callable(stats):
        return None
    return stats()


def advise(report: StallReport, loader: Any) -> list[str]:
    """Concrete changes for a loader-bound loop, from what the loader's settings show."""
    if not isinstance(report, StallReport):
        raise TypeError(f"report must be a StallReport (StallMeter.report()), got {type(report).__name__}")
    if not report.loader_bound:
        return []
    out: list[str] = []
    dl = loader
    for name in ("iterable", "loader"):  # a wrapper such as CUDAPrefetcher: advise on the loader inside
        inner = getattr(loader, name, None)  # no truthiness test: bool() would call a loader's len()
        if inner is not None and hasattr(inner, "num_workers"):
            dl = inner
            break
    cores = _cores()
    workers = getattr(dl, "num_workers", None)
    threads = getattr(dl, "decode_threads", 0)
    cached = report.loader_path == "cached"  # the latest epoch read the cache in this process: no workers ran
    if cached:
        out.append("the cached fast path read the latest epoch in this process, without workers: num_workers "
                   "does not change its speed; gather_threads= on DataLoader sets the threads that copy its rows")
    elif isinstance(threads, int) and threads > 0:  # fastdata's thread decoder: no worker processes, threads decode
        if threads < cores:
            out.append(f"decode_threads={threads} on {cores} cores: raise it (at most {cores}; "
                       "`fastdata doctor SHARDS` measures how it scales)")
    elif workers is not None and workers < cores:
        out.append(f"num_workers={workers} on {cores} cores: raise it (at most {cores}; "
                   "`fastdata doctor SHARDS` measures how it scales)")
    if workers and not threads and not cached and not getattr(dl, "persistent_workers", False):
        out.append("persistent_workers=False restarts workers every epoch: set it to True")
    if type(loader).__name__ != "CUDAPrefetcher":
        out.append("wrap the loader in fastdata.CUDAPrefetcher so the next batches are fetched (and copied to the "
                   "GPU) while the step computes")
    dataset = getattr(dl, "dataset", None)
    preprocess = getattr(dataset, "preprocess", None)
    if (dataset is not None and getattr(dataset, "cache", None) is None and preprocess is not None
            and not getattr(getattr(dataset, "source", None), "streaming", False)):  # cache= needs random access
        if isinstance(getattr(preprocess, "fingerprint", None), str):
            out.append("decoding and resizing repeat every epoch: pass cache= to ShardedDataset")
        else:  # cache= refuses a preprocess without a fingerprint
            out.append("preprocess= repeats every epoch: wrap it in fastdata.Deterministic(fn, version=...) "
                       "and pass cache= to ShardedDataset")
    p = report.periodic
    if p is not None:
        bursts = workers and not threads and p.period == workers  # worker processes deliver in bursts; threads not
        burst = " (= num_workers: the workers deliver in bursts)" if bursts else ""
        body = max(report.wall_s - report.wait_s, 0.0) / max(report.steps, 1)
        depth = getattr(getattr(loader, "options", None), "depth", None)
        shallow = (f"; the prefetch depth ({depth}) is below the burst of {p.period}: raise it to {p.period + 1}"
                   if depth is not None and depth < p.period else "")
        out.append(f"saw-tooth: every {p.period} steps one waits {p.mean_s * 1e3:.1f} ms{burst}; the loader took "
                   f"{(p.period * body + p.mean_s) * 1e3:.0f} ms per {p.period} batches that the steps consume in "
                   f"{p.period * body * 1e3:.0f} ms, so it is slower on average: more workers or the cache help"
                   f"{shallow}")
    elif report.wait_p99_s > 5 * max(report.wait_p50_s, 1e-6):
        out.append("waits are spiky (p99 >> p50): raise prefetch depth or prefetch_factor to absorb jitter")
    return out
