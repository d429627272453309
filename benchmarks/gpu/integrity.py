"""Issue 13 item 10 on the GPU machine (Python 3.12, CUDA torch): do early stops abort spawn/forkserver
workers, and do CUDAPrefetcher epochs fork workers while a thread runs?

    python3 benchmarks/gpu/integrity.py --out DIR [--rounds 10] [--budget 150]

Each scenario runs in a subprocess (worker stderr is captured with it); a failing scenario is
reported and the next one runs. Counts, per scenario: rounds run, "terminate called" lines,
"killed by signal" errors, "multi-threaded ... fork()" DeprecationWarnings (Python >= 3.12), exit
status. Writes DIR/integrity.json and prints a table. Nothing here is timed for performance.
"plain shared spawn del os._exit" tests a hypothesis: spawned workers leave through full interpreter
finalization (multiprocessing.spawn calls sys.exit; fork and forkserver children call os._exit), so
C++ static destructors run there, and a still-running native thread then aborts the process
("terminate called without an active exception"); skipping them should remove the aborts.
Also runnable in the CUDA-free dev container. There, one run saw "fastdata spawn del" abort in 2 of
10 rounds (and a plain repro in 6 of 60) until fastdata's workers began to leave through ``os._exit``
(``fastdata.loader._exit``, the hypothesis above confirmed for fastdata.DataLoader): 0 of 10 since
(0 of 60 in the repro); plain torch loaders keep torch's exit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A plain torch IterableDataset, with or without a share_memory_() tensor (the suspected cause).
PLAIN = r'''
import atexit, os, sys, torch
from torch.utils.data import IterableDataset, DataLoader
def quick_exit(_):  # hypothesis test: skip C++ static destructors at a spawned worker's exit
    atexit.register(os._exit, 0)
class DS(IterableDataset):
    def __init__(self, shared):
        self.t = torch.zeros(1, dtype=torch.int64).share_memory_() if shared else None
    def __iter__(self):
        for i in range(2000):
            yield torch.full((256,), i)
if __name__ == "__main__":
    shared, ctx, rounds = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3])
    init = quick_exit if len(sys.argv) > 4 and sys.argv[4] == "quick_exit" else None
    ds = DS(shared)
    for r in range(rounds):
        it = iter(DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=ctx, worker_init_fn=init))
        next(it); next(it)
        del it
        print("round", r, flush=True)
    print("ok", flush=True)
'''

# fastdata: ShardedDataset (shared epoch counter) + DataLoader; early stop by del or prefetcher close.
FASTDATA = r'''
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[5])
import fastdata
from fastdata import DataLoader, ShardedDataset
from fastdata.shards.writer import ShardWriter
if __name__ == "__main__":
    ctx, rounds, mode, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with ShardWriter(folder, max_samples=64, overwrite=True) as w:
        for i in range(512):
            w.write({"__key__": f"s{i:04d}", "cls": i % 10, "img.npy": np.full((3, 16, 16), i % 251, np.uint8)})
    ds = ShardedDataset(folder, shuffle=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for r in range(rounds):
        loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=ctx)
        if mode == "del":
            it = iter(loader); next(it); next(it); del it
        else:
            pf = fastdata.CUDAPrefetcher(loader, device=dev)
            it = iter(pf); next(it); next(it); pf.close(); del it
        print("round", r, flush=True)
    n = sum(len(b["__key__"]) for b in DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=ctx))
    print("ok", n, flush=True)
'''

# Non-persistent fork workers behind a CUDAPrefetcher, 3 epochs: DeprecationWarnings of fork().
FORKWARN = r'''
import sys, warnings, numpy as np, torch
sys.path.insert(0, sys.argv[3])
warnings.simplefilter("always", DeprecationWarning)
import fastdata
from fastdata import DataLoader, ShardedDataset
from fastdata.shards.writer import ShardWriter
if __name__ == "__main__":
    seamless, folder = sys.argv[1] == "1", sys.argv[2]
    with ShardWriter(folder, max_samples=64, overwrite=True) as w:
        for i in range(256):
            w.write({"__key__": f"s{i:04d}", "cls": i % 10})
    ds = ShardedDataset(folder)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pf = fastdata.CUDAPrefetcher(DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork"),
                                 device=dev, seamless=seamless)
    for e in range(3):
        assert sum(len(b["__key__"]) for b in pf) == 256
    pf.close()
    print("ok", flush=True)
'''


def run(name: str, code: str, args: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        p = subprocess.run([sys.executable, f.name, *args], capture_output=True, text=True, timeout=timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout"
    finally:
        os.unlink(f.name)
    return {
        "scenario": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
        "rounds": out.count("round "), "ok": "ok" in out,
        "terminate_called": err.count("terminate called"),
        "killed_by_signal": err.count("killed by signal"),
        "fork_multithreaded_warnings": err.count("multi-threaded"),
        "stderr_tail": err[-1500:],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--budget", type=float, default=180.0, help="seconds for all scenarios together")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    r = str(args.rounds)
    plan = [  # the fork-warning pair first: it is quick (fork) and decides seamless; spawn rounds take seconds each
        ("fork warnings seamless=True", FORKWARN, ["1", os.path.join(tmp, "d"), ROOT]),
        ("fork warnings seamless=False", FORKWARN, ["0", os.path.join(tmp, "e"), ROOT]),
        ("plain shared spawn del", PLAIN, ["1", "spawn", r]),
        ("plain noshared spawn del", PLAIN, ["0", "spawn", r]),
        ("plain shared spawn del os._exit", PLAIN, ["1", "spawn", r, "quick_exit"]),
        ("fastdata spawn del", FASTDATA, ["spawn", r, "del", os.path.join(tmp, "a"), ROOT]),
        ("fastdata spawn prefetch-close", FASTDATA, ["spawn", r, "close", os.path.join(tmp, "b"), ROOT]),
        ("fastdata forkserver del", FASTDATA, ["forkserver", r, "del", os.path.join(tmp, "c"), ROOT]),
    ]
    deadline = time.perf_counter() + args.budget
    results: list[dict] = []
    meta: dict = {"python": sys.version.split()[0]}

    def dump() -> None:  # after every scenario: a time limit that kills this script keeps the finished ones
        with open(os.path.join(args.out, "integrity.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)

    for name, code, a in plan:
        left = deadline - time.perf_counter()
        if left < 5:
            results.append({"scenario": name, "rc": "not run (budget)"})
            continue
        try:
            results.append(run(name, code, a, timeout=min(left, 90)))
        except Exception as e:  # noqa: BLE001 - report and go on
            results.append({"scenario": name, "rc": f"error: {e!r}"})
        dump()
    try:
        import torch
        meta.update(torch=torch.__version__, cuda=torch.cuda.is_available())
    except Exception as e:  # noqa: BLE001
        meta["torch"] = repr(e)
    dump()
    print(f"integrity (issue 13 item 10) on {meta}")
    print(f"{'scenario':32} {'rc':>8} {'rounds':>6} {'terminate':>9} {'killed':>6} {'forkwarn':>8} {'s':>6}")
    for x in results:
        print(f"{x['scenario']:32} {str(x.get('rc')):>8} {x.get('rounds', '-')!s:>6} {x.get('terminate_called', '-')!s:>9} "
              f"{x.get('killed_by_signal', '-')!s:>6} {x.get('fork_multithreaded_warnings', '-')!s:>8} "
              f"{x.get('seconds', '-')!s:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
