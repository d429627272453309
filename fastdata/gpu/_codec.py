"""The codec libraries' entry points (TorchCodec, torchvision, nvImageCodec, Pillow): resolution, host decode,
and :func:`decode_device`, the one entry point of the device backends (nvImageCodec's: :mod:`._nvimgcodec`).

Backends resolve by name or by "auto" (:func:`host_backend`, :func:`device_backend`): TorchCodec >= 0.16,
else torchvision < 0.29 (its decoders are deprecated from 0.29 on), else Pillow. On the device Pillow
means "decode on the host"; nvImageCodec is chosen by name or ``FASTDATA_DEVICE_DECODER`` only.

Invariants:
- :func:`decode_device` runs the stream-order guard before every decoder call (nvJPEG's hardware engine does
  not honour the stream it is given): the host waits for the decode's current stream, except for
  nvImageCodec without a host wait, whose outputs no queued work can read (:func:`_stream_order_guard`).
- Every backend gives RGB uint8 ``(3, H, W)`` without EXIF rotation; 16-bit images keep their value
  up to 255, else their high byte (as :mod:`fastdata.decode`). TorchCodec applies EXIF orientation
  itself, so EXIF-rotated JPEGs go to Pillow on the host and come back as ``None`` from the device.
- A batched device call returns when its images are decoded (or, ``host_wait=False``, queued on the current
  stream); it raises for the whole list (TorchCodec, torchvision) or gives ``None`` where it could not
  decode (the stage decodes those on the host, whose errors name shard and key).
- Only the device decode stage imports this module, so DataLoader workers load no codec library.
Design notes and measurements: docs/design/codec.md.
"""
from __future__ import annotations

import functools
import importlib.metadata
import io
import os
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastdata.dataset import FORMATS, ImageInfo, sniff, sniff_size
from fastdata.decode import ImageDecoder
from fastdata.errors import FastdataError
from fastdata.gpu import _nvimgcodec

__all__ = [
    "DEVICE_BACKENDS", "DEVICE_DECODER_ENV", "HOST_BACKENDS", "NO_WAIT_BACKENDS", "DecoderUnavailableError",
    "HostImageDecoder", "check_host_wait", "decode_device", "decode_host", "default_max_pixels", "device_backend",
    "device_decodable", "device_decodable_codes", "host_backend", "nvimgcodec_status", "release_pending",
    "torchcodec_status", "torchvision_status",
]

HOST_BACKENDS = ("auto", "torchcodec", "torchvision", "pillow")
DEVICE_BACKENDS = ("auto", "torchcodec", "torchvision", "nvimgcodec", "pillow")
NO_WAIT_BACKENDS = ("nvimgcodec",)  # decode_device(host_wait=False)
DEVICE_DECODER_ENV = "FASTDATA_DEVICE_DECODER"  # what device_decoder="auto" resolves to when set
NVIMGCODEC_INSTALL = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg"
TORCHCODEC_MIN = (0, 16)  # the first release whose image decoders replace torchvision's
TORCHVISION_DEPRECATED = (0, 29)  # torchvision's image decoders warn (DeprecationWarning) from this release on
_INSTALL = {"torchcodec": "install the TorchCodec release paired with your torch (see the README's Install section)",
            "torchvision": "install the torchvision release paired with your torch"}


class DecoderUnavailableError(FastdataError, RuntimeError):
    """A decoder was asked for by name but cannot be loaded here; says how to install it."""


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string ("0.29.1+cu130" -> (0, 29))."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.cache
def torchcodec_status() -> tuple[Any, str]:
    """``(torchcodec.decoders module or None, reason)``: whether TorchCodec >= 0.16 decodes here."""
    try:
        import torchcodec
        import torchcodec.decoders as tcd

        version = str(getattr(torchcodec, "__version__", "0"))
        if _release(version) < TORCHCODEC_MIN:
            return None, f"torchcodec {version} is older than {'.'.join(map(str, TORCHCODEC_MIN))}"
        tcd.decode_jpeg(_TINY_JPEG)  # its libraries really load (one built for another torch does not)
    except Exception as e:  # noqa: BLE001 - any import/load failure means "not usable here"
        return None, f"TorchCodec unavailable: {type(e).__name__}: {str(e)[:200]}"
    return tcd, f"torchcodec {version}"


@functools.cache
def _torchvision_version() -> tuple[int, int] | None:
    """torchvision's installed release, read from its metadata without importing it (None: not installed)."""
    try:
        return _release(importlib.metadata.version("torchvision"))
    except importlib.metadata.PackageNotFoundError:
        return None


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


@functools.cache
def nvimgcodec_status() -> tuple[Any, str]:
    """``(nvidia.nvimgcodec module or None, reason)``: whether nvImageCodec imports here.

    Sets ``PYNVIMGCODEC_VERBOSITY=0`` before the import unless it is set: the images nvImageCodec
    cannot decode are decoded on the host, whose errors name shard and key, so its own log lines
    (one per bad image) are noise; set the variable to 1 (errors) or 2 (warnings) to see them.
    """
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    try:
        from nvidia import nvimgcodec
    except Exception as e:  # noqa: BLE001 - any import/load failure means "not usable here"
        return None, f"nvImageCodec unavailable: {type(e).__name__}: {str(e)[:200]}"
    return nvimgcodec, f"nvImageCodec {getattr(nvimgcodec, '__version__', '?')}"


def _auto() -> str:
    """What "auto" resolves to on both sides: TorchCodec, else torchvision before 0.29, else Pillow."""
    if torchcodec_status()[0] is not None:
        return "torchcodec"
    tv = _torchvision_version()
    if tv is not None and tv < TORCHVISION_DEPRECATED and torchvision_status()[0] is not None:
        return "torchvision"
    return "pillow"


def _require(name: str) -> Any:
    """The loaded library of a backend asked for by name, else :class:`DecoderUnavailableError`."""
    lib, reason = {"torchcodec": torchcodec_status, "torchvision": torchvision_status,
                   "nvimgcodec": nvimgcodec_status}[name]()
    if lib is None:
        how = (f"install it with `{NVIMGCODEC_INSTALL}` (CUDA 13 builds; -cu12 for CUDA 12)" if name == "nvimgcodec"
               else _INSTALL[name])
        raise DecoderUnavailableError(f"decoder {name!r} requested but {reason}; {how}")
    return lib


def host_backend(name: str = "auto") -> str:
    """The host decoder that ``name`` (one of :data:`HOST_BACKENDS`) resolves to here; a library
    named explicitly that does not work here raises :class:`DecoderUnavailableError`."""
    if name not in HOST_BACKENDS:
        raise ValueError(f"host decoder must be one of {HOST_BACKENDS}, got {name!r}")
    if name == "auto":
        return _auto()
    if name != "pillow":
        _require(name)
    return name


def device_backend(name: str = "auto") -> str:
    """The device decoder that ``name`` (one of :data:`DEVICE_BACKENDS`) resolves to.

    "auto" is the environment variable ``FASTDATA_DEVICE_DECODER`` where set, else TorchCodec, else
    torchvision before 0.29, else "pillow" (every image decoded on the host). "torchcodec" and
    "nvimgcodec" raise :class:`DecoderUnavailableError` (saying how to install them) when they do not
    load here; "torchvision" is checked when it decodes.
    """
    if name not in DEVICE_BACKENDS:
        raise ValueError(f"device_decoder must be one of {DEVICE_BACKENDS}, got {name!r}")
    if name == "auto":
        env = os.environ.get(DEVICE_DECODER_ENV, "").strip()
        if env in ("", "auto"):
            return _auto()
        if env not in DEVICE_BACKENDS:
            raise ValueError(f"environment variable {DEVICE_DECODER_ENV}={env!r}: must be one of {DEVICE_BACKENDS}")
        name = env
    if name in ("torchcodec", "nvimgcodec"):
        _require(name)
    return name


def device_decodable(info: ImageInfo) -> bool:
    """True when the device decoder handles this image (else it is decoded on the host).

    nvJPEG: 8-bit Huffman JPEGs (baseline, extended, progressive) with 1 or 3 components, except
    3-component files whose Adobe marker says RGB (no YCbCr transform), which nvJPEG would
    colour-convert wrongly. CMYK/YCCK, 12-bit, lossless and arithmetic-coded JPEGs and every other
    format go to the host.
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


def exif_rotated(data: bytes | memoryview | np.ndarray) -> bool:
    """True when a JPEG carries an EXIF orientation other than "as stored" (values 2-8): TorchCodec
    would rotate or mirror it. Reads the marker segments before the first scan only."""
    buf = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data.reshape(-1))
    n, pos = len(buf), 2
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return False
    while pos + 4 <= n and buf[pos] == 0xFF:
        marker = buf[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no metadata after it
            return False
        length = (buf[pos + 2] << 8) | buf[pos + 3]
        if length < 2:
            return False
        if marker == 0xE1 and bytes(buf[pos + 4:pos + 10]) == b"Exif\0\0":
            return _tiff_orientation(bytes(buf[pos + 10:min(n, pos + 2 + length)])) in range(2, 9)
        pos += 2 + length
    return False


def _tiff_orientation(tiff: bytes) -> int:
    """The orientation tag (0x0112) of an EXIF block's first IFD; 1 where absent or unreadable."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    end = "<" if tiff[:2] == b"II" else ">"
    ifd = struct.unpack_from(end + "I", tiff, 4)[0]
    if ifd + 2 > len(tiff):
        return 1
    for k in range(struct.unpack_from(end + "H", tiff, ifd)[0]):
        at = ifd + 2 + 12 * k
        if at + 12 > len(tiff):
            break
        tag, kind = struct.unpack_from(end + "HH", tiff, at)
        if tag == 0x0112:
            return struct.unpack_from(end + "H", tiff, at + 8)[0] if kind == 3 else 1
    return 1


def _stream_order_guard(device: torch.device) -> None:
    """Make sure no work queued so far on ``device``'s current stream can still read memory the decoder may write.

    nvJPEG's hardware engine writes its outputs without waiting for earlier work on the stream it is given
    (meta-pytorch/torchcodec#1634, pytorch/vision#9606), so an event wait on the device cannot order it.
    - A decoder whose outputs come from torch's caching allocator (TorchCodec, torchvision, nvImageCodec's
      copies): the host waits for an event recorded on the stream. The allocator hands out again blocks that
      work queued on that stream may still read. These decoders wait on the host for their own work before
      they return anyway, so this moves a wait rather than adding one. An event, not ``Stream.synchronize``:
      the same wait, which ``torch.cuda.set_sync_debug_mode`` does not count (the stage's decode thread runs it).
    - nvImageCodec without a host wait (``host_wait=False``): :func:`decode_device` does not call the guard,
      there is nothing to wait for. The engine writes only nvImageCodec's own buffers, which go back to its
      pool only after an event after their last read has completed (:mod:`fastdata.gpu._nvimgcodec`), so
      no queued work reads a buffer it can be given.
    Reasoning and limits: docs/design/codec.md ("The stream-order guard").
    """
    queued = torch.cuda.Event()
    queued.record(torch.cuda.current_stream(device))
    queued.synchronize()


def decode_device(views: Sequence[torch.Tensor], device: torch.device, backend: str = "auto", *,
                  host_wait: bool = True) -> list[torch.Tensor | None]:
    """Decode host uint8 tensors (JPEG bytes) into RGB uint8 ``(3, H, W)`` tensors on ``device``.

    ``backend``: a :data:`DEVICE_BACKENDS` name (see :func:`device_backend`). Runs on the current
    CUDA stream's timeline, after the stream-order guard. TorchCodec and torchvision raise
    ``RuntimeError`` for the whole list if any image fails; ``None`` marks an image left to the host
    (nvImageCodec: could not decode it; TorchCodec: EXIF-rotated). Returns when the images are decoded,
    or, with ``host_wait=False`` (a backend of :data:`NO_WAIT_BACKENDS` only), once their decode is queued:
    they are then ready for work queued on the current stream after this call.
    """
    name = device_backend(backend)
    call = _DEVICE_DECODERS.get(name)
    if call is None:
        raise DecoderUnavailableError(f"no device JPEG decoder here (device decoder {backend!r} resolves to "
                                      f"{name!r}); {_INSTALL['torchcodec']}")
    check_host_wait(name, host_wait)
    if host_wait:
        if device.type == "cuda":
            _stream_order_guard(device)
        return call(views, device)
    return call(views, device, host_wait=False)  # a decoder of NO_WAIT_BACKENDS (check_host_wait): it takes it


def release_pending(device: torch.device | None = None) -> None:
    """Wait for the decodes of calls made with ``host_wait=False`` (of ``device``, or all) and release the
    buffers and inputs they hold (the stage's ``close()``; also at interpreter exit)."""
    _nvimgcodec.release(device)


def check_host_wait(decoder: str, host_wait: Any) -> bool:
    """``host_wait`` validated for a resolved device decoder: a bool, and False only for a decoder of
    :data:`NO_WAIT_BACKENDS` (TorchCodec and torchvision wait on the host inside their own call)."""
    if not isinstance(host_wait, bool):
        raise ValueError(f"host_wait must be True or False, got {host_wait!r}")
    if not host_wait and decoder not in NO_WAIT_BACKENDS:
        raise ValueError(f"host_wait=False needs a device decoder of {NO_WAIT_BACKENDS}, whose call can return "
                         f"before its decode is done; device decoder {decoder!r} waits on the host inside its own "
                         "call (name device_decoder='nvimgcodec')")
    return host_wait


def _decode_torchcodec(views: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """One batched ``torchcodec.decoders.decode_jpeg`` call (nvJPEG on CUDA: the JPEG engines where the GPU
    has them, one image at a time in the hybrid path for the rest); EXIF-rotated JPEGs are left out."""
    tcd = _require("torchcodec")
    keep = [i for i, v in enumerate(views) if not exif_rotated(v.numpy())]
    out: list[torch.Tensor | None] = [None] * len(views)
    if keep:
        for i, img in zip(keep, tcd.decode_jpeg([views[i] for i in keep], mode="RGB", device=device)):
            out[i] = img
    return out


def _decode_torchvision(views: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """One batched ``torchvision.io.decode_jpeg`` call (deprecated from torchvision 0.29 on)."""
    tv = _require("torchvision")
    return tv.decode_jpeg(list(views), mode=tv.ImageReadMode.RGB, device=device)


def _decode_nvimgcodec(views: Sequence[torch.Tensor], device: torch.device,
                       host_wait: bool = True) -> list[torch.Tensor | None]:
    """nvImageCodec on the current stream (:mod:`fastdata.gpu._nvimgcodec`): its buffers are copied into torch
    memory on that stream; the call then waits for an event after the copies, or, with ``host_wait=False``,
    keeps its images and inputs until that event has completed (docs/design/codec.md)."""
    return _nvimgcodec.decode(_require("nvimgcodec"), views, device, host_wait)


# ``(views, device)``; those of NO_WAIT_BACKENDS also take ``host_wait=``
_DEVICE_DECODERS: dict[str, Callable[..., list[torch.Tensor | None]]] = {
    "torchcodec": _decode_torchcodec, "torchvision": _decode_torchvision, "nvimgcodec": _decode_nvimgcodec}


def decode_host(data: torch.Tensor, info: ImageInfo, backend: str, max_pixels: int | None = None) -> torch.Tensor:
    """Decode one image (host uint8 tensor of its bytes) into an RGB uint8 ``(3, H, W)`` CPU tensor
    (16-bit images as :mod:`fastdata.decode` converts them: exact up to 255, else their high byte).

    ``backend``: a resolved :func:`host_backend` name. Formats the library does not read, and JPEGs
    TorchCodec would rotate (EXIF), go to Pillow. ``max_pixels``: an image whose header claims more
    pixels is refused (ValueError) before it is decoded. Raises whatever the library raises for a
    corrupt image; :mod:`fastdata.gpu._decode` names shard and key.
    """
    decode = _HOST_DECODERS.get(backend)
    if decode is None or info.format not in ("jpeg", "png", "webp", "gif") or (
            backend == "torchcodec" and info.format == "jpeg" and exif_rotated(data.numpy())):
        return _pillow_rgb(data, max_pixels)
    if max_pixels is not None and info.format == "webp":  # no size sniffed from its header: Pillow reads it
        try:
            with Image.open(io.BytesIO(data.numpy().data), formats=("WEBP",)) as img:
                w, h = img.size
        except Image.UnidentifiedImageError:  # a Pillow without WebP, or a corrupt one: the library decides
            w = h = 0
        if w * h > max_pixels:  # as ImageDecoder(max_pixels=) says it
            raise ValueError(f"image of {w}x{h} = {w * h} pixels exceeds max_pixels={max_pixels} (a decompression "
                             "bomb or an unexpectedly large image)")
    out = decode(data, info)
    if out.dtype != torch.uint8:  # a 16-bit PNG comes as uint16: as fastdata.decode converts it
        wide = out.to(torch.int32)
        out = (wide.bitwise_right_shift_(8) if wide.numel() and int(wide.max()) > 255 else wide).to(torch.uint8)
    return out if out.dim() == 3 else out[0]  # gif, animated webp: the first frame


def _host_torchcodec(data: torch.Tensor, info: ImageInfo) -> torch.Tensor:
    tcd = _require("torchcodec")
    if info.format == "jpeg":
        return tcd.decode_jpeg(data, mode="RGB")
    return tcd.decode_image(data, mode="RGB", output_dtype="auto")  # 16-bit PNGs as uint16, converted above


def _host_torchvision(data: torch.Tensor, info: ImageInfo) -> torch.Tensor:
    tv = _require("torchvision")
    if info.format == "jpeg" and info.components in (1, 3):
        return tv.decode_jpeg(data, mode=tv.ImageReadMode.RGB)
    return tv.decode_image(data, mode=tv.ImageReadMode.RGB)


_HOST_DECODERS: dict[str, Callable[[torch.Tensor, ImageInfo], torch.Tensor]] = {
    "torchcodec": _host_torchcodec, "torchvision": _host_torchvision}


class HostImageDecoder:
    """A whole-image decoder for DataLoader workers (``ShardedDataset(decode={"jpg": HostImageDecoder()})``):
    bytes to an RGB uint8 ``(3, H, W)`` tensor with a :data:`HOST_BACKENDS` library, the same pixels and
    conventions as :class:`~fastdata.gpu.DecodeImages`' host path. ``max_pixels`` (default: Pillow's
    ``Image.MAX_IMAGE_PIXELS``) refuses larger images before decoding them. Pickles (spawn, forkserver)."""

    def __init__(self, backend: str = "auto", max_pixels: int | None = None) -> None:
        self.backend = host_backend(backend)
        self.max_pixels = max_pixels

    def __call__(self, data: bytes | memoryview) -> torch.Tensor:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        info = ImageInfo(sniff(data))  # as PackedImages sniffs it for the stage
        if info.format == "jpeg" and info.sof is None:  # no frame header: Pillow's error names the bytes
            return _pillow_rgb(t, self.max_pixels)
        limit = self.max_pixels if self.max_pixels is not None else default_max_pixels()
        if self.backend != "pillow" and limit is not None and info.format in ("jpeg", "png", "gif"):
            h, w = sniff_size(data)  # the header only: refuse a bomb before a library decodes it
            if w * h > limit:
                raise ValueError(f"image of {w}x{h} = {w * h} pixels exceeds max_pixels={limit} (a decompression "
                                 "bomb or an unexpectedly large image)")
        return decode_host(t, info, self.backend, limit)  # WebP's size: decode_host reads it with Pillow

    def __repr__(self) -> str:
        return f"HostImageDecoder({self.backend!r})"


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
