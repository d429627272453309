"""The one module that calls image codec libraries for packed batches (torchvision, nvImageCodec, Pillow).

Switching the device decoder means changing this file only: :func:`device_decodable` says which
images the device decoder takes, :func:`device_backend` resolves the choice (``DEVICE_BACKENDS``),
:func:`decode_device` decodes a list of them, :func:`decode_host` decodes one image on the CPU.

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

Device decoding with nvImageCodec (``device_decoder="nvimgcodec"``; optional, ``pip install
nvidia-nvimgcodec-cu13 nvidia-nvjpeg``; imported here only, lazily, never in DataLoader workers):
one ``nvimgcodec.Decoder`` per device and process with the backends ``HW_GPU_ONLY`` (the JPEG
engines of A100/H100), ``GPU_ONLY``, ``HYBRID_CPU_GPU`` in that order of preference (per image),
decoding on the caller's current stream (``cuda_stream=``), so the stage chooses the stream. The
input is the same zero-copy views of the packed buffer (as NumPy arrays, which nvImageCodec's code
streams reference without a copy). Output is planar RGB (``sample_format=P_RGB``: already
``(3, H, W)``; 1-component JPEGs come out as RGB too), no EXIF rotation (as torchvision and the
host path). nvImageCodec owns its output buffers and frees them when the ``Image`` dies, which no
torch stream bookkeeping (``record_stream``) covers, so each image is copied into a torch tensor on
the same stream, and the call waits on the host (an event, not a device sync) until decode and
copies are done, like torchvision's call: then the input bytes are consumed and releasing the
``Image`` is safe whatever stream its buffer is freed on. Images it cannot decode come back as
``None`` at their positions (the stage decodes those on the host), not as an error for the call.
On the CPU (``device="cpu"``, for testing this glue without a GPU) it uses nvImageCodec's CPU
backend (libjpeg-turbo) and returns zero-copy tensors over the decoded host buffers (each tensor
keeps its ``Image`` alive). ``device_decoder="auto"`` is torchvision unless the environment
variable ``FASTDATA_DEVICE_DECODER`` names another: it stays torchvision until a GPU measurement
shows nvImageCodec pays. Unmeasured on a GPU so far: its speed against torchvision's, alone and
beside training, the cost of the copy and the host wait, and its allocator's behaviour.

Host decoding: ``torchvision.io.decode_jpeg`` / ``decode_image`` (libjpeg-turbo) when torchvision
works, else Pillow (also libjpeg-turbo for JPEG). Formats torchvision cannot read go to Pillow.
"""
from __future__ import annotations

import functools
import io
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastdata.dataset import FORMATS, ImageInfo
from fastdata.decode import ImageDecoder
from fastdata.errors import FastdataError

__all__ = [
    "DEVICE_BACKENDS", "DEVICE_DECODER_ENV", "HOST_BACKENDS", "DecoderUnavailableError", "decode_device", "decode_host",
    "default_max_pixels", "device_backend", "device_decodable", "device_decodable_codes", "host_backend",
    "nvimgcodec_status", "torchvision_status",
]

HOST_BACKENDS = ("auto", "torchvision", "pillow")
DEVICE_BACKENDS = ("auto", "torchvision", "nvimgcodec")
DEVICE_DECODER_ENV = "FASTDATA_DEVICE_DECODER"  # what device_decoder="auto" resolves to (default: torchvision)
NVIMGCODEC_INSTALL = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg"


class DecoderUnavailableError(FastdataError, RuntimeError):
    """A decoder was asked for by name but cannot be loaded here; says how to install it."""


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
            raise DecoderUnavailableError(f"host decoder 'torchvision' requested but {reason}")
        return "pillow"
    return "torchvision"


@functools.cache
def nvimgcodec_status() -> tuple[Any, str]:
    """``(nvidia.nvimgcodec module or None, reason)``: whether nvImageCodec imports here.

    Sets ``PYNVIMGCODEC_VERBOSITY=0`` before the import unless it is set: the images nvImageCodec
    cannot decode are decoded on the host, whose errors name shard and key, so its own log lines
    (one per bad image) are noise; set the variable to 1 (errors) or 2 (warnings) to see them.
    Four lines about missing nvJPEG2000/nvTIFF libraries are printed at import whatever the
    setting (``pip install nvidia-nvjpeg2k-cu13 nvidia-nvtiff-cu13`` removes them; JPEG needs neither).
    """
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    try:
        from nvidia import nvimgcodec
    except Exception as e:  # noqa: BLE001 - any import/load failure means "not usable here"
        return None, f"nvImageCodec unavailable: {type(e).__name__}: {str(e)[:200]}"
    return nvimgcodec, f"nvImageCodec {getattr(nvimgcodec, '__version__', '?')}"


def device_backend(name: str = "auto") -> str:
    """The device decoder that ``name`` ("auto", "torchvision", "nvimgcodec") resolves to.

    "auto" is torchvision unless the environment variable ``FASTDATA_DEVICE_DECODER`` names
    another. "nvimgcodec" raises :class:`DecoderUnavailableError` (saying how to install it) when
    nvImageCodec does not import here; "torchvision" is checked when it decodes.
    """
    if name not in DEVICE_BACKENDS:
        raise ValueError(f"device_decoder must be one of {DEVICE_BACKENDS}, got {name!r}")
    if name == "auto":
        env = os.environ.get(DEVICE_DECODER_ENV, "").strip()
        if env in ("", "auto"):
            return "torchvision"
        if env not in DEVICE_BACKENDS:
            raise ValueError(f"environment variable {DEVICE_DECODER_ENV}={env!r}: must be one of {DEVICE_BACKENDS}")
        name = env
    if name == "nvimgcodec":
        nv, reason = nvimgcodec_status()
        if nv is None:
            raise DecoderUnavailableError(f"device decoder 'nvimgcodec' requested but {reason}; install it with "
                                          f"`{NVIMGCODEC_INSTALL}` (CUDA 13 builds; -cu12 for CUDA 12)")
    return name


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


def decode_device(views: Sequence[torch.Tensor], device: torch.device,
                  backend: str = "auto") -> list[torch.Tensor | None]:
    """Decode host uint8 tensors (JPEG bytes) into RGB uint8 ``(3, H, W)`` tensors on ``device``.

    ``backend``: a :data:`DEVICE_BACKENDS` name (see :func:`device_backend`). Runs on the current
    CUDA stream's timeline. torchvision raises ``RuntimeError`` for the whole list if any image
    fails; nvImageCodec returns ``None`` at the positions of the images it cannot decode. Both
    return when the images are decoded (each waits on the host for its own work only).
    """
    if device_backend(backend) == "nvimgcodec":
        return _decode_nvimgcodec(views, device)
    tv, reason = torchvision_status()
    if tv is None:
        raise RuntimeError(f"device JPEG decoding needs torchvision: {reason}")
    return tv.decode_jpeg(list(views), mode=tv.ImageReadMode.RGB, device=device)


class _NvDecoder:
    """One nvImageCodec decoder (and its decode parameters) for a device; calls are serialised."""

    def __init__(self, device: torch.device) -> None:
        nv, _ = nvimgcodec_status()
        kind = nv.BackendKind
        if device.type == "cpu":  # nvImageCodec's libjpeg-turbo backend: tests the glue without a GPU
            self.decoder = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[nv.Backend(kind.CPU_ONLY)])
        else:
            self.decoder = nv.Decoder(device_id=device.index if device.index is not None else
                                      torch.cuda.current_device(),
                                      backends=[nv.Backend(kind.HW_GPU_ONLY), nv.Backend(kind.GPU_ONLY),
                                                nv.Backend(kind.HYBRID_CPU_GPU)])
        self.params = nv.DecodeParams(color_spec=nv.ColorSpec.SRGB, sample_format=nv.SampleFormat.P_RGB,
                                      allow_any_depth=False, apply_exif_orientation=False)
        self.lock = threading.Lock()


_NV_DECODERS: dict[tuple[int, str, int | None], _NvDecoder] = {}
_NV_LOCK = threading.Lock()


def _nv_decoder(device: torch.device) -> _NvDecoder:
    key = (os.getpid(), device.type, device.index)  # a decoder's threads and CUDA state do not survive fork
    with _NV_LOCK:
        dec = _NV_DECODERS.get(key)
        if dec is None:
            dec = _NV_DECODERS[key] = _NvDecoder(device)
        return dec


def _decode_nvimgcodec(views: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    dec = _nv_decoder(device)
    srcs = [v.numpy() for v in views]  # views of the (pinned) packed buffer; code streams reference them
    if device.type == "cpu":
        with dec.lock:
            images = dec.decoder.decode(srcs, params=dec.params)
        # planar RGB: already (3, H, W); the tensor is a view of the Image's host buffer and keeps it alive
        return [None if im is None else torch.from_numpy(np.asarray(im)) for im in images]
    stream = torch.cuda.current_stream(device)
    with dec.lock:
        images = dec.decoder.decode(srcs, params=dec.params, cuda_stream=stream.cuda_stream)
    # nvImageCodec's buffers: copy on the decode stream into torch memory (see the module docstring)
    out = [None if im is None else torch.as_tensor(im, device=device).clone(memory_format=torch.contiguous_format)
           for im in images]
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()  # this thread waits for its decode and copies, as torchvision's call does
    del images  # released after the copies ran
    return out


def decode_host(data: torch.Tensor, info: ImageInfo, backend: str, max_pixels: int | None = None) -> torch.Tensor:
    """Decode one image (host uint8 tensor of its bytes) into an RGB uint8 ``(3, H, W)`` CPU tensor
    (16-bit images as :mod:`fastdata.decode` converts them: exact up to 255, else their high byte).

    ``max_pixels``: an image whose header claims more pixels is refused (ValueError) before it is decoded,
    whatever its format (the stage checks the sizes sniffed in the worker, which only some formats give).
    Raises whatever the library raises for a corrupt image; :mod:`fastdata.gpu._decode` names shard and key.
    """
    if backend == "torchvision" and info.format in ("jpeg", "png", "webp", "gif"):
        tv, _ = torchvision_status()
        if max_pixels is not None and info.format == "webp":  # no size sniffed from its header: Pillow reads it
            try:
                with Image.open(io.BytesIO(data.numpy().data), formats=("WEBP",)) as img:
                    w, h = img.size
            except Image.UnidentifiedImageError:  # a Pillow without WebP, or a corrupt one: torchvision decides
                w = h = 0
            if w * h > max_pixels:  # as ImageDecoder(max_pixels=) says it
                raise ValueError(f"image of {w}x{h} = {w * h} pixels exceeds max_pixels={max_pixels} (a decompression "
                                 "bomb or an unexpectedly large image)")
        if info.format == "jpeg" and info.components in (1, 3):
            out = tv.decode_jpeg(data, mode=tv.ImageReadMode.RGB)
        else:
            out = tv.decode_image(data, mode=tv.ImageReadMode.RGB)
        if out.dtype != torch.uint8:  # a 16-bit PNG: uint16 (torchvision >= 0.21): as fastdata.decode does
            wide = out.to(torch.int32)
            out = (wide.bitwise_right_shift_(8) if wide.numel() and int(wide.max()) > 255 else wide).to(torch.uint8)
        return out if out.dim() == 3 else out[0]  # gif: first frame
    return _pillow_rgb(data, max_pixels)


@functools.lru_cache(maxsize=8)
def _rgb_decoder(max_pixels: int | None) -> ImageDecoder:
    return ImageDecoder("RGB", max_pixels=max_pixels)


def _pillow_rgb(data: torch.Tensor, max_pixels: int | None = None) -> torch.Tensor:
    """Pillow (fastdata's :class:`~fastdata.decode.ImageDecoder`: a JPEG's short way, pixel copies without
    the GIL), read from the tensor's memory without a copy. Without ``max_pixels`` an image over Pillow's
    ``MAX_IMAGE_PIXELS`` is refused (a ValueError), where Pillow would only warn: checked against the header,
    not by turning the warning into an error (``warnings.catch_warnings`` is not thread-safe, and each use
    makes every once-only warning of the process show again)."""
    return _rgb_decoder(max_pixels if max_pixels is not None else Image.MAX_IMAGE_PIXELS)(data.numpy().data)


def _tiny_jpeg() -> torch.Tensor:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format="JPEG")
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


_TINY_JPEG = _tiny_jpeg()
