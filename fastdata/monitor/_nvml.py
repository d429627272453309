"""GPU utilisation through NVML (nvidia-ml-py), for the CUDA device a job actually runs on.

Which GPU. NVML numbers devices by PCI order over the whole machine; CUDA numbers the devices
``CUDA_VISIBLE_DEVICES`` leaves, in its own order. Under ``CUDA_VISIBLE_DEVICES=3`` CUDA's device 0 is
NVML's device 3, so the NVML handle is looked up by the device's UUID, then by its PCI bus id, both
from ``torch.cuda.get_device_properties``; the CUDA index is used only when neither is known and
``CUDA_VISIBLE_DEVICES`` is unset (then both numberings agree on the devices' order).

How often. ``nvmlDeviceGetUtilizationRates`` is itself an average over the driver's sampling
period (1/6 s to 1 s depending on the GPU), so polling it fast only repeats values and polling it
slowly leaves a short epoch with one or two samples. ``nvmlDeviceGetSamples`` returns every sample
the driver buffered since a timestamp, so the sampler collects those (each at the driver's own
rate) and keeps the ones inside the measured window; it polls ``GetUtilizationRates`` every
``interval_s`` only where the driver offers no sample buffer, and takes one final reading at
``stop()``, so even an epoch shorter than the polling interval has a value.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from fastdata._runtime import thread

log = logging.getLogger(__name__)

GPU_UTILIZATION_SAMPLES = 1  # nvmlSamplingType_t NVML_GPU_UTILIZATION_SAMPLES
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}  # nvmlValueType_t


def nvml_handle(nvml: Any, index: int) -> tuple[Any, str]:
    """NVML handle of CUDA device ``index`` and how it was found ("uuid", "pci" or "index")."""
    import torch

    props = torch.cuda.get_device_properties(index)
    tried: list[str] = []
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        if not text.startswith(("GPU-", "MIG-")):
            text = "GPU-" + text
        try:
            return nvml.nvmlDeviceGetHandleByUUID(text), "uuid"
        except Exception as e:  # noqa: BLE001  NVMLError: try the bus id next
            tried.append(f"UUID {text}: {e}")
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        bus_id = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(bus_id), "pci"
        except Exception as e:  # noqa: BLE001
            tried.append(f"PCI bus id {bus_id}: {e}")
    if not tried and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return nvml.nvmlDeviceGetHandleByIndex(index), "index"
    raise RuntimeError(
        f"cannot find cuda:{index} in NVML ({'; '.join(tried) or 'torch reports neither UUID nor PCI bus id'}); "
        "the CUDA index is not NVML's index under CUDA_VISIBLE_DEVICES, so nothing is sampled"
    )


class GPUSampler:
    """Collects GPU utilisation samples (percent) of one CUDA device in a named daemon thread."""

    def __init__(self, index: int, interval_s: float, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py; optional

        nvml.nvmlInit()
        self._nvml = nvml
        try:
            self._handle, self.found_by = nvml_handle(nvml, index)
        except BaseException:
            nvml.nvmlShutdown()
            raise
        self._interval = interval_s
        self._start_us = int(time.time() * 1e6)
        self._last_ts = self._start_us
        self._buffered = True  # the driver keeps a sample buffer (nvmlDeviceGetSamples)
        self._samples: list[tuple[int, int]] = []  # (timestamp in us, percent)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._shut = False
        self.error: BaseException | None = None
        self._thread = thread(self._run, name="fastdata-gpu-sampler")
        self._thread.start()

    def _poll(self) -> None:
        if self._buffered:
            try:
                vtype, samples = self._nvml.nvmlDeviceGetSamples(self._handle, GPU_UTILIZATION_SAMPLES, self._last_ts)
            except Exception as e:  # noqa: BLE001  NVMLError: NOT_FOUND = no new sample; else no buffer
                if "not found" in str(e).lower():
                    return
                log.debug("nvmlDeviceGetSamples unavailable (%s): polling utilisation rates", e)
                self._buffered = False
            else:
                with self._lock:
                    for s in samples:
                        ts = int(s.timeStamp)
                        if ts > self._last_ts:
                            self._samples.append((ts, int(_value(s, vtype))))
                            self._last_ts = ts
                return
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        with self._lock:
            self._samples.append((int(time.time() * 1e6), int(util.gpu)))

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self._poll()
        except Exception as e:  # noqa: BLE001  reported by stop(), never silently lost
            self.error = e

    def stop(self) -> list[int]:
        """Stop sampling; the samples (percent) taken inside the window, one final reading included."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.error is None:
            try:
                self._poll()
                if self._buffered and not self._samples:
                    self._buffered = False  # window shorter than the driver's period: read the average now
                    self._poll()
            except Exception as e:  # noqa: BLE001
                self.error = e
        if self.error is not None:
            log.warning("GPU sampling stopped early: %r", self.error)
        if not self._shut:
            self._shut = True
            try:
                self._nvml.nvmlShutdown()  # nvmlInit is reference-counted: balance it
            except Exception as e:  # noqa: BLE001  nothing depends on it; say so and go on
                log.debug("nvmlShutdown: %r", e)
        with self._lock:  # only samples taken after start (a buffer may hold older ones)
            return [v for t, v in self._samples if t >= self._start_us]


def _value(sample: Any, value_type: int) -> float:
    """The number in an ``nvmlSample_t`` (its value is a union read by ``nvmlValueType_t``)."""
    return float(getattr(sample.sampleValue, _VALUE_FIELDS.get(value_type, "uiVal")))
