"""Session 9 hunt for growth over long runs (many epochs, many loaders): one regression test per defect."""
from __future__ import annotations

import pytest

import fastdata
from fastdata.monitor import _stall


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
