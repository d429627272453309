"""StallMeter: loader-bound and compute-bound loops, the report and its percentiles, nested loops, GPU
samples, bounded memory over long runs, periodic stalls."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import fastdata
from fastdata.monitor import StallMeter, _stall

from fastdata.monitor import find_periodic_stalls  # noqa: E402


class _SlowLoader:
    """A loader whose batches take `delay` seconds each (``sleep``: real or a test's virtual clock); looks like a
    DataLoader with 1 worker."""

    num_workers = 1
    persistent_workers = False

    def __init__(self, n: int, delay: float, sleep=time.sleep) -> None:
        self.n, self.delay, self.sleep = n, delay, sleep

    def __iter__(self):
        for i in range(self.n):
            if self.delay:
                self.sleep(self.delay)
            yield torch.full((2,), i)


def test_loader_bound_loop_is_reported_with_advice(stall_clock):
    meter = StallMeter()
    seen = []
    for b in meter.wrap(_SlowLoader(8, 0.02, stall_clock.sleep)):
        seen.append(int(b[0]))
        stall_clock.sleep(0.001)  # a step 20 times shorter than a batch's wait
    assert seen == list(range(8))
    rep = meter.report()
    assert rep.steps == 8
    share = 7 * 0.02 / (8 * 0.021 - 0.02)  # the first wait (start-up) is reported apart
    assert rep.loader_bound and rep.wait_share == pytest.approx(share)
    assert rep.speedup_if_fed == pytest.approx(1 / (1 - share))
    text = rep.summary()
    assert "LOADER-BOUND" in text
    assert "persistent_workers" in text and "CUDAPrefetcher" in text


def test_compute_bound_loop_is_not_loader_bound(stall_clock):
    meter = StallMeter()
    for _ in meter.wrap(_SlowLoader(8, 0.001, stall_clock.sleep)):
        stall_clock.sleep(0.05)  # steps 50 times longer than a batch's wait: 2% waiting
    rep = meter.report()
    assert not rep.loader_bound
    assert rep.advice == ()
    assert "not loader-bound" in rep.summary()


def test_early_break_still_counts_wall_time(stall_clock):
    meter = StallMeter()
    for i, _ in enumerate(meter.wrap(_SlowLoader(100, 0.001, stall_clock.sleep))):
        stall_clock.sleep(0.01)
        if i == 3:
            break
    rep = meter.report()
    assert rep.steps == 4 and rep.wall_s == pytest.approx(4 * 0.011) and rep.wait_s == pytest.approx(0.004)


def test_bad_interval_names_argument():
    with pytest.raises(ValueError, match="gpu_interval_s must be > 0, got 0"):
        StallMeter(gpu_interval_s=0)


def test_advice_looks_inside_the_prefetcher():
    from fastdata.prefetch import CUDAPrefetcher

    class NoLen(_SlowLoader):  # like a DataLoader over an IterableDataset: advice must not call len()
        def __len__(self):
            raise TypeError("this loader has no len()")

    loader = NoLen(6, 0.02)
    pf = CUDAPrefetcher(loader, device="cpu", depth=1)
    meter = StallMeter()
    for _ in meter.wrap(pf):
        pass
    pf.close()
    rep = meter.report()
    assert pf.iterable is loader and rep.loader_bound
    text = rep.summary()
    assert "num_workers=1" in text and "persistent_workers" in text
    assert "wrap the loader in fastdata.CUDAPrefetcher" not in text


def _saw(n, period, slow=0.02, fast=1e-4, phase=0):
    return [0.5] + [slow if i % period == phase else fast for i in range(n)]


@pytest.mark.parametrize("period", [2, 3, 4, 8])
def test_periodic_detector_finds_the_period(period):
    p = find_periodic_stalls(_saw(64, period, phase=period - 1))
    assert p is not None and p.period == period
    assert p.stalls == 64 // period and p.regularity == 1.0
    assert p.mean_s == pytest.approx(0.02) and p.fast_s == pytest.approx(1e-4)
    assert f"every {period}" in p.describe()


def test_periodic_detector_tolerates_a_missing_tooth_and_noise():
    import random

    rng = random.Random(0)
    waits = _saw(60, 4)
    waits[9] = 1e-4  # one burst arrived in time: a gap of 8 = 2 periods
    waits = [w * (1 + 0.2 * rng.random()) for w in waits]
    waits[17] = waits[34] = 0.0015  # scheduler hiccups, far below a tooth
    p = find_periodic_stalls(waits)
    assert p is not None and p.period == 4 and p.regularity < 1.0


def test_periodic_detector_ignores_random_spikes_steady_starvation_and_fed_loops():
    import random

    rng = random.Random(1)
    spikes = [0.5] + [1e-4] * 80
    for i in rng.sample(range(1, 81), 8):
        spikes[i] = 0.02
    gaps = {b - a for a, b in zip(sorted(i for i, w in enumerate(spikes) if w > 0.01)[:-1],
                                  sorted(i for i, w in enumerate(spikes) if w > 0.01)[1:])}
    assert len(gaps) > 3  # the seed gives irregular spikes
    assert find_periodic_stalls(spikes) is None
    assert find_periodic_stalls([0.5] + [0.02] * 40) is None  # every step starved: no saw-tooth
    assert find_periodic_stalls([0.5] + [1e-4] * 40) is None
    assert find_periodic_stalls([0.02, 1e-4, 0.02]) is None  # too short to call


class _BurstLoader:
    """Every k-th batch takes `stall` seconds (workers refilling in bursts), the others are ready."""

    num_workers = 3
    persistent_workers = True

    def __init__(self, n, k, stall, sleep):
        self.n, self.k, self.stall, self.sleep = n, k, stall, sleep

    def __iter__(self):
        for i in range(self.n):
            if i % self.k == self.k - 1:
                self.sleep(self.stall)
            yield torch.full((2,), i)


def test_stall_meter_reports_the_saw_tooth_of_a_real_loop(stall_clock):
    meter = StallMeter()
    for _ in meter.wrap(_BurstLoader(45, 3, 0.08, stall_clock.sleep)):  # 80 ms teeth
        stall_clock.sleep(0.002)
    rep = meter.report()
    assert rep.periodic is not None and rep.periodic.period == 3, rep.summary()
    assert rep.periodic.mean_s == pytest.approx(0.08)
    text = rep.summary()
    assert "every 3rd step stalls" in text
    assert any("saw-tooth: every 3 steps" in a and "= num_workers" in a and "slower on average" in a
               for a in rep.advice)
    d = rep.to_dict()
    assert d["periodic"]["period"] == 3 and d["loader_bound"] is True


def test_per_stage_times_when_the_pipeline_is_fastdata():
    from fastdata.prefetch import CUDAPrefetcher

    with CUDAPrefetcher(_SlowLoader(10, 0.01), device="cpu", depth=2) as pf:
        meter = StallMeter()
        for _ in meter.wrap(pf):
            time.sleep(0.001)
    stages = dict(meter.report().stage_s)
    assert stages["loader next()"] >= 0.008  # the loader's 10 ms per batch, seen from the prefetch thread
    assert "consumer wait" in stages and stages["step (loop body)"] >= 0.0009
    assert "per batch: loader next()" in meter.report().summary()
    plain = StallMeter()
    for _ in plain.wrap(_SlowLoader(3, 0.0)):
        pass
    assert plain.report().stage_s == () and plain.report().loader_path is None


def test_report_names_the_path_a_fastdata_loader_took(tmp_path):
    import fastdata
    from fastdata.prefetch import CUDAPrefetcher

    with fastdata.ShardWriter(tmp_path / "s", max_samples=8) as w:
        for i in range(16):
            w.write({"__key__": f"k{i:03d}", "npy": np.full((4,), i, np.uint8), "cls": i % 2})
    loader = fastdata.DataLoader(fastdata.ShardedDataset(tmp_path / "s"), batch_size=4)
    with CUDAPrefetcher(loader, device="cpu") as pf:
        meter = StallMeter()
        for _ in meter.wrap(pf):
            pass
    rep = meter.report()
    assert rep.loader_path == "workers" and "loader path: workers" in rep.summary()


def test_stall_percentiles_leave_out_the_first_batch_as_the_share_does():
    # 30 steps: worker start-up 0.5 s, then 4 ms waits against 6 ms steps. The p99 of a run under 100 steps
    # was the start-up wait itself, and the report advised "waits are spiky" on it.
    meter = StallMeter()
    meter.waits = [0.5] + [0.004] * 30
    meter.wall_s = 0.5 + 30 * 0.010
    rep = meter.report()
    assert rep.loader_bound and rep.first_wait_s == 0.5
    assert rep.wait_p99_s == pytest.approx(0.004) and rep.wait_p50_s == pytest.approx(0.004)
    assert not any("spiky" in a for a in rep.advice), rep.advice
    assert "p99 4.00 ms" in rep.summary()


def test_stall_report_inside_the_loop_counts_the_time_so_far(stall_clock):
    # report() ("what the waits measured so far say") inside the loop, e.g. to log every N steps, said
    # "not loader-bound: waited 0% of 0.00 s": the wall time was added only when the loop ended
    def slow():
        for i in range(12):
            stall_clock.sleep(0.01)
            yield i

    meter = StallMeter()
    for i, _ in enumerate(meter.wrap(slow())):
        stall_clock.sleep(0.001)
        if i == 9:
            rep = meter.report()
    assert rep.steps == 10 and rep.wall_s == pytest.approx(0.11) and rep.loader_bound, rep.summary()
    assert rep.wait_share == pytest.approx(0.09 / 0.1) and "of 0.00 s" not in rep.summary()  # the first wait apart
    end = meter.report()
    assert end.steps == 12 and end.wall_s > rep.wall_s and end.loader_bound


def test_stall_meter_counts_a_nested_loop_once(monkeypatch, stall_clock):
    # a validation loop wrapped by the same meter inside the training loop: its time was added to the wall
    # time twice (inside the outer wrap and again as its own), so the wait share came out too low
    def slow(n):
        for i in range(n):
            stall_clock.sleep(0.01)
            yield i

    class Train:
        num_workers = 1

        def __iter__(self):
            return slow(6)

    from fastdata.monitor import _stall

    monkeypatch.setattr(_stall, "_cores", lambda: 4)
    meter = StallMeter()
    for i, _ in enumerate(meter.wrap(Train())):
        stall_clock.sleep(0.001)
        if i % 3 == 2:
            for _ in meter.wrap(slow(3)):
                stall_clock.sleep(0.001)
    rep = meter.report()
    assert rep.steps == 12 and rep.wall_s == pytest.approx(12 * 0.011), rep.wall_s  # the inner loop counted once
    # every step of both loops waits 10 of its 11 ms (the first wait, start-up, is reported apart)
    assert rep.wait_share == pytest.approx(11 * 0.01 / (12 * 0.011 - 0.01)), rep.summary()
    assert any(a.startswith("num_workers=1 on 4 cores") for a in rep.advice), rep.advice  # the outer loader's


def test_stall_meter_counts_the_time_iter_takes_as_waiting(stall_clock):
    # a loader whose iter() does the start-up work (starts its threads or processes, lists files) had that
    # time counted as neither a wait nor the first batch: "not loader-bound: waited 0%, first batch 0.00 s"
    class SlowStart:
        def __iter__(self):
            stall_clock.sleep(0.15)
            return iter(range(10))

    meter = StallMeter()
    for _ in range(2):  # epoch 2's start-up counts as a wait of that epoch, as a worker restart would
        for _ in meter.wrap(SlowStart()):
            pass
    rep = meter.report()
    assert rep.first_wait_s == pytest.approx(0.15) and rep.wait_s == pytest.approx(0.3) and rep.loader_bound, \
        rep.summary()


def test_stall_meter_samples_the_gpu_once_over_a_nested_loop(monkeypatch):
    # each nested wrap started its own NVML sampler: the inner loop's window was sampled twice and weighed
    # twice in the utilisation mean
    from fastdata.monitor import _stall

    started = []

    class Sampler:
        def __init__(self, index, interval):
            started.append(index)

        def stop(self):
            return [50]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_stall, "GPUSampler", Sampler)
    meter = StallMeter(sample_gpu=True)
    for i in meter.wrap(range(4)):
        if i == 1:
            for _ in meter.wrap(range(3)):
                pass
    rep = meter.report()
    assert started == [0] and rep.gpu_util_samples == 1 and rep.gpu_util_mean == 50


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_stalls=0), "min_stalls must be an int >= 1"),   # an IndexError
    (dict(min_stalls=1.5), "min_stalls must be an int >= 1"),
    (dict(min_stall_s=-1.0), "min_stall_s must be a finite number >= 0"),
    (dict(min_stall_s=math.nan), "min_stall_s must be a finite number >= 0"),
])
def test_find_periodic_stalls_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_periodic_stalls([0.001] * 20, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpu_interval_s=True), "gpu_interval_s must be > 0, got True"),
    (dict(gpu_interval_s=math.inf), "gpu_interval_s must be > 0, got inf"),
    (dict(sample_gpu="no"), "sample_gpu must be a bool"),
])
def test_stall_meter_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StallMeter(**kwargs)


def _steps(n: int):
    yield from range(n)


def test_a_stallmeter_over_many_epochs_keeps_a_bounded_window_and_exact_totals(monkeypatch: pytest.MonkeyPatch) -> None:
    """StallMeter kept every per-step wait of the run: about 54 MB and 1.7 s per report() after a million steps,
    growing for as long as the job runs (CUDAPrefetcher.stats() keeps the last 100k). The window is bounded;
    steps, total wait and the first (start-up) wait stay exact."""
    monkeypatch.setattr(_stall, "WAITS_KEPT", 1000, raising=False)
    meter = fastdata.StallMeter()
    first = None
    for _ in range(30):  # 30 epochs of 500 steps
        for _ in meter.wrap(_steps(500)):
            pass
        if first is None:
            first = meter.waits[0]
    rep = meter.report()
    assert len(meter.waits) <= 2 * 1000, len(meter.waits)
    assert rep.steps == 15000
    assert rep.first_wait_s == first
    assert 0.0 < rep.wait_s < rep.wall_s
    assert rep.wait_p50_s <= rep.wait_p99_s


def test_a_stallmeter_folds_old_gpu_samples_into_the_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU utilisation samples grew as the waits did (one list for the whole run); only their mean and count
    are reported, and those stay exact."""
    monkeypatch.setattr(_stall, "WAITS_KEPT", 10, raising=False)

    class Sampler:
        def stop(self) -> list[int]:
            return [50, 70] * 8

    monkeypatch.setattr(fastdata.StallMeter, "_start_sampler", lambda self, loader: Sampler())
    meter = fastdata.StallMeter(sample_gpu=True)
    for _ in range(30):
        for _ in meter.wrap(_steps(3)):
            pass
    rep = meter.report()
    assert len(meter._gpu_samples) <= 2 * 10 + 16
    assert rep.gpu_util_samples == 30 * 16 and rep.gpu_util_mean == 60.0


def test_stall_summary_of_a_cpu_only_loop_does_not_talk_of_a_gpu():
    # "feeding the GPU fully would make this loop 2.00x faster" was said of CPU-only loops too
    from fastdata.monitor import StallReport

    rep = StallReport(steps=10, wall_s=1.0, wait_s=0.5, wait_p50_s=0.05, wait_p99_s=0.06, first_wait_s=0.0)
    text = rep.summary()
    assert rep.loader_bound and "GPU" not in text and "2.00x faster" in text
    from fastdata.monitor._stall import advise

    advice = advise(rep, iter(()))  # a plain iterable: the prefetcher is advised, for what it does on a CPU too
    assert any("CUDAPrefetcher" in a for a in advice) and all("copies overlap" not in a for a in advice)


def test_stall_report_of_a_cpu_prefetcher_lists_no_copy_stages():
    # a CUDAPrefetcher on the CPU has no pinning nor host-to-device copy: the report listed
    # "pin/pack + copy issue 0.00 ms" and "host-to-device copy (device time) 0.00 ms" for it
    import fastdata

    meter = fastdata.StallMeter()
    with fastdata.CUDAPrefetcher([torch.zeros(2, 3)] * 4, device="cpu") as batches:
        for _ in meter.wrap(batches):
            pass
    stages = dict(meter.report().stage_s)
    assert "loader next()" in stages and "step (loop body)" in stages
    assert not any("copy" in name for name in stages), stages
