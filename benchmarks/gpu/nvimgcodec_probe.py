"""Does nvImageCodec's hardware JPEG backend, on a stream we choose, feed a training GPU better than
torchvision's nvJPEG? (issue 9: resnet18 fed at 59% because torchvision's decode stream queues behind
training kernels.) Answers it before any library code depends on it.

On the H100 box (no network, nvImageCodec not installed), carry the wheels in an ignored folder:

    pip download nvidia-nvimgcodec-cu13 "nvidia-nvjpeg>=13" --no-deps --only-binary=:all: \
        --python-version 3.12 -d wheels            # on the dev machine: ~29 MB
    # device run, carry=["wheels"]:
    python3 benchmarks/gpu/nvimgcodec_probe.py --wheels wheels --out $OUT

Measured, same JPEGs (photo-like, 300-640 px), batches of ``--batch``:

- ``alone``: images/s of each decoder with nothing else on the GPU;
- ``contended``: a resnet18 (bf16, channels_last, batch 128, resident batch) trains in the main thread
  while a second thread decodes in a loop; images/s of the decoder and the training's speed as a
  share of training alone.

Decoders: ``torchvision`` (``decode_jpeg(list, device="cuda")``: its own pool stream, host-synchronised);
``nvimgcodec_hw`` (``Backend(HW_GPU_ONLY)`` then ``GPU_ONLY``, results ready on a normal-priority torch
stream passed as ``cuda_stream``); ``nvimgcodec_hw_hiprio`` (the same with a high-priority stream);
``fastdata_nvimgcodec`` / ``fastdata_nvimgcodec_hiprio``: fastdata's own glue
(``fastdata.gpu._codec.decode_device(..., backend="nvimgcodec")``, what ``DecodeImages(device_decoder=
"nvimgcodec")`` calls: packed-buffer views in, each image copied into torch memory on the stream and
a host wait on an event) on a normal / high-priority stream: the difference to the raw rows is the
cost of that copy and wait. (The raw rows return views of nvImageCodec's buffers; ``record_stream``
does not cover memory torch did not allocate, so they are for timing, not a pattern to copy.)
``mean_abs_diff`` compares each decoder's pixels with torchvision's GPU decode (grey levels).
Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def install_wheels(wheels: Path) -> str:
    """pip-install the carried wheels into a temporary folder put first on sys.path; preload libnvjpeg."""
    files = sorted(glob.glob(str(wheels / "*.whl")))
    if not files:
        return f"no wheels in {wheels}"
    target = tempfile.mkdtemp(prefix="nvimgcodec-")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target,
                        *files], capture_output=True, text=True)
    if r.returncode != 0:
        return f"pip install failed: {r.stderr[-400:]}"
    sys.path.insert(0, target)
    for lib in sorted(glob.glob(os.path.join(target, "nvidia", "**", "libnvjpeg.so*"), recursive=True)):
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return f"cannot load {lib}: {e}"
    return f"installed {len(files)} wheels into {target}"


def corpus(n: int, batch: int) -> list[list[bytes]]:
    from fastdata.cli._synth import jpeg_bytes, synth_image

    rng = np.random.default_rng(0)
    data = [jpeg_bytes(synth_image(rng, int(rng.integers(300, 641)), int(rng.integers(300, 641))), 90)
            for _ in range(n)]
    return [data[i:i + batch] for i in range(0, n - batch + 1, batch)]


def torchvision_decoder(device: torch.device) -> Callable[[list[bytes]], list[torch.Tensor]]:
    import torchvision.io as tvio

    def decode(batch: list[bytes]) -> list[torch.Tensor]:
        views = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in batch]
        return tvio.decode_jpeg(views, mode=tvio.ImageReadMode.RGB, device=device)

    return decode


def nvimgcodec_decoder(device: torch.device, priority: int) -> Callable[[list[bytes]], list[torch.Tensor]]:
    from nvidia import nvimgcodec as nv

    dec = nv.Decoder(device_id=device.index or 0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY),
                                                            nv.Backend(nv.BackendKind.GPU_ONLY)])
    params = nv.DecodeParams(color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)
    stream = torch.cuda.Stream(device=device, priority=priority)

    def decode(batch: list[bytes]) -> list[torch.Tensor]:
        with torch.cuda.stream(stream):
            images = dec.decode([np.frombuffer(b, dtype=np.uint8) for b in batch], params=params,
                                cuda_stream=stream.cuda_stream)
            if any(im is None for im in images):
                raise RuntimeError("nvImageCodec could not decode an image of the batch")
            out = [torch.as_tensor(im, device=device).permute(2, 0, 1) for im in images]  # HWC -> CHW views
        torch.cuda.current_stream(device).wait_stream(stream)
        for t in out:
            t.record_stream(torch.cuda.current_stream(device))
        return out

    return decode


def fastdata_decoder(device: torch.device, priority: int) -> Callable[[list[bytes]], list[torch.Tensor]]:
    from fastdata.dataset import EncodedImage, PackedImages
    from fastdata.gpu import _codec

    _codec.device_backend("nvimgcodec")  # raises with the install line when it is missing
    stream = torch.cuda.Stream(device=device, priority=priority)
    packs: dict[tuple[int, ...], Any] = {}

    def decode(batch: list[bytes]) -> list[torch.Tensor]:
        key = tuple(map(id, batch))  # the corpus' bytes objects live for the whole run
        p = packs.get(key)
        if p is None:  # packed and pinned once per batch, as the loader delivers them
            p = packs[key] = PackedImages.pack([EncodedImage(b, shard="probe", key=str(i), index=i, epoch=0)
                                                      for i, b in enumerate(batch)]).pin_memory()
        with torch.cuda.stream(stream):
            out = _codec.decode_device(p.views(), device, backend="nvimgcodec")
        if any(t is None for t in out):
            raise RuntimeError("nvImageCodec could not decode an image of the batch")
        cur = torch.cuda.current_stream(device)
        cur.wait_stream(stream)
        for t in out:
            t.record_stream(cur)  # torch memory: the copies made by decode_device
        return out

    return decode


def rate(decode: Callable[[list[bytes]], list[torch.Tensor]], batches: list[list[bytes]], seconds: float,
         stop: threading.Event | None = None, progress: list[int] | None = None) -> float:
    """Images/s of ``decode`` over ``seconds`` (or until ``stop``); ``progress[0]``: images decoded so far."""
    for b in batches[:2]:
        decode(b)
    torch.cuda.synchronize()
    n, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
        out = decode(batches[i % len(batches)])
        n += len(out)
        i += 1
        if progress is not None:
            progress[0] = n
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


class Trainer:
    def __init__(self, device: torch.device) -> None:
        import torchvision

        self.model = torchvision.models.resnet18(num_classes=10).to(device).to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(128, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
        self.y = torch.randint(0, 10, (128,), device=device)

    def steps_per_s(self, seconds: float) -> float:
        # the training stream only, as loss.item() syncs in a training loop: torch.cuda.synchronize() would
        # also wait for the decoder thread's queued work and charge it to training in the contended rows
        stream = torch.cuda.current_stream(self.x.device)
        for _ in range(3):
            self.step()
        stream.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
            if n % 10 == 0:
                stream.synchronize()
        stream.synchronize()
        return n / (time.perf_counter() - t0)

    def step(self) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wheels", type=Path, default=None, help="folder of carried wheels (nvimgcodec, nvjpeg)")
    ap.add_argument("--images", type=int, default=768)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"torch": torch.__version__}
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        (args.out / "nvimgcodec_probe.json").write_text(json.dumps({"error": "no CUDA"}))
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    report["device"] = torch.cuda.get_device_name(device)
    if args.wheels is not None:
        report["wheels"] = install_wheels(args.wheels)
    batches = corpus(args.images, args.batch)
    decoders: dict[str, Callable[[list[bytes]], list[torch.Tensor]]] = {"torchvision": torchvision_decoder(device)}
    hi = -1  # torch.cuda.Stream(priority=): lower is higher (torch maps values past the device's range to its end)
    try:
        decoders["nvimgcodec_hw"] = nvimgcodec_decoder(device, 0)
        decoders["nvimgcodec_hw_hiprio"] = nvimgcodec_decoder(device, hi)
        decoders["fastdata_nvimgcodec"] = fastdata_decoder(device, 0)
        decoders["fastdata_nvimgcodec_hiprio"] = fastdata_decoder(device, hi)
    except Exception as e:  # noqa: BLE001  reported, the torchvision rows still run
        report["nvimgcodec_error"] = f"{type(e).__name__}: {e}"
    ref = [t.float() for t in decoders["torchvision"](batches[0][:16])]
    rows = []
    trainer = Trainer(device)
    train_alone = trainer.steps_per_s(args.seconds)
    report["train_steps_per_s_alone"] = train_alone
    for name, decode in decoders.items():
        row: dict[str, Any] = {"decoder": name}
        try:
            got = decode(batches[0][:16])
            row["mean_abs_diff"] = float(np.mean([(g.float() - r).abs().mean().item() for g, r in zip(got, ref)]))
            row["alone_img_s"] = rate(decode, batches, args.seconds)
            stop = threading.Event()
            box: dict[str, float] = {}
            progress = [0]

            def body(d: Callable[[list[bytes]], list[torch.Tensor]] = decode) -> None:
                torch.cuda.set_device(device)
                # its own current stream (as the prefetcher's side stream): on the default stream, which the
                # trainer uses, each decode's wait_stream would hold the training kernels queued after it
                with torch.cuda.stream(torch.cuda.Stream(device=device)):
                    box["img_s"] = rate(d, batches, args.seconds * 10, stop, progress)

            t = threading.Thread(target=body, daemon=True)
            t.start()
            time.sleep(0.5)
            n0, t0 = progress[0], time.perf_counter()
            steps = trainer.steps_per_s(args.seconds)
            n1, t1 = progress[0], time.perf_counter()
            stop.set()
            t.join(timeout=60)
            # images decoded while training ran (the thread's own figure includes 0.5 s alone before it)
            row["contended_img_s"] = (n1 - n0) / (t1 - t0) if "img_s" in box else None
            row["decoder_thread_img_s"] = box.get("img_s")
            row["train_share"] = steps / train_alone
            # images/s the decoder delivers while training at that speed vs what resnet18 consumes
            row["fed_share_if_decode_bound"] = (min(1.0, (row["contended_img_s"] or 0.0) / (steps * 128)) if steps else None)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["rows"] = rows
    (args.out / "nvimgcodec_probe.json").write_text(json.dumps(report, indent=1))
    print(f"\ntraining alone {train_alone:.2f} steps/s ({train_alone * 128:.0f} img/s), high priority {hi}")
    print(f"{'decoder':22s} {'alone img/s':>12s} {'contended':>10s} {'train share':>12s} {'diff':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['decoder']:22s} error: {r['error']}")
            continue
        print(f"{r['decoder']:22s} {r['alone_img_s']:12.0f} {r['contended_img_s'] or 0:10.0f} "
              f"{r['train_share']:12.3f} {r['mean_abs_diff']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
