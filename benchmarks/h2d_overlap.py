"""Host-to-device overlap: does the GPU ever wait for an input copy?

A synthetic loader hands out pre-made CPU batches (``--batch-mb`` of uint8, default one
256x3x224x224 batch = 38.5 MB); each ``next()`` costs ``--load-ms`` of host time, and with
``--jitter P`` a batch is late by ``--spike-ms`` with probability P (seeded: every variant sees the
same sequence). A synthetic compute step runs ``--compute-ms`` on the GPU (``torch.cuda._sleep``,
calibrated) and reads the batch; ``--sync-every 1`` (default) synchronises the training stream after
each step as a training loop does with ``loss.item()`` or GradScaler (the host waits for the step, not
for copies of later batches still running on a side stream). Compared in the same run:

- ``sync``: pageable ``batch.to(device)``;
- ``pinned``: batches already pinned (as DataLoader ``pin_memory=True`` delivers them),
  ``.to(device, non_blocking=True)`` in a plain loop (the copy queues behind compute);
- ``one_ahead``: the apex/timm pattern: one batch ahead on a side stream, ``wait_stream`` +
  ``record_stream``, ``next()`` on the training thread, over the pinned loader;
- ``one_ahead_pin``: the same over the pageable loader, pinning each batch in the training thread
  (``batch.pin_memory()`` before the copy, as apex's ``data_prefetcher`` does without a pinning loader);
- ``prefetcher``: ``CUDAPrefetcher`` over the pageable loader (it pins in its own thread);
- ``prefetcher_pinned``: ``CUDAPrefetcher`` over the pinned loader (direct copies).

Multi-epoch mode (``--epochs N``): the same steps split into N epochs, each starting
``--epoch-start-ms`` late (a loader whose workers restart); every variant starts a new iterator per
epoch (``CUDAPrefetcher``: seamless epochs, the next one is started ahead), so the waits at epoch
starts show in wait p99.

``--pack`` measures the options for getting a pageable batch into pinned memory: one thread
(torch ``copy_`` with 1 and with all intra-op threads), ``PackPool`` with 1..N numpy threads (what
``CUDAPrefetcher`` uses, ``pack_threads=``), and registering the batch's own pages per batch
(``cudaHostRegister`` + copy + unregister, no pack at all).

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
                 spike_ms: float, seed: int = 0, epochs: int = 1, start_ms: float = 0.0) -> None:
        self.batches, self.steps = batches, steps
        rng = np.random.default_rng(seed)
        spikes = rng.random(steps) < jitter
        self.delays = (load_ms + spikes * spike_ms) / 1e3
        self.per_epoch = -(-steps // epochs)
        self.start_s = start_ms / 1e3
        self.epoch = 0

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        first = self.epoch * self.per_epoch
        self.epoch += 1
        return self._epoch(first)

    def _epoch(self, first: int) -> Iterator[torch.Tensor]:
        _sleep_precise(self.start_s)
        for i in range(first, min(first + self.per_epoch, self.steps)):
            _sleep_precise(self.delays[i])
            yield self.batches[i % len(self.batches)]


def _endless(make_epoch: Callable[[], Iterator[Any]]) -> Callable[[], Any]:
    """``fetch()`` over consecutive epochs: a new epoch iterator whenever one is exhausted."""
    def gen() -> Iterator[Any]:
        while True:
            empty = True
            for x in make_epoch():
                empty = False
                yield x
            if empty:
                return
    it = gen()
    return lambda: next(it)


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


def cuda_fetchers(device: torch.device, depth: int, pack_threads: int | None = None, epochs: int = 1
                  ) -> dict[str, Callable[[dict, list], tuple[Callable, Callable]]]:
    """Per variant: (loaders, copies) -> (fetch, close); ``copies`` collects copy timings."""

    def timed_to(b: torch.Tensor, non_blocking: bool, copies: list, stream: Any = None) -> torch.Tensor:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(stream)
        x = b.to(device, non_blocking=non_blocking)
        e.record(stream)
        copies.append((s, e))
        return x

    def sync(loaders: dict, copies: list):
        return _endless(lambda: (timed_to(b, False, copies) for b in loaders["pageable"])), None

    def pinned(loaders: dict, copies: list):
        return _endless(lambda: (timed_to(b, True, copies) for b in loaders["pinned"])), None

    def one_ahead_epoch(loader: Any, copies: list, pin: bool) -> Iterator[torch.Tensor]:
        stream = torch.cuda.Stream(device=device)  # the recipe makes one per epoch
        cur = torch.cuda.current_stream(device)
        it = iter(loader)

        def preload() -> torch.Tensor | None:
            b = next(it, None)
            if b is None:
                return None
            if pin:
                b = b.pin_memory()  # in the training thread
            with torch.cuda.stream(stream):
                return timed_to(b, True, copies, stream)

        nxt = preload()
        while nxt is not None:
            cur.wait_stream(stream)
            x = nxt
            x.record_stream(cur)
            nxt = preload()
            yield x

    def one_ahead(loaders: dict, copies: list):
        return _endless(lambda: one_ahead_epoch(loaders["pinned"], copies, False)), None

    def one_ahead_pin(loaders: dict, copies: list):
        return _endless(lambda: one_ahead_epoch(loaders["pageable"], copies, True)), None

    def prefetch_over(kind: str, **kw: Any) -> Callable:
        def make(loaders: dict, copies: list):
            pf = CUDAPrefetcher(loaders[kind], device=device, depth=depth, pack_threads=pack_threads, **kw)

            def close() -> None:
                torch.cuda.synchronize(device)
                pf.close()  # folds the timing of every finished copy into the stats
                copies.append(pf.stats())

            return _endless(lambda: iter(pf)), close
        return make

    variants = {"sync": sync, "pinned": pinned, "one_ahead": one_ahead, "one_ahead_pin": one_ahead_pin,
                "prefetcher": prefetch_over("pageable"), "prefetcher_pinned": prefetch_over("pinned")}
    if epochs > 1:
        variants["prefetcher_no_seamless"] = prefetch_over("pageable", seamless=False)
    return variants


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
        # the training stream, as loss.item(): torch.cuda.synchronize() would also wait for the copies a
        # pipeline keeps in flight on its side stream (two batches ahead for the prefetcher at depth 2, one
        # for one_ahead), a stall no training loop has, and charge it to the deeper pipeline
        stream = torch.cuda.current_stream(device)
        sync = stream.synchronize
        measured = statistics.median(_timed(lambda: resident, compute, sync, args)[0] for _ in range(args.reps))
        for jitter in args.jitter:
            cfg = _config(args, compute_ms, jitter)
            cfg["measured_compute_ms"] = measured * 1e3
            ideal = max(measured * 1e3, raw["pinned_copy_ms"], cfg["mean_load_ms"] + cfg["start_ms_per_step"])
            for name, make in cuda_fetchers(device, args.depth, args.pack_threads, args.epochs).items():
                if args.variants and name not in args.variants:
                    continue
                runs = []
                for rep in range(args.reps):
                    loaders = {k: SyntheticLoader(v, steps=args.warmup + args.steps, load_ms=cfg["load_ms"],
                                                  jitter=jitter, spike_ms=cfg["spike_ms"], seed=rep,
                                                  epochs=args.epochs, start_ms=args.epoch_start_ms)
                               for k, v in (("pageable", pageable), ("pinned", pinned))}
                    copies: list = []
                    fetch, close = make(loaders, copies)
                    runs.append(_timed(fetch, compute, sync, args) + (copies,))
                    if close is not None:
                        close()
                gbps = [_copy_gbps(r[2], nbytes, skip=args.warmup) for r in runs]
                results.append(_summary(name, cfg, ideal, runs, statistics.median(gbps), raw))
    report = {"raw": raw, "cycles_per_ms": cycles_per_ms, "results": results}
    if args.pack:
        report["pack"] = bench_pack(pageable[0], device)
    return report


def bench_pack(src: torch.Tensor, device: torch.device, reps: int = 15) -> list[dict]:
    """GB/s of each way to get a pageable batch into page-locked memory (see the module docstring)."""
    from fastdata.prefetch._stage import PackPool, _pinned_empty, _pinned_free, usable_cores

    n = src.numel()
    dst = _pinned_empty(n)
    dst_np, src_np = dst.numpy(), src.numpy()
    out = []

    def timed(name: str, fn: Callable[[], None], **extra: Any) -> None:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out.append({"option": name, "ms": t * 1e3, "gbps": n / t / 1e9, **extra})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    timed("torch copy_, 1 thread", lambda: dst.copy_(src))
    torch.set_num_threads(threads)
    timed(f"torch copy_, {threads} intra-op threads", lambda: dst.copy_(src))
    for k in sorted({1, 2, 4, 8, min(12, usable_cores())}):
        if k > usable_cores():
            continue
        pool = PackPool(k)
        timed(f"PackPool numpy, {k} threads", lambda: pool.copy([(dst_np, src_np)], n), threads=k)
        pool.close()
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    cudart = torch.cuda.cudart()

    def register_copy() -> None:  # no pack: lock the batch's own pages for the one copy
        ptr = src.data_ptr()
        if int(cudart.cudaHostRegister(ptr, n, 0)) != 0:
            raise RuntimeError("cudaHostRegister failed")
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        cudart.cudaHostUnregister(ptr)

    try:
        timed("cudaHostRegister + H2D + unregister per batch (no pack)", register_copy)
    except RuntimeError as e:
        out.append({"option": "cudaHostRegister per batch", "error": str(e)})

    def pageable_copy() -> None:
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    timed("pageable H2D (driver staging, no pack)", pageable_copy)
    _pinned_free(dst)
    return out


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
    per_epoch = -(-(args.warmup + args.steps) // args.epochs)
    return {"compute_ms": compute_ms, "jitter": jitter, "load_ms": load_ms, "spike_ms": spike_ms,
            "mean_load_ms": load_ms + jitter * spike_ms, "batch_mb": args.batch_mb, "depth": args.depth,
            "sync_every": args.sync_every, "steps": args.steps, "epochs": args.epochs,
            "epoch_start_ms": args.epoch_start_ms,
            "start_ms_per_step": args.epoch_start_ms / per_epoch if args.epochs > 1 else 0.0}


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
            ideal = max(measured * 1e3, cfg["mean_load_ms"] + cfg["start_ms_per_step"])
            names = ["plain", "prefetcher"] + (["prefetcher_no_seamless"] if args.epochs > 1 else [])
            for name in names:
                runs = []
                for rep in range(args.reps):
                    loader = SyntheticLoader(batches, steps=args.warmup + args.steps, load_ms=cfg["load_ms"],
                                             jitter=jitter, spike_ms=cfg["spike_ms"], seed=rep,
                                             epochs=args.epochs, start_ms=args.epoch_start_ms)
                    pf = None
                    if name != "plain":
                        pf = CUDAPrefetcher(loader, device="cpu", depth=args.depth, seamless=name == "prefetcher")
                    fetch = _endless(lambda: iter(pf if pf is not None else loader))
                    runs.append(_timed(fetch, compute, lambda: None, args) + ([],))
                    if pf is not None:
                        pf.close()
                results.append(_summary(name, cfg, ideal, runs, None, None))
    return {"results": results}


# --- main -------------------------------------------------------------------------------------------


def _table(results: list[dict]) -> str:
    cols = ["variant", "compute_ms", "measured_compute_ms", "jitter", "epochs", "step_ms", "ideal_ms", "efficiency",
            "wait_p50_ms", "wait_p99_ms"]
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
    ap.add_argument("--epochs", type=int, default=1, help="split the steps into this many epochs (default 1)")
    ap.add_argument("--epoch-start-ms", type=float, default=0.0,
                    help="extra delay of each epoch's first batch in multi-epoch mode (default 0)")
    ap.add_argument("--pack-threads", type=int, help="CUDAPrefetcher pack_threads (default: its own default)")
    ap.add_argument("--variants", nargs="+", help="run only these variants (CUDA)")
    ap.add_argument("--pack", action="store_true", help="also measure the pack options (CUDA)")
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
    for name in ("depth", "steps", "sync_every", "reps", "epochs"):
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
    for row in report.get("pack", []):
        print(f"pack: {row['option']:<58} " + (f"{row['ms']:7.2f} ms {row['gbps']:6.1f} GB/s" if "ms" in row else row["error"]))
    if args.json:
        report.update(device=where, torch=torch.__version__, python=platform.python_version(),
                      args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
