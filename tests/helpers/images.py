"""Image helpers shared by the decode, GPU and shard tests."""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image
import torch.nn.functional as F

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.dataset import EncodedImage, PackedImages


def jpeg(i: int, w: int | None = None, h: int | None = None, *, quality: int = 85, **save) -> bytes:
    """A photo-like image seeded by ``i`` (40-96 px sides unless given); JPEG unless ``format=``,
    ``mode=`` and other Pillow save options given."""
    rng = np.random.default_rng(i)
    w = w or int(rng.integers(40, 97))
    h = h or int(rng.integers(40, 97))
    img = synth_image(rng, w, h, i % 10)
    if not save:
        return jpeg_bytes(img, quality)
    buf = io.BytesIO()
    img.convert(save.pop("mode", "RGB")).save(buf, format=save.pop("format", "JPEG"), quality=quality, **save)
    return buf.getvalue()


def many_jpegs(n: int) -> list[bytes]:
    """``n`` JPEGs of 64-400 px, qualities 60-95; every tenth progressive, every tenth greyscale."""
    out = []
    for i in range(n):
        rng = np.random.default_rng(1000 + i)
        w, h, q = int(rng.integers(64, 400)), int(rng.integers(64, 400)), int(rng.integers(60, 96))
        kind = i % 10
        out.append(jpeg(i, w, h, quality=q, progressive=True) if kind == 8 else
                   jpeg(i, w, h, quality=q, mode="L") if kind == 9 else jpeg(i, w, h, quality=q))
    return out


def pillow_rgb(data: bytes) -> torch.Tensor:
    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return torch.from_numpy(arr.transpose(2, 0, 1).copy())


def chw(img: Image.Image) -> np.ndarray:
    """``np.asarray(img)`` as (C, H, W): what ``image_to_tensor`` must return."""
    arr = np.asarray(img, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def pillow_decoded(data: bytes, mode: str | None, draft: int | None) -> Image.Image:
    """The reference for ``ImageDecoder(mode, draft_size=draft)``: Pillow's own open, the same
    ``draft`` call, load, then ``convert(mode)`` where the mode differs."""
    img = Image.open(io.BytesIO(data))
    if draft and min(img.size) >= 2 * draft:
        scale = draft / min(img.size)
        img.draft(mode or img.mode, (int(img.size[0] * scale) + 1, int(img.size[1] * scale) + 1))
    img.load()
    if mode is not None and img.mode != mode:
        img = img.convert(mode)
    return img


def packed(datas: list[bytes], epoch: int = 0) -> PackedImages:
    return PackedImages.pack([EncodedImage(d, shard="shard-0.tar", key=f"k{i}", index=100 + i, epoch=epoch)
                              for i, d in enumerate(datas)])


def run_without_host_sync(pipe: Any, batch: Any) -> Any:
    """``pipe(batch)`` on a side stream under ``torch.cuda.set_sync_debug_mode("error")`` (any host
    synchronisation raises), after one warm-up call (first-use allocations, decoder handles)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pipe(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            out = pipe(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return out


def smooth_images(sizes, seed=0):
    """Random but smooth uint8 images (so resampling differences show as small values, not noise)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for h, w in sizes:
        x = torch.randint(0, 256, (1, 3, h, w), generator=g).float()
        out.append(F.avg_pool2d(x, 5, 1, 2, count_include_pad=False)[0].round().to(torch.uint8))
    return out


def smooth(h: int, w: int, seed: int = 0) -> torch.Tensor:
    """One smooth (3, h, w) uint8 image."""
    return smooth_images([(h, w)], seed)[0]


def flat_png(w: int = 4, h: int = 3, mode: str = "RGB") -> bytes:
    """A one-colour PNG of w x h pixels in ``mode``."""
    buf = io.BytesIO()
    Image.new(mode, (w, h), 90).save(buf, format="PNG")
    return buf.getvalue()


def grey_png() -> bytes:
    """A 5 x 4 greyscale PNG."""
    out = io.BytesIO()
    Image.fromarray(np.full((4, 5), 7, np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()
