"""GIL-held cost of the CPU decode path's steps, per call, old and new in one run.

The thread decoder (``DataLoader(decode_threads=N)``) is bounded by the time each sample holds
the GIL. Per step this prints:

- ``cpu``: CPU microseconds per call in one thread (``time.thread_time``: other processes' load does
  not inflate it; best of 5);
- ``1 thr`` / ``2 thr``: wall microseconds per call with one thread, and per call with two threads
  calling it together (a step that never holds the GIL halves it on 2 free cores; on a shared
  machine this is only indicative);
- ``GIL wait``: microseconds per call an observer thread spent waiting for the GIL while one thread
  called the step in a loop (switch interval 1 s, so the step gives the GIL up only where it
  releases it itself; waiting = wall - on a CPU - in the run queue, from schedstat). On a crowded
  machine the observer often waits for a CPU instead and this reads low: the calibration rows
  (pure Python for 100 us: GIL held throughout; sha256 of 1 MB: released) show how far to trust it.

Steps, on the JPEGs of ``decode_stage.py``'s corpus (photo-like, 300-640 px) and on random 224 x 224
images: ``to_tensor_asarray`` is ``image_to_tensor`` as it was (``np.asarray``: Pillow ``tobytes``,
GIL held) next to ``to_tensor`` (``fastdata.decode.image_to_tensor``); ``tobytes`` alone; ``open``
(``Image.open``, the header parse); ``pillow_load`` (open + Pillow's own ``load``) next to
``decode`` (``ImageDecoder().pil``); ``decode_to_tensor`` (``ImageDecoder()``) next to
``decode_to_tensor_asarray`` (Pillow load + the old conversion); ``sample``
(``decode_stage.DecodeRandomResizedCropFlip``: decode, random crop to 224, flip, to tensor). The
``gil_share`` of the JSON divides each ``to_tensor`` row's GIL wait by its ``to_tensor_asarray`` row's
(the 2000x1500 image is tests/decode/test_image_to_tensor.py's; docs/design/decode_gil.md records the figure).

    flock /tmp/bench.lock python benchmarks/decode_gil.py --json /tmp/decode_gil.json
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def to_tensor_asarray(img: Any) -> Any:
    """``image_to_tensor`` as it was before the GIL-free path (reference for the comparison)."""
    import torch

    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:
        return torch.from_numpy(np.array(arr[None], copy=True))
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def _schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns waiting in the run queue) of the calling thread."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, run_wait, _ = f.read().split()
    return int(on_cpu), int(run_wait)


def gil_wait_us(fn: Callable[[], Any], seconds: float = 0.3, rounds: int = 3) -> float:
    """Microseconds per call of ``fn`` that an observer thread spends waiting for the GIL while a
    thread calls ``fn`` in a loop (median of ``rounds``). The switch interval is 1 s meanwhile, so the
    caller gives the GIL up only where ``fn`` releases it; the observer runs pure Python and gives
    it up every ~50 us (``time.sleep(0)``). Waiting = wall - on a CPU - in the run queue (schedstat):
    other processes' load is not counted, but an observer that waits for a CPU while ``fn`` holds the
    GIL does not see that stretch, so on a crowded machine this reads low (see the calibration rows)."""
    res = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        for _ in range(rounds):
            stop = threading.Event()
            blocked = [0.0]
            calls = [0]

            def observe(stop: threading.Event = stop, blocked: list[float] = blocked) -> None:
                while not stop.is_set():
                    t0, (c0, w0) = time.perf_counter_ns(), _schedstat()
                    x = 0
                    for i in range(2000):
                        x += i
                    time.sleep(0)
                    t1, (c1, w1) = time.perf_counter_ns(), _schedstat()
                    blocked[0] += ((t1 - t0) - (c1 - c0) - (w1 - w0)) / 1e3

            def run(stop: threading.Event = stop, calls: list[int] = calls) -> None:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    fn()
                    calls[0] += 1
                stop.set()

            threads = [threading.Thread(target=observe), threading.Thread(target=run)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            res.append(blocked[0] / max(calls[0], 1))
    finally:
        sys.setswitchinterval(old)
    return statistics.median(res)


def cpu_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    """Best CPU microseconds per call of ``fn`` in this thread (``time.thread_time``)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t) / calls * 1e6)
    return best


def wall_us(fn: Callable[[], Any], threads: int, calls: int, rounds: int = 5) -> float:
    """Median wall us per call with ``threads`` threads each making ``calls`` calls."""
    def work() -> None:
        for _ in range(calls):
            fn()

    res = []
    for _ in range(rounds):
        ts = [threading.Thread(target=work) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res.append((time.perf_counter() - t0) / (threads * calls) * 1e6)
    return statistics.median(res)


def cycling(items: list[Any], fn: Callable[[Any], Any]) -> Callable[[], Any]:
    """A no-argument call applying ``fn`` to the next item (two threads may repeat an item)."""
    pos = [0]

    def call() -> Any:
        i = pos[0]
        pos[0] = (i + 1) % len(items)
        return fn(items[i])

    return call


def _python_100us() -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < 100e-6:
        pass


def steps(jpegs: list[bytes]) -> dict[str, Callable[[], Any]]:
    import hashlib
    import random

    from decode_stage import DecodeRandomResizedCropFlip
    from PIL import Image

    from fastdata.decode import ImageDecoder, image_to_tensor

    rng = np.random.default_rng(0)
    rgb = [Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)) for _ in range(4)]
    grey = [im.convert("L") for im in rgb]
    full = [ImageDecoder().pil(d) for d in jpegs[:16]]
    big = [Image.fromarray(np.random.default_rng(0).integers(0, 256, (1500, 2000, 3), dtype=np.uint8))]
    blob = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    random.seed(0)
    dec = ImageDecoder()
    sample = DecodeRandomResizedCropFlip()

    def pillow_load(d: bytes) -> Any:
        img = Image.open(io.BytesIO(d))
        img.load()
        return img

    return {
        "calib: python 100 us": _python_100us,
        "calib: sha256 1 MB": lambda: hashlib.sha256(blob).digest(),
        "tobytes RGB 224": cycling(rgb, lambda im: im.tobytes()),
        "to_tensor_asarray RGB 224": cycling(rgb, to_tensor_asarray),
        "to_tensor RGB 224": cycling(rgb, image_to_tensor),
        "to_tensor_asarray L 224": cycling(grey, to_tensor_asarray),
        "to_tensor L 224": cycling(grey, image_to_tensor),
        "to_tensor_asarray RGB full": cycling(full, to_tensor_asarray),
        "to_tensor RGB full": cycling(full, image_to_tensor),
        "to_tensor_asarray RGB 2000x1500": cycling(big, to_tensor_asarray),
        "to_tensor RGB 2000x1500": cycling(big, image_to_tensor),
        "open": cycling(jpegs, lambda d: Image.open(io.BytesIO(d))),
        "pillow_load": cycling(jpegs, pillow_load),
        "decode": cycling(jpegs, dec.pil),
        "decode_to_tensor_asarray": cycling(jpegs, lambda d: to_tensor_asarray(pillow_load(d))),
        "decode_to_tensor": cycling(jpegs, dec),
        "sample": cycling(jpegs, sample),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=512, help="corpus of decode_stage.py (built if missing)")
    ap.add_argument("--data", type=Path, default=None, help="decode_stage.py's --data")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of step names to run")
    ap.add_argument("--seconds", type=float, default=0.3, help="per observer round (3 rounds)")
    ap.add_argument("--repeat", type=int, default=1, help="passes over all steps (interleaved); medians reported")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import tempfile

    import torch
    from decode_stage import prepare

    torch.set_num_threads(1)
    data = args.data or Path(tempfile.gettempdir()) / "fastdata-bench-decode"
    folder, _ = prepare(data, args.images, 4)
    jpegs = [f.read_bytes() for f in sorted(folder.glob("class_*/img_*.jpg"))[:128]]
    load0 = os.getloadavg()
    todo = {k: v for k, v in steps(jpegs).items() if not args.only or any(s in k for s in args.only)}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in todo}
    for rep in range(args.repeat):
        for name, fn in todo.items():
            for _ in range(20):
                fn()  # warm-up
            calls = max(8, int(0.1e6 / max(cpu_us(fn, 8, 1), 1.0)))
            one, two = wall_us(fn, 1, calls), wall_us(fn, 2, calls)
            runs[name].append({"cpu_us": cpu_us(fn, calls), "wall_us_1thread": one, "wall_us_per_call_2threads": two,
                               "speedup_2threads": one / two, "gil_wait_us": gil_wait_us(fn, args.seconds)})
        print(f"pass {rep + 1}/{args.repeat} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    results = {name: {k: round(statistics.median(r[k] for r in rs), 2 if k == "speedup_2threads" else 1)
                      for k in rs[0]} for name, rs in runs.items()}
    print(f"{'step':28s} {'cpu':>8s} {'1 thr':>8s} {'2 thr':>8s} {'x':>5s} {'GIL wait':>9s}  (us per call, "
          f"median of {args.repeat})")
    for name, r in results.items():
        print(f"{name:28s} {r['cpu_us']:8.1f} {r['wall_us_1thread']:8.1f} {r['wall_us_per_call_2threads']:8.1f} "
              f"{r['speedup_2threads']:5.2f} {r['gil_wait_us']:9.1f}")
    out = {"benchmark": "decode_gil", "load_avg_start": load0, "load_avg_end": os.getloadavg(),
           "python": sys.version.split()[0], "repeat": args.repeat, "results": results, "runs": runs}
    # the GIL share: another thread's GIL wait behind image_to_tensor as a share of its wait behind np.asarray
    images = [k.removeprefix("to_tensor ") for k in results if k.startswith("to_tensor ")]
    out["gil_share"] = {im: round(results[f"to_tensor {im}"]["gil_wait_us"] / results[f"to_tensor_asarray {im}"]["gil_wait_us"], 3)
                        for im in images if results.get(f"to_tensor_asarray {im}", {}).get("gil_wait_us")}
    for k, v in out["gil_share"].items():
        print(f"GIL share, to_tensor vs np.asarray, {k}: {v:.3f}")
    print(f"load average {load0[0]:.2f} at the start, {out['load_avg_end'][0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
