"""The one module that calls image codec libraries for packed batches (torchvision, Pillow).

Switching the device decoder (nvImageCodec, TorchCodec, DALI's) means changing this file only:
:func:`device_decodable` says which images the device decoder takes, :func:`decode_device` decodes
a list of them, :func:`decode_host` decodes one image on the CPU.

It sits in the ``gpu`` stage, not lower: only the device decode stage (:mod:`fastdata.gpu._decode`)
decodes packed batches, so DataLoader workers never import torchvision (they start faster and a
broken torchvision install cannot break CPU-only loading); the per-sample Pillow decoders of the
workers stay in :mod:`fastdata.decode`.

Device decoding: ``torchvision.io.decode_jpeg(list_of_cpu_tensors, device="cuda")``. Its input must
be host tensors (torchvision checks it), so the packed bytes stay on the host; views into the
(pinned) packed buffer are passed without a copy. What torchvision does with them (from its
``decode_jpegs_cuda.cpp``): it creates the nvJPEG handle with ``NVJPEG_BACKEND_HARDWARE`` when the
GPU has JPEG engines (A100, H100; falling back to the default hybrid backend elsewhere), decodes the
baseline JPEGs that ``nvjpegDecodeBatchedSupported`` accepts in one batched call on those engines
and the rest (progressive) one by one in the hybrid CPU+CUDA path, on a private stream; it waits
for that stream on the host (``cudaStreamSynchronize``, not a device-wide sync) and makes the
caller's current stream wait for it with an event. An error fails the whole call.

Host decoding: ``torchvision.io.decode_jpeg`` / ``decode_image`` (libjpeg-turbo) when torchvision
works, else Pillow (also libjpeg-turbo for JPEG). Formats torchvision cannot read go to Pillow.
"""
from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastdata.dataset import FORMATS, ImageInfo

__all__ = [
    "HOST_BACKENDS", "decode_device", "decode_host", "default_max_pixels", "device_decodable", "device_decodable_codes",
    "host_backend", "torchvision_status",
]

HOST_BACKENDS = ("auto", "torchvision", "pillow")


@functools.cache
def torchvision_status() -> tuple[Any, str]:
    """``(torchvision.io module or None, reason)``: whether torchvision's image ops load here."""
    try:
        import torchvision.io as tvio

        tvio.decode_jpeg(_TINY_JPEG)  # the C extension really loads (a CPU-only torch with a CUDA build does not)
    except Exception as e:  # noqa: BLE001 - any import/load failure means "not usable here"
        return None, f"torchvision image ops unavailable: {type(e).__name__}: {str(e)[:200]}"
    import torchvision

    return tvio, f"torchvision {torchvision.__version__}"


def host_backend(name: str = "auto") -> str:
    """The host decoder that ``name`` ("auto", "torchvision", "pillow") resolves to here."""
    if name not in HOST_BACKENDS:
        raise ValueError(f"host decoder must be one of {HOST_BACKENDS}, got {name!r}")
    if name == "pillow":
        return "pillow"
    tv, reason = torchvision_status()
    if tv is None:
        if name == "torchvision":
            raise RuntimeError(f"host decoder 'torchvision' requested but {reason}")
        return "pillow"
    return "torchvision"


def device_decodable(info: ImageInfo) -> bool:
    """True when the device decoder handles this image (else it is decoded on the host).

    nvJPEG through torchvision: 8-bit Huffman JPEGs (baseline, extended, progressive) with 1 or 3
    components, except 3-component files whose Adobe marker says RGB (no YCbCr transform), which
    nvJPEG would colour-convert wrongly. CMYK/YCCK, 12-bit, lossless and arithmetic-coded JPEGs and
    every other format go to the host.
    """
    return (info.format == "jpeg" and info.sof in (0, 1, 2) and info.precision == 8
            and info.components in (1, 3) and not (info.components == 3 and info.adobe_transform == 0))


def default_max_pixels() -> int | None:
    """The pixel limit of host decoding when none is given: Pillow's ``Image.MAX_IMAGE_PIXELS``."""
    return Image.MAX_IMAGE_PIXELS


def device_decodable_codes(codes: np.ndarray) -> np.ndarray:
    """:func:`device_decodable` for an array of header codes (``PackedImages.codes()``) at once."""
    c = np.asarray(codes, dtype=np.int64)
    fmt, sof, comps = c & 0xFF, (c >> 8) & 0xFF, (c >> 16) & 0xFF
    prec, adobe = (c >> 24) & 0xFF, (c >> 32) & 0xFF
    return ((fmt == FORMATS.index("jpeg")) & (sof <= 2) & (prec == 8) & ((comps == 1) | (comps == 3))
            & ~((comps == 3) & (adobe == 0)))


def decode_device(views: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decode host uint8 tensors (JPEG bytes) into RGB uint8 ``(3, H, W)`` tensors on ``device``.

    Runs on the current CUDA stream's timeline (torchvision orders it after its own decode stream).
    Raises ``RuntimeError`` for the whole list if any image fails.
    """
    tv, reason = torchvision_status()
    if tv is None:
        raise RuntimeError(f"device JPEG decoding needs torchvision: {reason}")
    return tv.decode_jpeg(list(views), mode=tv.ImageReadMode.RGB, device=device)


def decode_host(data: torch.Tensor, info: ImageInfo, backend: str) -> torch.Tensor:
    """Decode one image (host uint8 tensor of its bytes) into an RGB uint8 ``(3, H, W)`` CPU tensor.

    Raises whatever the library raises for a corrupt image; :mod:`fastdata.gpu._decode` names shard and key.
    """
    if backend == "torchvision" and info.format in ("jpeg", "png", "webp", "gif"):
        tv, _ = torchvision_status()
        if info.format == "jpeg" and info.components in (1, 3):
            out = tv.decode_jpeg(data, mode=tv.ImageReadMode.RGB)
        else:
            out = tv.decode_image(data, mode=tv.ImageReadMode.RGB)
        return out if out.dim() == 3 else out[0]  # gif: first frame
    return _pillow_rgb(data)


def _pillow_rgb(data: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        img = Image.open(io.BytesIO(data.numpy().tobytes()))
        img.load()
    if img.mode != "RGB":
        img = img.convert("RGB")
    arr = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def _tiny_jpeg() -> torch.Tensor:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format="JPEG")
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


_TINY_JPEG = _tiny_jpeg()
