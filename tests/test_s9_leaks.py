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


def _worker_skips(sample: dict) -> dict:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    sample["held"] = len(info.dataset.skipped)  # the skip records this worker's copy of the dataset holds
    return sample


def test_a_persistent_workers_copy_of_the_dataset_holds_no_growing_skip_list(tmp_path) -> None:
    """Under fastdata.DataLoader a worker's skips reach the main process's ``dataset.skipped`` through the result
    queue; the worker appended each one to its own copy's ``skipped`` too, which nothing reads: with persistent
    workers that list grew by every skip of every epoch for the whole run, in every worker."""
    import numpy as np

    from fastdata.cli._synth import jpeg_bytes, synth_image
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=6) as w:
        for i in range(12):
            j = jpeg_bytes(synth_image(np.random.default_rng(i), 16, 16), 90)
            w.write({"__key__": f"k{i:03d}", "jpg": j[:40] if i % 4 == 1 else j, "cls": i})
    ds = fastdata.ShardedDataset(tmp_path / "ds", on_error="skip", sample_transform=_worker_skips)
    loader = fastdata.DataLoader(ds, batch_size=3, num_workers=1, persistent_workers=True,
                                 multiprocessing_context="fork")
    held = []
    for epoch in range(5):
        loader.set_epoch(epoch)
        held += [int(h) for b in loader for h in b["held"]]
    assert len(ds.skipped) == 5 * 3  # the main process's report: every skip of every epoch, as documented
    assert max(held) == 0, held  # before: 15 by the last epoch (3 more each epoch)
