"""Image checks and the resize-and-centre-crop used by ``fastdata shard --resize``.

Checking levels (``check=``):

- ``"header"`` (default for pass-through): ``Image.open`` parses the header and
  ``Image.verify()`` runs the format's own integrity check (PNG: every chunk CRC; JPEG:
  markers up to the first scan only). Catches non-images, garbage and truncated headers for a
  few microseconds per image; a JPEG truncated inside its scan data passes, and so does an
  image under another format's extension (a PNG named ``.jpg``: decoders go by the bytes).
- ``"full"``: additionally decodes every pixel (``Image.load()``), catching truncated or
  corrupt scan data at the cost of a full decode (about 2 ms per 500 px JPEG).

Resizing always decodes, so ``--resize`` implies ``"full"``. Greyscale wider than 8 bits is read as
:mod:`fastdata.decode` reads it (16-bit: exact up to 255, else its high byte; 32-bit integer and float:
exact where the values are integers in 0..255, else a :class:`BadImage`), not clipped at 255.
"""
from __future__ import annotations

import io
import re

import numpy as np
from PIL import Image

from fastdata._util import IMAGE_SUFFIXES
from fastdata.errors import DecodeError

CHECK_LEVELS = ("header", "full")

# Lower-case file extensions treated as images (field name = the extension): the package's one set.
IMAGE_EXTENSIONS = IMAGE_SUFFIXES

# extension -> PIL format name, e.g. "jpg" -> "JPEG"
_FORMATS = {ext.lstrip("."): fmt for ext, fmt in Image.registered_extensions().items()}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# PIL raises OSError, ValueError, SyntaxError, struct.error, IndexError, ... on malformed
# input; every Exception from decoding untrusted bytes means "bad image".


class BadImage(DecodeError):
    """An input image could not be read; ``str(self)`` is a deterministic reason."""


def is_image_field(field: str) -> bool:
    """True when the last suffix of ``field`` names an image format (``jpg``, ``seg.png``)."""
    return field.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS


def _reason(err: BaseException) -> str:
    """Deterministic one-line reason (no object addresses, no temporary paths)."""
    if isinstance(err, Image.UnidentifiedImageError):
        return "not a recognised image format"
    text = _ADDRESS.sub("", str(err)).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else 'unreadable image'}"


def _open(data: bytes, field: str = "") -> Image.Image:
    """``Image.open`` trying the format the field's extension names first (30% faster for JPEG)."""
    fmt = _FORMATS.get(field.rsplit(".", 1)[-1].lower()) if field else None
    if fmt is not None:
        try:
            return Image.open(io.BytesIO(data), formats=(fmt,))
        except Image.UnidentifiedImageError:
            pass  # mislabelled (e.g. a PNG named .jpg): let PIL try every format
    return Image.open(io.BytesIO(data))


def check_image(data: bytes, *, check: str = "header", field: str = "") -> None:
    """Raise :class:`BadImage` with a reason when ``data`` is not a readable image.

    ``field`` (e.g. ``"jpg"``) is a hint for which decoder to try first.
    """
    try:
        img = _open(data, field)
        if check == "full":
            img.load()
        else:
            img.verify()
    except Exception as e:  # noqa: BLE001 - PIL raises many types on malformed input
        raise BadImage(_reason(e)) from e


_WIDE_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})


def _to_8bit(img: Image.Image) -> Image.Image:
    """An "L" image of a 16-bit, 32-bit integer or float greyscale image, by the rule of ``fastdata.decode``'s
    ``_to_8bit`` (that stage sits above this one): Pillow's ``convert`` would clip every value above 255."""
    a = np.asarray(img)
    if img.mode.startswith("I;16") and a.size and a.max() > 255:
        return Image.fromarray(np.ascontiguousarray((a >> 8).astype(np.uint8)))
    if a.size and not (np.all((a >= 0) & (a <= 255)) and np.array_equal(a, np.floor(a))):
        raise ValueError(f"a mode {img.mode} image with values in [{a.min()}, {a.max()}]: not integers in 0..255, "
                         "so no uint8 image holds them; convert it to 8 bits first")
    return Image.fromarray(np.ascontiguousarray(a.astype(np.uint8)))


def center_crop_box(width: int, height: int) -> tuple[float, float, float, float]:
    """The centred square of side ``min(width, height)`` as a PIL box."""
    side = min(width, height)
    left = (width - side) / 2.0
    top = (height - side) / 2.0
    return (left, top, left + side, top + side)


def resize_center_crop(data: bytes, size: int, *, field: str = "") -> np.ndarray:
    """Decode ``data``, resize the shorter side to ``size``, centre-crop ``size x size``.

    Returns a C-contiguous ``uint8`` array of shape ``(3, size, size)`` (CHW, RGB).
    Equivalent to "resize shorter side, then centre crop" up to sub-pixel rounding, but
    only the crop box is resampled, and JPEGs at least twice the target are first
    reduced by the decoder (``Image.draft``), which is measured at ~1.6x the speed of
    resizing the whole image (see PERF_NOTES.md). Raises :class:`BadImage`.
    """
    try:
        img = _open(data, field)
        # draft() picks the largest DCT scale (1/2, 1/4, 1/8) that keeps both sides
        # >= the request, so it only acts on images at least twice the target.
        img.draft("RGB", (size, size))
        if img.mode in _WIDE_MODES:
            img = _to_8bit(img)
        if img.mode != "RGB":
            img = img.convert("RGB")
        box = center_crop_box(*img.size)
        out = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
        arr = np.asarray(out, dtype=np.uint8)
    except Exception as e:  # noqa: BLE001 - PIL raises many types on malformed input
        raise BadImage(_reason(e)) from e
    return np.ascontiguousarray(arr.transpose(2, 0, 1))
