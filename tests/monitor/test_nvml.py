"""NVML sampling: the device found by UUID then PCI bus (never by CUDA index), buffered samples."""
from __future__ import annotations

import time

import pytest
import torch


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
