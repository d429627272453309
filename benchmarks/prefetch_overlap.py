"""How much of a CPU loop's time CUDAPrefetcher(device="cpu") hides; tests/prefetch/ checks the
mechanisms, this measures what they save (docs/design/prefetch_overlap.md).

- ``overlap``: a loader whose ``next()`` takes ``--load-ms`` (a sleep: it releases the GIL, as I/O and
  decoding in C do) feeds a consumer whose step takes ``--step-ms``, ``--batches`` batches, once as a plain
  loop and once through the prefetcher, interleaved ``--repeat`` times: the medians and their ratio (ideal
  with equal times: about 0.5; 1.0 means no overlap).
- ``seamless``: 8 quick batches per epoch whose iterator starts ``--startup-ms`` late (workers starting),
  a 40 ms step, 4 epochs (the first not counted): the consumer's wait p99 per batch with and without
  ``seamless`` epochs (the next epoch's iterator started ahead), medians over ``--repeat``.

    python benchmarks/prefetch_overlap.py --json benchmarks/results/prefetch_overlap_cpu2.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(wrap: bool, batches: int, load_s: float, step_s: float) -> float:
    """Wall seconds of one pass."""
    from fastdata.prefetch import CUDAPrefetcher

    class Loader:  # re-iterable, as a DataLoader
        def __iter__(self) -> Any:
            for i in range(batches):
                time.sleep(load_s)
                yield i

    t0 = time.perf_counter()
    if wrap:
        with CUDAPrefetcher(Loader(), device="cpu") as pf:
            for _ in pf:
                time.sleep(step_s)
    else:
        for _ in Loader():
            time.sleep(step_s)
    return time.perf_counter() - t0


def seamless_wait_p99(seamless: bool, startup_s: float) -> float:
    """The consumer's wait p99 (s) over epochs 2-4 of a loader whose epochs start ``startup_s`` late."""
    import torch

    from fastdata.prefetch import CUDAPrefetcher

    class SlowStart:
        def __len__(self) -> int:
            return 8

        def __iter__(self) -> Any:  # the first batch comes late, as from workers just started
            time.sleep(startup_s)
            yield from (torch.full((4,), i) for i in range(8))

    with CUDAPrefetcher(SlowStart(), device="cpu", depth=2, seamless=seamless) as pf:
        for epoch in range(4):
            for _ in pf:
                time.sleep(0.04)
            if epoch == 0:
                pf.reset_stats()
        return float(pf.stats()["wait_p99_s"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--load-ms", type=float, default=20.0)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--startup-ms", type=float, default=40.0)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    plain, prefetched = [], []
    for _ in range(args.repeat):
        plain.append(run(False, args.batches, args.load_ms / 1e3, args.step_ms / 1e3))
        prefetched.append(run(True, args.batches, args.load_ms / 1e3, args.step_ms / 1e3))
    out = {"benchmark": "prefetch_overlap", "args": vars(args) | {"json": None}, "load_avg_start": load0,
           "load_avg_end": os.getloadavg(), "plain_s": statistics.median(plain),
           "prefetched_s": statistics.median(prefetched), "runs": {"plain": plain, "prefetched": prefetched}}
    out["ratio"] = round(out["prefetched_s"] / out["plain_s"], 3)
    print(f"overlap: plain {out['plain_s']:.3f} s, prefetched {out['prefetched_s']:.3f} s: ratio {out['ratio']:.3f} "
          f"(median of {args.repeat}; load average {load0[0]:.2f} at the start)")
    waits: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeat):
        for seamless in (True, False):
            waits[seamless].append(seamless_wait_p99(seamless, args.startup_ms / 1e3))
    out["seamless_wait_p99_ms"] = round(statistics.median(waits[True]) * 1e3, 2)
    out["not_seamless_wait_p99_ms"] = round(statistics.median(waits[False]) * 1e3, 2)
    out["runs"]["seamless_wait_p99_s"] = waits[True]
    out["runs"]["not_seamless_wait_p99_s"] = waits[False]
    out["load_avg_end"] = os.getloadavg()
    print(f"seamless: wait p99 {out['seamless_wait_p99_ms']:.2f} ms, not seamless {out['not_seamless_wait_p99_ms']:.2f} "
          f"ms (start-up {args.startup_ms:g} ms; median of {args.repeat})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
