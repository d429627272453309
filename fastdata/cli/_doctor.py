"""``fastdata doctor``: check the environment for the usual input-pipeline pitfalls."""
from __future__ import annotations

import importlib
import os
import resource
import shutil
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    advice: str = ""


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return str(getattr(mod, "__version__", "installed"))


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def check_packages() -> list[Check]:
    out = []
    for mod, need in (("torch", True), ("numpy", True), ("PIL", True), ("h5py", True),
                      ("webdataset", True), ("fsspec", False), ("pynvml", False)):
        v = _version(mod)
        out.append(Check(f"package {mod}", v is not None or not need, v or ("missing" if need else "not installed (optional)"),
                         "" if v or not need else f"pip install {mod}"))
    return out


def check_jpeg() -> Check:
    from PIL import features

    turbo = bool(features.check_feature("libjpeg_turbo"))
    return Check("Pillow libjpeg-turbo", turbo, "yes" if turbo else "no",
                 "" if turbo else "JPEG decoding is several times slower without libjpeg-turbo")


def check_cpu() -> Check:
    import torch

    cores = _cpu_count()
    threads = torch.get_num_threads()
    workers = max(1, cores - 1) if cores > 2 else cores
    return Check("CPU", True, f"{cores} usable cores, torch intra-op threads {threads}",
                 f"start with num_workers={workers}; DataLoader workers run with 1 torch thread each")


def check_shm() -> Check:
    path = "/dev/shm"
    if not os.path.isdir(path):
        return Check("shared memory", True, "no /dev/shm (not Linux?)")
    free = shutil.disk_usage(path).free
    ok = free >= 1 << 30
    return Check("shared memory", ok, f"/dev/shm {free / 2**30:.1f} GiB free",
                 "" if ok else "DataLoader workers pass batches through /dev/shm: give containers "
                 "--shm-size=8g (Docker's default 64 MB crashes or stalls workers)")


def check_files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ok = soft == resource.RLIM_INFINITY or soft >= 4096
    return Check("open files limit", ok, f"soft {soft}, hard {hard}",
                 "" if ok else "raise it (ulimit -n 65536): many shards x workers hold many files open")


def measure_h2d(nbytes: int, *, repeats: int) -> dict[str, float]:
    """Host-to-device GB/s of one ``nbytes`` copy from pinned and from pageable memory (medians)."""
    import statistics

    import torch

    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = {}
    for label, pin in (("pinned", True), ("pageable", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        dst.copy_(src, non_blocking=pin)  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rates[label] = nbytes / statistics.median(times) / 1e9
    return rates


def check_cuda() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("CUDA", True, "not available: CUDAPrefetcher runs as a thread prefetcher on the CPU")]
    dev = torch.cuda.current_device()
    name = torch.cuda.get_device_name(dev)
    out = [Check("CUDA", True, f"{name} (device {dev}, torch CUDA {torch.version.cuda})")]
    rates = measure_h2d(64 << 20, repeats=5)
    ratio = rates["pinned"] / max(rates["pageable"], 1e-9)
    out.append(Check("host-to-device", True,
                     f"pinned {rates['pinned']:.1f} GB/s, pageable {rates['pageable']:.1f} GB/s ({ratio:.1f}x)",
                     "wrap the loader in fastdata.CUDAPrefetcher: pinned, overlapped copies"))
    return out


def run_doctor() -> int:
    """Print one line per check; exit status 1 if a required package is missing."""
    checks = [*check_packages(), check_jpeg(), check_cpu(), check_shm(), check_files(), *check_cuda()]
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok  " if c.ok else "WARN"
        line = f"{mark} {c.name:<{width}}  {c.detail}"
        if c.advice:
            line += f"\n     {'':<{width}}  -> {c.advice}"
        print(line)
    missing = [c for c in checks if c.name.startswith("package") and not c.ok]
    return 1 if missing else 0
