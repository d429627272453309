import time

import numpy as np
import pytest
import torch

from fastdata.monitor import StallMeter


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


# ------------------------------------------------------------------------------ periodic stalls

from fastdata.monitor import find_periodic_stalls


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


# ------------------------------------------------------------------------------ NVML, faked

class _NVMLError(Exception):
    pass


class _FakeNVML:
    """Enough of pynvml: handles by UUID / PCI bus id / index, buffered samples, utilisation rates."""

    def __init__(self, uuids=("GPU-aaaa",), buses=("00000000:3b:00.0",), buffered=True, value=70):
        self.uuids, self.buses, self.buffered, self.value = list(uuids), list(buses), buffered, value
        self.lookups = []

    def nvmlInit(self):
        self.inits = getattr(self, "inits", 0) + 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.lookups.append(("uuid", uuid))
        if uuid not in self.uuids:
            raise _NVMLError("Not Found")
        return ("h", uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.lookups.append(("pci", bus))
        if bus not in self.buses:
            raise _NVMLError("Not Found")
        return ("h", bus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self.lookups.append(("index", index))
        return ("h", index)

    def nvmlDeviceGetSamples(self, handle, kind, last_ts):
        import types

        if not self.buffered:
            raise _NVMLError("Not Supported")
        now = int(time.time() * 1e6)
        if now - last_ts < 20_000:
            raise _NVMLError("Not Found")
        value = types.SimpleNamespace(uiVal=self.value, dVal=-1.0)
        return 1, [types.SimpleNamespace(timeStamp=now - 5_000, sampleValue=value)]

    def nvmlDeviceGetUtilizationRates(self, handle):
        import types

        return types.SimpleNamespace(gpu=self.value - 10)


@pytest.fixture
def fake_props(monkeypatch):
    import types

    props = types.SimpleNamespace(uuid="aaaa", pci_bus_id=0x3B, pci_domain_id=0, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    return props


def test_nvml_device_found_by_uuid_then_pci_never_by_cuda_index(fake_props, monkeypatch):
    from fastdata.monitor import nvml_handle

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    nvml = _FakeNVML()
    assert nvml_handle(nvml, 0) == (("h", "GPU-aaaa"), "uuid")
    nvml = _FakeNVML(uuids=())
    assert nvml_handle(nvml, 0) == (("h", "00000000:3b:00.0"), "pci")
    nvml = _FakeNVML(uuids=(), buses=())
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        nvml_handle(nvml, 0)
    assert ("index", 0) not in nvml.lookups  # the CUDA index is not NVML's under CUDA_VISIBLE_DEVICES
    fake_props.uuid = fake_props.pci_bus_id = None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_handle(_FakeNVML(), 2) == (("h", 2), "index")


def test_gpu_sampler_collects_buffered_samples_and_falls_back(fake_props):
    from fastdata.monitor import GPUSampler

    def wait_for(sampler, n):  # the thread may wait long for a core on a busy machine: no fixed sleep
        deadline = time.monotonic() + 20
        while len(sampler._samples) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    nvml = _FakeNVML()
    sampler = GPUSampler(0, 0.01, nvml=nvml)
    wait_for(sampler, 3)
    samples = sampler.stop()
    assert sampler.found_by == "uuid" and len(samples) >= 3 and set(samples) == {70}
    assert nvml.inits == 0 and sampler.stop() == samples  # NVML released once; stop() twice is harmless
    sampler = GPUSampler(0, 0.01, nvml=_FakeNVML(buffered=False))
    wait_for(sampler, 2)
    samples = sampler.stop()
    assert len(samples) >= 2 and set(samples) == {60}
    short = GPUSampler(0, 10.0, nvml=_FakeNVML())  # a window shorter than the polling interval
    assert short.stop() == [60]  # one final reading still gives a value


@pytest.mark.cuda
def test_nvml_sampling_on_a_real_gpu_finds_the_device_and_gives_a_mean():
    pytest.importorskip("pynvml")
    from fastdata.monitor import GPUSampler

    sampler = GPUSampler(torch.cuda.current_device(), 0.05)
    x = torch.randn(4096, 4096, device="cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.5:
        x = x @ x
        x = x / x.norm()
    torch.cuda.synchronize()
    samples = sampler.stop()
    assert sampler.found_by in ("uuid", "pci") and sampler.error is None
    assert len(samples) >= 5, samples  # a 1.5 s window has a meaningful mean
    assert sum(samples) / len(samples) > 50  # the matmul loop kept this GPU (not another one) busy
