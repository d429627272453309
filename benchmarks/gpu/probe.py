"""Probe the GPU machine once: versions, nvJPEG decode behaviour, NVML mapping (prints a short report)."""
from __future__ import annotations

import io
import json
import os
import sys
import time

import numpy as np
import torch

out = {}
out["python"] = sys.version.split()[0]
out["torch"] = torch.__version__
out["cuda"] = torch.version.cuda
out["cpus"] = len(os.sched_getaffinity(0))
try:
    import torchvision
    from torchvision.io import decode_jpeg
    out["torchvision"] = torchvision.__version__
except Exception as e:  # noqa: BLE001
    out["torchvision"] = repr(e)
props = torch.cuda.get_device_properties(0)
out["gpu"] = props.name
out["gpu_uuid"] = str(getattr(props, "uuid", None))
out["pci_bus_id"] = getattr(props, "pci_bus_id", None)
try:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    out["nvml_uuid"] = pynvml.nvmlDeviceGetUUID(h)
    out["nvml_pci"] = pynvml.nvmlDeviceGetPciInfo(h).busId
except Exception as e:  # noqa: BLE001
    out["nvml"] = repr(e)
from PIL import Image

rng = np.random.default_rng(0)
datas = []
for i in range(512):
    h, w = int(rng.integers(300, 640)), int(rng.integers(300, 640))
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
    arr = np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="JPEG", quality=90)
    datas.append(torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8))
for pin in (False, True):
    ds = [d.pin_memory() for d in datas] if pin else datas
    for bs in (128,):
        decode_jpeg(ds[:bs], device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        n = 0
        for k in range(0, len(ds), bs):
            decode_jpeg(ds[k:k + bs], device="cuda")
            n += len(ds[k:k + bs])
        torch.cuda.synchronize()
        out[f"decode_cuda_pin{pin}_bs{bs}_img_s"] = round(n / (time.perf_counter() - t))
# sync check
s = torch.cuda.Stream()
try:
    torch.cuda.set_sync_debug_mode("error")
    with torch.cuda.stream(s):
        r = decode_jpeg(datas[:64], device="cuda")
    out["decode_sync_free"] = True
except Exception as e:  # noqa: BLE001
    out["decode_sync_free"] = repr(e)[:300]
finally:
    torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
# which stream decode_jpeg outputs are on: compare vs cpu decode
cpu = decode_jpeg(datas[0])
gpu = decode_jpeg(datas[0], device="cuda").cpu()
out["gpu_vs_cpu_maxdiff"] = int((cpu.int() - gpu.int()).abs().max())
try:
    import torchvision.ops as ops
    out["roi_align"] = bool(ops.roi_align)
except Exception as e:  # noqa: BLE001
    out["roi_align"] = repr(e)
try:
    import nvidia.nvimgcodec  # noqa: F401
    out["nvimgcodec"] = True
except Exception as e:  # noqa: BLE001
    out["nvimgcodec"] = repr(e)[:100]
t = time.perf_counter(); x = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True); out["pin_alloc_64MB_ms"] = round((time.perf_counter() - t) * 1e3, 2)
print(json.dumps(out, indent=1))
if len(sys.argv) > 2:
    os.makedirs(sys.argv[2], exist_ok=True)
    json.dump(out, open(os.path.join(sys.argv[2], "probe.json"), "w"), indent=1)
