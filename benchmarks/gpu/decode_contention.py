"""Part (b) of check.sh: the device decode stage alone and beside a resnet18 training loop.

    python3 benchmarks/gpu/decode_contention.py --json DIR/decode.json [--budget 140]

For every decoder of ``candidates.DECODERS`` that runs here, every row of ``candidates.CANDIDATES``
that applies to it, and each stream priority of ``candidates.PRIORITIES``: the stage
(``DecodeImages`` + ``RandomResizedCrop(224)`` + flip + ``Normalize`` to bf16 channels_last) runs
inside ``CUDAPrefetcher(transform=..., stream_priority=...)`` over pinned packed batches of generated
photo-like JPEGs (300-640 px) held in memory, drained by a consumer thread that synchronises its own
stream after every batch. Per row: the stage's images/s alone (and the CPU cores this process used
meanwhile), then while the main thread trains resnet18 (bf16 autocast, channels_last, a resident
batch, the loss read every 10 steps) the stage's images/s and training's images/s, as a share of
training alone. Rows run candidate by candidate, so every decoder gets today's pipeline first when
the budget runs short; the first row runs again at the end (``repeat``: the run-to-run spread).
``best``: the row with the most of min(stage, training) images/s beside training, the rate a
training fed by that stage could reach. The JSON is rewritten after every row; a row skipped for the
budget says so (``skipped``), a failed one has its ``error``, and the exit status is 1 when a row failed.
Without CUDA the same runs on the CPU with a tiny model and host decoding: a check of the plumbing, not
a measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]  # the repository, benchmarks/, this folder

from candidates import CANDIDATES, DECODERS, PRIORITIES, Candidate, decoder_status
from decode_gpu import corpus
from report import best_row
from train_e2e import make_model, make_step

from fastdata.dataset import EncodedImage, PackedImages


def packed_batches(datas: list[bytes], size: int, pin: bool) -> list[dict[str, Any]]:
    out = []
    for k in range(0, len(datas) - size + 1, size):
        p = PackedImages.pack([EncodedImage(d, shard="synthetic", key=str(k + j), index=k + j, epoch=0)
                               for j, d in enumerate(datas[k : k + size])])
        out.append({"jpg": p.pin_memory() if pin else p, "cls": torch.arange(size) % 10})
    return out


class Cycle:
    """The batches round and round, until the consumer stops (a re-iterable: no one-shot warning)."""

    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        while True:
            yield from self.batches


class Drain(threading.Thread):
    """Consumes the prefetcher on a stream of its own, synchronised after every batch; counts images."""

    def __init__(self, pf: Any, device: torch.device) -> None:
        super().__init__(daemon=True, name="drain")
        self.pf, self.device = pf, device
        self.count = 0
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            stream = None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for b in self.pf:
                    n = int(b["jpg"].shape[0])
                    if stream is not None:
                        stream.synchronize()
                    self.count += n
                    if self.stop.is_set():
                        break
        except BaseException as e:  # noqa: BLE001 - reported by the row
            self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"

    def wait_for(self, images: int, timeout: float) -> None:
        t0 = time.perf_counter()
        while self.count < images:
            if self.error or not self.is_alive():
                raise RuntimeError(f"the stage failed: {self.error}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"the stage delivered {self.count} of {images} images in {timeout:.0f} s")
            time.sleep(0.01)


def train_images_per_s(step: Any, batch: dict[str, torch.Tensor], seconds: float) -> float:
    """Training images/s over ``seconds``: the loss read every 10 steps, as a loop that logs it (this
    synchronises the training stream only, not the stage's)."""
    n, t0, loss = 0, time.perf_counter(), None
    while time.perf_counter() - t0 < seconds:
        loss = step(batch)
        n += 1
        if n % 10 == 0:
            float(loss)
    if loss is not None:
        float(loss)
    return n * int(batch["cls"].shape[0]) / (time.perf_counter() - t0)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(decoder: str, cand: Candidate, priority: str, batches: list[dict[str, Any]], step: Any,
            train_batch: dict[str, torch.Tensor], train_alone: float, args: argparse.Namespace,
            device: torch.device) -> dict[str, Any]:
    from fastdata import gpu
    from fastdata.prefetch import CUDAPrefetcher

    on_cuda = device.type == "cuda"
    decode = cand.decode_stage(decoder, device, keys=["jpg"])
    pipe = gpu.Compose(decode, gpu.RandomResizedCrop(args.size), gpu.RandomHorizontalFlip(),
                       gpu.Normalize(keys=["jpg"], dtype=torch.bfloat16 if on_cuda else torch.float32,
                                     channels_last=on_cuda))
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    pf = CUDAPrefetcher(cand.source(decode, Cycle(batches)), device=device, transform=pipe,
                        stream_priority=priority, seamless=False)
    drain = Drain(pf, device)
    row: dict[str, Any] = {}
    try:
        drain.start()
        drain.wait_for(3 * args.batch * (cand.ahead + 1), timeout=60)  # decoder start-up, allocator warm-up
        c0, n0, t0 = cpu_s(), drain.count, time.perf_counter()
        time.sleep(args.seconds)
        n1, t1 = drain.count, time.perf_counter()
        row["stage_alone_images_per_s"] = (n1 - n0) / (t1 - t0)
        row["cpu_cores_alone"] = (cpu_s() - c0) / (t1 - t0)
        n0, t0 = drain.count, time.perf_counter()
        train = train_images_per_s(step, train_batch, args.seconds * 1.5)
        n1, t1 = drain.count, time.perf_counter()
        if drain.error:
            raise RuntimeError(f"the stage failed: {drain.error}")
        row.update(stage_beside_images_per_s=(n1 - n0) / (t1 - t0), train_beside_images_per_s=train,
                   train_share=train / train_alone, host_decoded=decode.host_decoded)
        if on_cuda:
            row["peak_allocated_MB"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    finally:
        drain.stop.set()
        drain.join(timeout=30)
        pf.close()
        decode.close()  # its decode threads, and what calls without a host wait still hold
    return row


def environment(device: torch.device) -> dict[str, Any]:
    from importlib import metadata

    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "cpus": len(os.sched_getaffinity(0)), "device": str(device)}
    for pkg in ("torchvision", "torchcodec", "nvidia-nvimgcodec-cu13", "nvidia-nvjpeg"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["stream_priority_range"] = list(torch.cuda.Stream.priority_range())
    return env


def auto_decoder() -> str | None:
    """What ``device_decoder="auto"`` resolves to here: the default the figures are weighed against."""
    from fastdata.gpu import _codec

    try:
        return _codec.device_backend("auto")
    except Exception:  # noqa: BLE001 - a bad FASTDATA_DEVICE_DECODER: no default to compare with
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=140.0, help="seconds; rows that would not fit are skipped")
    ap.add_argument("--images", type=int, default=1024, help="corpus size (batches are cycled)")
    ap.add_argument("--batch", type=int, default=256, help="images per decoded batch")
    ap.add_argument("--size", type=int, default=224, help="RandomResizedCrop size (also the training input)")
    ap.add_argument("--seconds", type=float, default=1.5, help="window alone; beside training: 1.5x this")
    ap.add_argument("--model", default="resnet18", help="torchvision model ('tiny': a 2-layer net)")
    ap.add_argument("--train-batch", type=int, default=128)
    ap.add_argument("--decoders", nargs="+", default=list(DECODERS))
    ap.add_argument("--candidates", nargs="+", default=[c.name for c in CANDIDATES])
    ap.add_argument("--priorities", nargs="+", default=list(PRIORITIES), choices=PRIORITIES)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    datas = corpus(args.images, 0)  # in worker processes, forked before this process starts CUDA
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.backends.cudnn.benchmark = True
    status = decoder_status(tuple(args.decoders))
    report: dict[str, Any] = {"benchmark": "decode_contention", "env": environment(device),
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "decoders": status, "auto_device_decoder": auto_decoder(),
                              "candidates": {c.name: c.about for c in CANDIDATES}, "rows": []}

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - t_start, 1)
        report["best"] = best_row(report["rows"])
        args.json.write_text(json.dumps(report, indent=1))

    batches = packed_batches(datas, args.batch, pin=on_cuda)
    model = make_model(args.model, device, 10)
    step = make_step(model, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.train_batch, 3, args.size, args.size), dtype=torch.uint8, generator=g)
    from fastdata.gpu import Normalize

    train_batch = {"jpg": Normalize(dtype=torch.bfloat16 if on_cuda else torch.float32,
                                    channels_last=on_cuda)(x.to(device)),
                   "cls": torch.randint(0, 10, (args.train_batch,), generator=g).to(device)}
    train_images_per_s(step, train_batch, min(args.seconds, 2.0))  # warm-up: cuDNN autotuning, allocator
    train_alone = train_images_per_s(step, train_batch, args.seconds)
    report["train_alone_images_per_s"] = train_alone
    print(f"{args.model} alone: {train_alone:,.0f} images/s; decoders: "
          + ", ".join(f"{k} {'ok' if v is None else 'unavailable'}" for k, v in status.items()), flush=True)
    plan = [(d, c, p) for c in CANDIDATES if c.name in args.candidates for p in args.priorities
            for d in args.decoders if status[d] is None and c.applies_to(d)]
    if plan:
        plan.append(plan[0])  # the first row again: how far two runs of one row differ
    per_row = 2.5 * args.seconds + 3.0
    for i, (decoder, cand, priority) in enumerate(plan):
        row: dict[str, Any] = {"decoder": decoder, "candidate": cand.name, "priority": priority}
        if i == len(plan) - 1 and i > 0:
            row["repeat"] = True
        left = args.budget - (time.perf_counter() - t_start)
        if left < per_row + 3:
            row["skipped"] = f"budget: {left:.0f} s left"
        else:
            t0 = time.perf_counter()
            try:
                row.update(measure(decoder, cand, priority, batches, step, train_batch, train_alone, args, device))
            except Exception as e:  # noqa: BLE001 - one failing row never ends the run
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["seconds"] = round(time.perf_counter() - t0, 1)
        report["rows"].append(row)
        print(fmt(row), flush=True)
        save()
    if time.perf_counter() - t_start < args.budget - args.seconds - 2:
        report["train_alone_end_images_per_s"] = train_images_per_s(step, train_batch, args.seconds)
    save()
    print(f"best beside training: {report['best']}")
    skipped = sum("skipped" in r for r in report["rows"])
    if skipped:
        print(f"{skipped} of {len(report['rows'])} rows skipped for the budget ({args.budget:.0f} s)")
    failed = [r for r in report["rows"] if "error" in r]
    if failed:  # after the JSON: every row is kept, but the part is not reported ok
        print(f"{len(failed)} of {len(report['rows'])} rows failed", file=sys.stderr)
    return 1 if failed else 0


def fmt(r: dict[str, Any]) -> str:
    head = f"{r['decoder']:<12} {r['candidate']:<8} {r['priority']:<6}{' (repeat)' if r.get('repeat') else ''}"
    if "stage_beside_images_per_s" not in r:
        return f"{head} {r.get('skipped') or r.get('error')}"
    return (f"{head} stage alone {r['stage_alone_images_per_s']:9,.0f} img/s ({r['cpu_cores_alone']:.1f} cores), "
            f"beside training {r['stage_beside_images_per_s']:9,.0f}; training {r['train_beside_images_per_s']:8,.0f} "
            f"img/s ({r['train_share']:.0%} of alone)")


if __name__ == "__main__":
    sys.exit(main())
