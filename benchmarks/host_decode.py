"""Host (CPU) image decode, images/s per library, from one run: Pillow, TorchCodec, torchvision.

Each library decodes the same JPEGs into RGB uint8 ``(3, H, W)`` tensors through the path
``fastdata.gpu.DecodeImages`` takes on the host (``fastdata.gpu._codec.decode_host``: Pillow through
``fastdata.decode.ImageDecoder``; TorchCodec's ``decode_jpeg``; torchvision's ``decode_jpeg``, deprecated
from torchvision 0.29 on). One thread, torch intra-op threads 1; the libraries take turns within each
repetition, and images/s are the medians over ``--repeat`` repetitions. Ratios are against Pillow.

The corpus is decode_stage.py's: photo-like JPEGs of 300-640 px (``--images``), and optionally
``--large`` more of 2000x1500 (the size of a phone photo). A library that does not load here is left
out (the JSON's ``env`` says why).

    python benchmarks/host_decode.py --json benchmarks/results/host_decode_cpu2.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

LIBRARIES = ("pillow", "torchcodec", "torchvision")


def corpus(images: int, large: int) -> dict[str, list[bytes]]:
    """The JPEG sets, by name."""
    import numpy as np
    from decode_stage import prepare

    from fastdata.cli._synth import jpeg_bytes, synth_image

    folder, _ = prepare(Path(tempfile.gettempdir()) / "fastdata-bench-decode", images, 4)
    sets = {"photo 300-640 px": [f.read_bytes() for f in sorted(folder.glob("class_*/img_*.jpg"))[:images]]}
    if large:
        rng = np.random.default_rng(0)
        sets["photo 2000x1500"] = [jpeg_bytes(synth_image(rng, 2000, 1500, i % 10), 90) for i in range(large)]
    return sets


def rate(backend: str, views: list[Any], infos: list[Any]) -> float:
    """Images/s of one pass over the set."""
    from fastdata.gpu._codec import decode_host

    t0 = time.perf_counter()
    for v, info in zip(views, infos):
        decode_host(v, info, backend)
    return len(views) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--large", type=int, default=8, help="2000x1500 JPEGs as a second set (0: none)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    from fastdata.dataset import EncodedImage, PackedImages
    from fastdata.gpu import _codec

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision are deprecated")
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(),
           "torchcodec": _codec.torchcodec_status()[1], "torchvision": _codec.torchvision_status()[1]}
    status = {"torchcodec": _codec.torchcodec_status, "torchvision": _codec.torchvision_status}
    libs = [b for b in LIBRARIES if b == "pillow" or status[b]()[0] is not None]  # those that load here
    if len(libs) < len(LIBRARIES):
        print("not measured (does not load here): " + ", ".join(
            f"{b} ({status[b]()[1]})" for b in LIBRARIES if b not in libs), flush=True)
    load0 = os.getloadavg()
    results: dict[str, Any] = {}
    for name, datas in corpus(args.images, args.large).items():
        packed = PackedImages.pack([EncodedImage(d, shard="bench", key=str(i), index=i, epoch=0)
                                    for i, d in enumerate(datas)])
        views, infos = packed.views(), [packed.info(i) for i in range(len(datas))]
        for b in libs:
            rate(b, views[:8], infos[:8])  # warm-up: libraries loaded, first allocations
        runs: dict[str, list[float]] = {b: [] for b in libs}
        for _ in range(args.repeat):
            for b in libs:
                runs[b].append(rate(b, views, infos))
        med = {b: statistics.median(r) for b, r in runs.items()}
        results[name] = {"images": len(datas), "images_per_s": {b: round(v, 1) for b, v in med.items()},
                         "vs_pillow": {b: round(v / med["pillow"], 3) for b, v in med.items()}, "runs": runs}
        print(f"{name} ({len(datas)} JPEGs, median of {args.repeat}): "
              + ", ".join(f"{b} {med[b]:,.0f} images/s ({med[b] / med['pillow']:.2f}x)" for b in libs), flush=True)
    out = {"benchmark": "host_decode", "env": env, "load_avg_start": load0, "load_avg_end": os.getloadavg(),
           "args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}
    print(f"load average {load0[0]:.2f} at the start, {out['load_avg_end'][0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
