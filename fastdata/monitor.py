"""Stall diagnostics: is this job loader-bound, by how much, and what to change.

``StallMeter.wrap(loader)`` times every ``next()`` the training thread makes on the loader
(time it spent waiting for input) against the wall time of the loop. With
``sample_gpu=True`` a background thread also samples GPU utilisation through NVML
(nvidia-ml-py), which shows the saw-tooth of a starved GPU directly.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastdata._util import quantile

T = TypeVar("T")
log = logging.getLogger(__name__)

# A loop that spends more than this share of its wall time waiting on input is loader-bound.
# 10% is where input stalls start to cost more than the usual launch and logging overheads.
LOADER_BOUND_SHARE = 0.10


@dataclass(frozen=True)
class StallReport:
    """What a :class:`StallMeter` saw."""

    steps: int
    wall_s: float
    wait_s: float
    wait_p50_s: float
    wait_p99_s: float
    first_wait_s: float  # the first batch (worker start-up), excluded from the share
    gpu_util_mean: float | None = None  # percent, when sampled
    gpu_util_samples: int = 0
    advice: tuple[str, ...] = field(default_factory=tuple)

    @property
    def wait_share(self) -> float:
        """Share of the steady-state wall time the training thread waited for input."""
        steady_wall = self.wall_s - self.first_wait_s
        return (self.wait_s - self.first_wait_s) / steady_wall if steady_wall > 0 else 0.0

    @property
    def loader_bound(self) -> bool:
        return self.wait_share > LOADER_BOUND_SHARE

    @property
    def speedup_if_fed(self) -> float:
        """How much faster the loop would run if input were free (the cost of the stalls)."""
        share = min(self.wait_share, 0.999)
        return 1.0 / (1.0 - share)

    def summary(self) -> str:
        verdict = ("LOADER-BOUND" if self.loader_bound else "not loader-bound")
        lines = [
            f"{verdict}: waited {self.wait_share:.0%} of {self.wall_s:.2f} s over {self.steps} steps "
            f"(p50 {self.wait_p50_s * 1e3:.2f} ms, p99 {self.wait_p99_s * 1e3:.2f} ms per step; "
            f"first batch {self.first_wait_s:.2f} s)",
        ]
        if self.loader_bound:
            lines.append(f"feeding the GPU fully would make this loop {self.speedup_if_fed:.2f}x faster")
        if self.gpu_util_mean is not None:
            lines.append(f"GPU utilisation mean {self.gpu_util_mean:.0f}% over {self.gpu_util_samples} samples")
        lines.extend(f"- {a}" for a in self.advice)
        return "\n".join(lines)


class _GPUSampler:
    """Samples GPU utilisation with NVML in a named daemon thread until stopped."""

    def __init__(self, device_index: int, interval_s: float) -> None:
        import pynvml  # nvidia-ml-py; optional

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self._interval = interval_s
        self._stop = threading.Event()
        self.samples: list[int] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fastdata-gpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
        except Exception as e:  # reported by stop(), never silently lost
            self.error = e

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.error is not None:
            log.warning("GPU sampling stopped early: %r", self.error)
        return self.samples


class StallMeter:
    """Measure how long a training loop waits on its input.

    >>> meter = StallMeter()
    >>> for batch in meter.wrap(loader):
    ...     step(batch)
    >>> print(meter.report().summary())
    """

    def __init__(self, *, sample_gpu: bool = False, gpu_interval_s: float = 0.05) -> None:
        if gpu_interval_s <= 0:
            raise ValueError(f"gpu_interval_s must be > 0, got {gpu_interval_s!r}")
        self.sample_gpu = sample_gpu
        self.gpu_interval_s = gpu_interval_s
        self.waits: list[float] = []
        self.wall_s = 0.0
        self._loader: Any = None
        self._gpu_samples: list[int] = []

    def wrap(self, loader: Iterable[T]) -> Iterator[T]:
        """Iterate ``loader``, timing each wait for the next batch."""
        self._loader = loader
        sampler = self._start_sampler()
        start = time.perf_counter()
        it = iter(loader)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self.waits.append(time.perf_counter() - t0)
                yield batch
        finally:
            self.wall_s += time.perf_counter() - start
            if sampler is not None:
                self._gpu_samples.extend(sampler.stop())

    def _start_sampler(self) -> _GPUSampler | None:
        if not self.sample_gpu:
            return None
        try:
            import torch

            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            return _GPUSampler(index, self.gpu_interval_s)
        except Exception as e:  # no NVML, no GPU: measure waits only, say why
            log.warning("GPU utilisation sampling unavailable (%s); measuring input waits only", e)
            return None

    def report(self) -> StallReport:
        waits = sorted(self.waits)
        gpu = self._gpu_samples
        rep = StallReport(
            steps=len(self.waits), wall_s=self.wall_s, wait_s=sum(self.waits),
            wait_p50_s=quantile(waits, 0.5), wait_p99_s=quantile(waits, 0.99),
            first_wait_s=self.waits[0] if self.waits else 0.0,
            gpu_util_mean=sum(gpu) / len(gpu) if gpu else None, gpu_util_samples=len(gpu),
        )
        return StallReport(**{**rep.__dict__, "advice": tuple(advise(rep, self._loader))})


def advise(report: StallReport, loader: Any) -> list[str]:
    """Concrete changes for a loader-bound loop, from what the loader's settings show."""
    if not report.loader_bound:
        return []
    out: list[str] = []
    dl = loader
    for name in ("iterable", "loader"):  # a wrapper such as CUDAPrefetcher: advise on the loader inside
        inner = getattr(loader, name, None)  # no truthiness test: bool() would call a loader's len()
        if inner is not None and hasattr(inner, "num_workers"):
            dl = inner
            break
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    workers = getattr(dl, "num_workers", None)
    if workers is not None and workers < cores:
        out.append(f"num_workers={workers} but {cores} cores are free: raise it to {cores}")
    if workers and not getattr(dl, "persistent_workers", False):
        out.append("persistent_workers=False restarts workers every epoch: set it to True")
    if type(loader).__name__ != "CUDAPrefetcher":
        out.append("wrap the loader in fastdata.CUDAPrefetcher so copies overlap compute")
    dataset = getattr(dl, "dataset", None)
    if dataset is not None and getattr(dataset, "cache", None) is None and hasattr(dataset, "preprocess"):
        out.append("decoding and resizing repeat every epoch: pass cache= to ShardedDataset")
    if report.wait_p99_s > 5 * max(report.wait_p50_s, 1e-6):
        out.append("waits are spiky (p99 >> p50): raise prefetch depth or prefetch_factor to absorb jitter")
    return out
