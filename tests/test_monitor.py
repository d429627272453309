import time

import pytest
import torch

from fastdata.monitor import StallMeter


class _SlowLoader:
    """A loader whose batches take `delay` seconds each; looks like a DataLoader with 1 worker."""

    num_workers = 1
    persistent_workers = False

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __iter__(self):
        for i in range(self.n):
            if self.delay:
                time.sleep(self.delay)
            yield torch.full((2,), i)


def test_loader_bound_loop_is_reported_with_advice():
    meter = StallMeter()
    seen = [int(b[0]) for b in meter.wrap(_SlowLoader(8, 0.02))]
    assert seen == list(range(8))
    rep = meter.report()
    assert rep.steps == 8
    assert rep.loader_bound and rep.wait_share > 0.8
    assert rep.speedup_if_fed > 4
    text = rep.summary()
    assert "LOADER-BOUND" in text
    assert "persistent_workers" in text and "CUDAPrefetcher" in text


def test_compute_bound_loop_is_not_loader_bound():
    meter = StallMeter()
    for _ in meter.wrap(_SlowLoader(8, 0.0)):
        time.sleep(0.05)  # long steps: scheduler noise under load stays far below the 10% threshold
    rep = meter.report()
    assert not rep.loader_bound
    assert rep.advice == ()
    assert "not loader-bound" in rep.summary()


def test_early_break_still_counts_wall_time():
    meter = StallMeter()
    for i, _ in enumerate(meter.wrap(_SlowLoader(100, 0.001))):
        if i == 3:
            break
    rep = meter.report()
    assert rep.steps == 4 and rep.wall_s > 0


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
