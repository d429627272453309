"""Host-to-device overlap: does the GPU ever wait for an input copy?

A synthetic loader hands out pre-made CPU batches (``--batch-mb`` of uint8, default one
256x3x224x224 batch = 38.5 MB); each ``next()`` costs ``--load-ms`` of host time, and with
``--jitter P`` a batch is late by ``--spike-ms`` with probability P (seeded: every variant sees the
same sequence). A synthetic compute step runs ``--compute-ms`` on the GPU (``torch.cuda._sleep``,
calibrated) and reads the batch; ``--sync-every 1`` (default) synchronises after each step as a
training loop does with ``loss.item()`` or GradScaler. Compared in the same run:

- ``sync``: pageable ``batch.to(device)``;
- ``pinned``: batches already pinned (as DataLoader ``pin_memory=True`` delivers them),
  ``.to(device, non_blocking=True)`` in a plain loop (the copy queues behind compute);
- ``one_ahead``: the apex/timm pattern: one batch ahead on a side stream, ``wait_stream`` +
  ``record_stream``, ``next()`` on the training thread;
- ``prefetcher``: ``CUDAPrefetcher`` over the pageable loader (it pins in its own thread);
- ``prefetcher_pinned``: ``CUDAPrefetcher`` over the pinned loader (direct copies).

Reported per variant (median over ``--reps``): step time against the ideal ``max(compute, raw
pinned copy, mean load)``, where compute is the step time of the same loop with the batch already
on the device (measured in the same run), overlap efficiency = ideal / step, host-side wait for the batch p50/p99
(time in ``next()`` plus the copy call), and achieved H2D GB/s against a raw pinned copy measured in
the same run. Targets (issue 5, H100): prefetcher efficiency >= 95%, H2D >= 90% of raw pinned, and
fastest of all variants when the loader has jitter.

Without CUDA the CPU variant runs instead: ``plain`` loop vs ``prefetcher`` (``device="cpu"``
thread prefetch) with a sleep-based compute step and the same jittery loader.

    python benchmarks/h2d_overlap.py --quick --json /tmp/h2d.json
    python benchmarks/h2d_overlap.py                      # full grid
    python benchmarks/h2d_overlap.py --device cpu --quick # CPU variant on a GPU machine
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdata.prefetch import CUDAPrefetcher  # noqa: E402


class SyntheticLoader:
    """Re-iterable of ``steps`` pre-made batches with a seeded per-batch host latency."""

    def __init__(self, batches: list[torch.Tensor], *, steps: int, load_ms: float, jitter: float,
                 spike_ms: float, seed: int = 0) -> None:
        self.batches, self.steps = batches, steps
        rng = np.random.default_rng(seed)
        spikes = rng.random(steps) < jitter
        self.delays = (load_ms + spikes * spike_ms) / 1e3

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.steps):
            _sleep_precise(self.delays[i])
            yield self.batches[i % len(self.batches)]


def _sleep_precise(seconds: float) -> None:
    """Sleep without holding the GIL (a real loader waits on worker queues; spinning here would
    steal the GIL from the training thread and penalise threaded variants). ~0.1 ms precision."""
    if seconds > 0:
        time.sleep(seconds)


def _pcts(waits: list[float]) -> tuple[float, float]:
    if not waits:
        return 0.0, 0.0
    a = np.asarray(waits) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


# --- CUDA ---------------------------------------------------------------------------------------------


def calibrate_sleep(device: torch.device) -> float:
    """GPU clock cycles per millisecond for ``torch.cuda._sleep``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 5_000_000
    torch.cuda._sleep(n)
    best = float("inf")
    for _ in range(3):
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return n / best


def raw_copy(pinned: torch.Tensor, pageable: torch.Tensor, device: torch.device, reps: int = 20) -> dict:
    """Median time of a pinned and of a pageable host-to-device copy of one batch."""
    dst = torch.empty_like(pinned, device=device)
    out = {}
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        times = []
        for _ in range(reps + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        t = statistics.median(times[3:])
        out[f"{name}_copy_ms"] = t * 1e3
        out[f"{name}_gbps"] = pinned.numel() / t / 1e9
    return out


def run_loop(fetch: Callable[[], Any], steps: int, compute: Callable[[Any], None],
             sync: Callable[[], None], sync_every: int) -> tuple[list[float], list[float]]:
    """The training loop every variant shares: per step, host wait for the batch and start time."""
    waits, starts = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        starts.append(t0)
        x = fetch()
        waits.append(time.perf_counter() - t0)
        compute(x)
        if step % sync_every == sync_every - 1:
            sync()
    return waits, starts


def cuda_fetchers(device: torch.device, depth: int) -> dict[str, Callable[[dict, list], tuple[Callable, Callable]]]:
    """Per variant: (loaders, copies) -> (fetch, close); ``copies`` collects copy timings."""

    def timed_to(b: torch.Tensor, non_blocking: bool, copies: list, stream: Any = None) -> torch.Tensor:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(stream)
        x = b.to(device, non_blocking=non_blocking)
        e.record(stream)
        copies.append((s, e))
        return x

    def sync(loaders: dict, copies: list):
        it = iter(loaders["pageable"])
        return (lambda: timed_to(next(it), False, copies)), None

    def pinned(loaders: dict, copies: list):
        it = iter(loaders["pinned"])
        return (lambda: timed_to(next(it), True, copies)), None

    def one_ahead(loaders: dict, copies: list):
        stream = torch.cuda.Stream(device=device)  # the recipe makes one per epoch
        cur = torch.cuda.current_stream(device)
        it = iter(loaders["pinned"])

        def preload() -> torch.Tensor | None:
            b = next(it, None)
            if b is None:
                return None
            with torch.cuda.stream(stream):
                return timed_to(b, True, copies, stream)

        state = {"next": preload()}

        def fetch() -> torch.Tensor:
            cur.wait_stream(stream)
            x = state["next"]
            x.record_stream(cur)
            state["next"] = preload()
            return x

        return fetch, None

    def prefetch_over(kind: str) -> Callable:
        def make(loaders: dict, copies: list):
            pf = CUDAPrefetcher(loaders[kind], device=device, depth=depth)
            it = iter(pf)

            def close() -> None:
                torch.cuda.synchronize(device)
                pf.close()  # folds the timing of every finished copy into the stats
                copies.append(pf.stats())

            return (lambda: next(it)), close
        return make

    return {"sync": sync, "pinned": pinned, "one_ahead": one_ahead,
            "prefetcher": prefetch_over("pageable"), "prefetcher_pinned": prefetch_over("pinned")}


def _copy_gbps(copies: list, nbytes: int, *, skip: int) -> float:
    """Median copy GB/s from (start, end) event pairs after warm-up, or a prefetcher's own figure."""
    if copies and isinstance(copies[-1], dict):
        return float(copies[-1]["copy_gbps"])
    times = [s.elapsed_time(e) / 1e3 for s, e in copies[skip:]]
    return nbytes / statistics.median(times) / 1e9 if times else 0.0


def bench_cuda(args: argparse.Namespace, device: torch.device) -> dict:
    torch.cuda.set_device(device)
    nbytes = int(args.batch_mb * 1e6)
    pageable = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(3)]
    pinned = [b.pin_memory() for b in pageable]
    cycles_per_ms = calibrate_sleep(device)
    raw = raw_copy(pinned[0], pageable[0], device)
    acc = torch.zeros((), device=device, dtype=torch.int64)
    results = []
    for compute_ms in args.compute_ms:
        cycles = int(cycles_per_ms * compute_ms)

        def compute(x: torch.Tensor) -> None:
            torch.cuda._sleep(cycles)
            acc.add_(x[-4096:].sum())  # the "model" reads the batch (its last bytes) after working

        resident = pinned[0].to(device)
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
        measured = statistics.median(_timed(lambda: resident, compute, sync, args)[0] for _ in range(args.reps))
        for jitter in args.jitter:
            cfg = _config(args, compute_ms, jitter)
            cfg["measured_compute_ms"] = measured * 1e3
            ideal = max(measured * 1e3, raw["pinned_copy_ms"], cfg["mean_load_ms"])
            for name, make in cuda_fetchers(device, args.depth).items():
                runs = []
                for rep in range(args.reps):
                    loaders = {k: SyntheticLoader(v, steps=args.warmup + args.steps, load_ms=cfg["load_ms"],
                                                  jitter=jitter, spike_ms=cfg["spike_ms"], seed=rep)
                               for k, v in (("pageable", pageable), ("pinned", pinned))}
                    copies: list = []
                    fetch, close = make(loaders, copies)
                    runs.append(_timed(fetch, compute, sync, args) + (copies,))
                    if close is not None:
                        close()
                gbps = [_copy_gbps(r[2], nbytes, skip=args.warmup) for r in runs]
                results.append(_summary(name, cfg, ideal, runs, statistics.median(gbps), raw))
    return {"raw": raw, "cycles_per_ms": cycles_per_ms, "results": results}


def _timed(fetch: Callable, compute: Callable, sync: Callable, args: argparse.Namespace) -> tuple:
    """(steady-state seconds per step after warm-up, host waits after warm-up)."""
    sync()
    waits, starts = run_loop(fetch, args.warmup + args.steps, compute, sync, args.sync_every)
    sync()
    end = time.perf_counter()
    return (end - starts[args.warmup]) / args.steps, waits[args.warmup:]


def _config(args: argparse.Namespace, compute_ms: float, jitter: float) -> dict:
    load_ms = args.load_ms if args.load_ms is not None else 0.2 * compute_ms
    spike_ms = args.spike_ms if args.spike_ms is not None else 2.0 * compute_ms
    return {"compute_ms": compute_ms, "jitter": jitter, "load_ms": load_ms, "spike_ms": spike_ms,
            "mean_load_ms": load_ms + jitter * spike_ms, "batch_mb": args.batch_mb, "depth": args.depth,
            "sync_every": args.sync_every, "steps": args.steps}


def _summary(name: str, cfg: dict, ideal_ms: float, runs: list, gbps: float | None, raw: dict | None) -> dict:
    step_ms = statistics.median(r[0] for r in runs) * 1e3
    p50, p99 = _pcts([w for r in runs for w in r[1]])
    out = {"variant": name, **cfg, "step_ms": step_ms, "ideal_ms": ideal_ms,
           "efficiency": ideal_ms / step_ms, "wait_p50_ms": p50, "wait_p99_ms": p99}
    if gbps is not None and raw is not None:
        out["h2d_gbps"] = gbps
        out["h2d_vs_raw"] = gbps / raw["pinned_gbps"]
    return out


# --- CPU --------------------------------------------------------------------------------------------


def bench_cpu(args: argparse.Namespace) -> dict:
    batches = [torch.zeros(1024, dtype=torch.uint8) for _ in range(3)]
    results = []
    for compute_ms in args.compute_ms:
        def compute(_x: Any) -> None:
            _sleep_precise(compute_ms / 1e3)  # stands for GPU work the host waits on

        batch = batches[0]
        measured = statistics.median(_timed(lambda: batch, compute, lambda: None, args)[0] for _ in range(args.reps))
        for jitter in args.jitter:
            cfg = _config(args, compute_ms, jitter)
            cfg["measured_compute_ms"] = measured * 1e3
            ideal = max(measured * 1e3, cfg["mean_load_ms"])
            for name in ("plain", "prefetcher"):
                runs = []
                for rep in range(args.reps):
                    loader = SyntheticLoader(batches, steps=args.warmup + args.steps, load_ms=cfg["load_ms"],
                                             jitter=jitter, spike_ms=cfg["spike_ms"], seed=rep)
                    pf = CUDAPrefetcher(loader, device="cpu", depth=args.depth) if name == "prefetcher" else None
                    it = iter(pf if pf is not None else loader)
                    runs.append(_timed(lambda: next(it), compute, lambda: None, args) + ([],))
                    if pf is not None:
                        pf.close()
                results.append(_summary(name, cfg, ideal, runs, None, None))
    return {"results": results}


# --- main -------------------------------------------------------------------------------------------


def _table(results: list[dict]) -> str:
    cols = ["variant", "compute_ms", "measured_compute_ms", "jitter", "step_ms", "ideal_ms", "efficiency", "wait_p50_ms", "wait_p99_ms"]
    if results and "h2d_gbps" in results[0]:
        cols += ["h2d_gbps", "h2d_vs_raw"]
    rows = [cols] + [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    ap.add_argument("--batch-mb", type=float, default=38.5, help="batch size in MB of uint8 (default 38.5)")
    ap.add_argument("--compute-ms", type=float, nargs="+", help="compute step(s) in ms (default 10 and 0.5 on CUDA, 10 on CPU)")
    ap.add_argument("--load-ms", type=float, help="host time per next() (default 0.2 x compute)")
    ap.add_argument("--jitter", type=float, nargs="+", default=[0.0, 0.1], help="spike probabilities (default 0 0.1)")
    ap.add_argument("--spike-ms", type=float, help="extra delay of a late batch (default 2 x compute)")
    ap.add_argument("--depth", type=int, default=2, help="CUDAPrefetcher depth (default 2)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per run (default 200)")
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps per run (default 10)")
    ap.add_argument("--sync-every", type=int, default=1, help="synchronise every N steps (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the median is reported (default 3)")
    ap.add_argument("--quick", action="store_true", help="one short configuration (a few seconds)")
    ap.add_argument("--json", type=Path, help="write results here")
    args = ap.parse_args(argv)
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device.startswith("cuda")
    if args.quick:
        args.steps, args.warmup, args.reps = 40, 5, 1
        args.jitter = args.jitter if args.jitter != [0.0, 0.1] else [0.1]
        args.compute_ms = args.compute_ms or [5.0]
        args.batch_mb = min(args.batch_mb, 16.0)
    args.compute_ms = args.compute_ms or ([10.0, 0.5] if use_cuda else [10.0])
    for name in ("depth", "steps", "sync_every", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if use_cuda:
        device = torch.device("cuda" if args.device == "auto" else args.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        report = bench_cuda(args, device)
        where = torch.cuda.get_device_name(device)
    else:
        report = bench_cpu(args)
        where = f"cpu ({platform.processor() or platform.machine()})"
    print(f"h2d_overlap on {where}; torch {torch.__version__}")
    if "raw" in report:
        raw = report["raw"]
        print(f"raw copy of {args.batch_mb} MB: pinned {raw['pinned_copy_ms']:.3f} ms ({raw['pinned_gbps']:.1f} GB/s),"
              f" pageable {raw['pageable_copy_ms']:.3f} ms ({raw['pageable_gbps']:.1f} GB/s)")
    print(_table(report["results"]))
    if args.json:
        report.update(device=where, torch=torch.__version__, python=platform.python_version(),
                      args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
