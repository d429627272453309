"""``fastdata doctor``: the environment checks, and with SHARDS the stage-by-stage table.

The measurements live in :mod:`fastdata.monitor` (``diagnose``); this module checks the
environment and prints (or writes as JSON) what was measured.
"""
from __future__ import annotations

import importlib
import json
import os
import resource
import shutil
from dataclasses import asdict, dataclass
from typing import Any

from fastdata._util import usable_cores as _cpu_count


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    advice: str = ""


def _version(module: str) -> str | None:
    """The module's version, None when it is not installed, or why it is installed but does not load."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - e.g. torchvision built for another torch: report, don't crash
        return f"installed but does not load ({type(e).__name__}: {e})"
    return str(getattr(mod, "__version__", "installed"))


# fastdata's own dependencies are required; the rest serve optional features (models, remote shards, NVML
# utilisation). torchcodec is a dependency too, but where it does not load fastdata decodes with Pillow: a warning
_PACKAGES = (("torch", True), ("numpy", True), ("PIL", True), ("h5py", True), ("braceexpand", True), ("tqdm", True),
             ("torchcodec", False), ("torchvision", False), ("fsspec", False), ("pynvml", False))
_REQUIRED = {f"package {mod}" for mod, need in _PACKAGES if need}


def check_packages() -> list[Check]:
    out = []
    for mod, need in _PACKAGES:
        v = _version(mod)
        broken = v is not None and v.startswith("installed but does not load")
        # a broken optional package is a warning (what needs it fails), not a failed doctor run
        out.append(Check(f"package {mod}", (v is not None and not broken) or (v is None and not need),
                         v or ("missing" if need else "not installed (optional)"),
                         f"reinstall {mod} to match torch {_version('torch')}" if broken
                         else "" if v or not need else f"pip install {mod}"))
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


def check_cuda() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("CUDA", True, "not available: CUDAPrefetcher runs as a thread prefetcher on the CPU")]
    dev = torch.cuda.current_device()
    name = torch.cuda.get_device_name(dev)
    out = [Check("CUDA", True, f"{name} (device {dev}, torch CUDA {torch.version.cuda})")]
    from fastdata.monitor import measure_h2d

    rates = measure_h2d(64 << 20, repeats=5)
    ratio = rates["pinned"] / max(rates["pageable"], 1e-9)
    out.append(Check("host-to-device", True,
                     f"pinned {rates['pinned']:.1f} GB/s, pageable {rates['pageable']:.1f} GB/s ({ratio:.1f}x)",
                     "wrap the loader in fastdata.CUDAPrefetcher: pinned, overlapped copies"))
    return out


def environment() -> list[Check]:
    return [*check_packages(), check_jpeg(), check_cpu(), check_shm(), check_files(), *check_cuda()]


def format_checks(checks: list[Check]) -> list[str]:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        line = f"{'ok  ' if c.ok else 'WARN'} {c.name:<{width}}  {c.detail}"
        if c.advice:
            line += f"\n     {'':<{width}}  -> {c.advice}"
        lines.append(line)
    return lines


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _use(share: float | None, resource: str, cores: int) -> str:
    if share is None:
        return ""
    if resource == "cores":
        return f"{share:.0%} of {cores} core{'s' if cores > 1 else ''}"
    if resource == "step time":
        return f"busy {share:.0%} of the time"
    return f"{share:.0%} of the {resource}"


def format_diagnosis(d: Any, source: str) -> list[str]:
    """The stage table, the verdict and the recommendations as printed lines."""
    o = d.options
    step = "no training step (pass --model or --step-ms)" if d.step_rate is None else ""
    samples = d.measurements.get("samples", o.samples)  # the source may hold fewer than --samples
    lines = [f"stages of {source}: first {samples} samples, batch {o.batch_size}, {o.num_workers} workers, "
             f"depth {o.depth}, {d.device}, {d.cores} cores {step}".rstrip(),
             f"  {'stage':<31} {'images/s':>9}  {'uses at the job rate':<24} detail"]
    for r in d.rows:
        lines.append(f"  {r.name:<31} {_num(r.capacity):>9}  {_use(r.uses, r.resource, d.cores):<24} {r.detail}")
    if d.job_rate is not None:
        gpu = d.stall.gpu_util_mean if d.stall is not None else None
        util = f", GPU utilisation {gpu:.0f}% ({d.stall.gpu_util_samples} NVML samples)" if gpu is not None else ""
        lines.append(f"  {'job (all stages together)':<31} {_num(d.job_rate):>9}  "
                     f"{'' if d.wait_share is None else 'waited ' + format(d.wait_share, '.0%') + ' of the time':<24} "
                     f"loader -> CUDAPrefetcher -> step, {o.job_steps} steps{util}")
    if d.verdict == "loader-bound":
        verdict = (f"LOADER-BOUND: the job runs at {d.job_rate:,.0f} images/s, the step alone at {d.step_rate:,.0f}: "
                   f"{d.speedup_if_fed:.1f}x slower than it could; bound by {d.bound}")
    elif d.verdict == "compute-bound":
        verdict = (f"COMPUTE-BOUND: the job runs at {d.job_rate:,.0f} images/s, {d.job_rate / d.step_rate:.0%} of the "
                   f"step alone ({d.step_rate:,.0f}); waited {d.wait_share:.0%} of the time for input")
    else:
        verdict = f"input pipeline: {d.rows[4].capacity:,.0f} images/s measured together; weakest stage {d.bound}"
    lines.append("verdict: " + verdict)
    predicted, loaded = d.measurements.get("loader_predicted"), d.measurements.get("load_average")
    together = d.rows[4].capacity
    if predicted and together and together < 0.7 * predicted:
        busy = f"; load average {loaded:.1f} on {d.cores} cores" if loaded is not None else ""
        lines.append(f"note: the loader measured together reaches {together / predicted:.0%} of the {predicted:,.0f} "
                     f"images/s its stages' CPU costs allow on {min(max(o.num_workers, 1), d.cores)} cores: the rest "
                     f"goes to per-sample work between the stages or to other processes{busy}")
    if d.stall is not None and d.stall.periodic is not None:
        lines.append("stalls: " + d.stall.periodic.describe())
    for key in ("threads_note", "gpu_decode_note"):
        note = d.measurements.get(key)
        if note:
            lines.append(note)
    if d.recommendations:
        lines.append("recommendations (each from a measurement above):")
        lines.extend(f"  - {r}" for r in d.recommendations)
    return lines


def run_doctor(source: str | None = None, options: Any = None, *, as_json: bool = False,
               out_path: str | None = None) -> int:
    """Environment checks, then (with ``source``) the stage table; exit status 1 if a required package is missing
    or does not load.

    ``as_json``: JSON on stdout instead of tables; ``out_path``: also write the JSON there.
    """
    checks = environment()
    diag = None
    if source is not None:
        from fastdata.monitor import diagnose

        diag = diagnose(source, options)
    result: dict[str, Any] = {"environment": [asdict(c) for c in checks],
                              "diagnosis": None if diag is None else diag.to_dict()}
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if as_json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print("\n".join(format_checks(checks)))
        if diag is not None:
            print()
            print("\n".join(format_diagnosis(diag, source)))
    missing = [c for c in checks if c.name in _REQUIRED and not c.ok]
    return 1 if missing else 0


def add_pipeline_arguments(p: Any, *, samples: int = 512) -> None:
    """The loader settings and training step shared by ``doctor`` and ``tune`` (each states its default)."""
    from fastdata.cli._args import device, nonneg_int, positive_float, positive_int, two_or_more

    step = p.add_mutually_exclusive_group()
    step.add_argument("--model", metavar="NAME", default=None,
                      help="torchvision model to train on the batches, random weights, no download "
                           "(e.g. resnet18; default: none)")
    step.add_argument("--step-ms", type=positive_float, metavar="MS", default=None,
                      help="a synthetic training step of MS milliseconds instead of a model (default: none)")
    p.add_argument("--workers", type=nonneg_int, default=2, metavar="N", help="DataLoader workers (default: 2)")
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N", help="batch size (default: 32)")
    p.add_argument("--size", type=positive_int, default=224, metavar="PX",
                   help="ResizeCenterCrop output side (default: 224)")
    p.add_argument("--depth", type=positive_int, default=2, metavar="N", help="CUDAPrefetcher depth (default: 2)")
    p.add_argument("--samples", type=positive_int, default=samples, metavar="N",
                   help=f"samples copied from SHARDS and measured (default: {samples})")
    p.add_argument("--steps", type=two_or_more, default=20, metavar="N",
                   help="training steps of the whole-job measurement, at least 2: the first is left out of the "
                        "rate (default: 20)")
    p.add_argument("--decode", choices=("pil", "torchcodec", "torchvision"), default="pil",
                   help="CPU image decoder (default: pil, with reduced-scale JPEG decoding)")
    p.add_argument("--field", default=None, metavar="NAME",
                   help="image field (default: the manifest's first image field)")
    p.add_argument("--label", default=None, metavar="NAME",
                   help="label field (default: the manifest's first cls field, if any)")
    p.add_argument("--device", type=device, default=None, metavar="DEV", help="cpu, cuda or cuda:N (default: cuda if available)")


def options_from(args: Any) -> Any:
    from fastdata.monitor import DoctorOptions

    return DoctorOptions(field=args.field, label=args.label, size=args.size, batch_size=args.batch_size,
                         num_workers=args.workers, depth=args.depth, samples=args.samples, model=args.model,
                         step_ms=args.step_ms, device=args.device, decode=args.decode, job_steps=args.steps)


def _cmd_doctor(args: Any) -> int:
    return run_doctor(args.shards, options_from(args) if args.shards is not None else None, as_json=args.json, out_path=args.out)


def add_doctor_subparser(subparsers: Any) -> Any:
    """Add ``doctor`` to the ``fastdata`` command's subparsers."""
    from fastdata.cli._args import nonempty_path, output_file

    p = subparsers.add_parser(
        "doctor", help="check the environment; with SHARDS, measure every pipeline stage and name the bottleneck",
        description="Check the environment for input-pipeline pitfalls. With SHARDS, measure each stage of the "
                    "pipeline (shard read, decode, preprocess, collate + worker hand-off, pin/pack, host-to-device "
                    "copy, GPU transforms, training step) on its own and together, and print each stage's capacity, "
                    "which stage bounds the job, by how much it is loader-bound, and recommendations backed by "
                    "those measurements.")
    p.add_argument("shards", nargs="?", metavar="SHARDS", default=None, type=nonempty_path,
                   help="shard folder with manifest.json to measure (default: environment checks only)")
    add_pipeline_arguments(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables (default: off)")
    p.add_argument("--out", type=output_file, default=None, metavar="PATH",
                   help="also write the JSON results to PATH (default: none)")
    p.set_defaults(func=_cmd_doctor)
    return p
