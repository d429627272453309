"""Field decoders. Safe by default: nothing read from a shard can execute code.

A field is decoded by the last suffix of its name (``jpg``, ``seg.png`` -> ``png``): images become
uint8 (C, H, W) RGB tensors, ``npy``/``npz`` NumPy arrays (``allow_pickle=False``), ``cls``-like
fields ``int``, ``txt`` ``str``, ``json`` objects, anything else ``bytes``; pickles and torch files
are refused unless ``allow_pickle``. Values that are not bytes (arrays from HDF5 shards) pass
through, except integer scalars of ``cls``-like fields, which become ``int``.

Images of more than 8 bits per sample become uint8 without silent loss, or are refused; EXIF
orientation is not applied (pixels as stored, as on the device decode path).

The suffix table and the rules for 16- and 32-bit images: docs/design/field-decoders.md.
"""
from __future__ import annotations

import functools
import io
import json
import pickle
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch
from PIL import Image, ImageFile

from fastdata._util import IMAGE_SUFFIXES, INT_SUFFIXES, npy_lock
from fastdata.errors import DecodeError

__all__ = [
    "DECODED_SUFFIXES",
    "IMAGE_SUFFIXES",
    "PICKLE_SUFFIXES",
    "ImageDecoder",
    "SampleDecoder",
    "check_max_pixels",
    "image_to_tensor",
    "is_image_field",
    "suffix",
]

PICKLE_SUFFIXES = frozenset({"pickle", "pkl", "pyd", "pth", "pt"})
_TEXT_SUFFIXES = frozenset({"txt", "text"})
_JSON_SUFFIXES = frozenset({"json", "jsn"})

Decoder = Callable[[bytes], Any]


def check_max_pixels(max_pixels: int | None) -> int | None:
    """Validate a ``max_pixels`` argument (None: only Pillow's ``MAX_IMAGE_PIXELS`` applies)."""
    if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1):
        raise ValueError(f"max_pixels must be an int >= 1 or None, got {max_pixels!r}")
    return max_pixels


@functools.lru_cache(maxsize=4096)
def suffix(field: str) -> str:
    """Last dot-separated part of a field name, lower case (``"seg.PNG"`` -> ``"png"``).

    Memoised: called for every field of every sample, on a handful of distinct names."""
    return field.rsplit(".", 1)[-1].lower()


@functools.lru_cache(maxsize=4096)
def is_image_field(field: str) -> bool:
    """True when the field's last suffix names an image format (memoised, as :func:`suffix`)."""
    return suffix(field) in IMAGE_SUFFIXES


# Modes whose pixels Pillow stores as 8-bit bands in 1 or 4 bytes and packs by plain copies
# (libImaging/Pack.c: copy1, copy4, ImagingPackRGB; not LAB, whose a/b are re-signed): mode ->
# (mapped mode of the same pixel size, bytes per pixel, bands np.asarray(img) returns: the first ones).
_PLAIN_MODES = {
    "L": ("L", 1, 1), "P": ("L", 1, 1),
    "RGB": ("RGBX", 4, 3), "YCbCr": ("RGBX", 4, 3), "HSV": ("RGBX", 4, 3),
    "RGBA": ("RGBX", 4, 4), "RGBa": ("RGBX", 4, 4), "RGBX": ("RGBX", 4, 4), "CMYK": ("RGBX", 4, 4),
}


def _map_array(arr: np.ndarray, mode: str) -> Any:
    """A Pillow core image whose pixel memory is ``arr`` (C-contiguous uint8, rows of ``arr.shape[1]``
    pixels of the mode's size): what ``Image.frombuffer(mode, ...)`` maps, without its Python overhead."""
    size = (arr.shape[1], arr.shape[0])
    try:
        return Image.core.map_buffer(arr, size, "raw", 0, (mode, 0, 1))
    except (AttributeError, TypeError):  # a Pillow without the primitive: the public, slower route
        return Image.frombuffer(mode, size, arr, "raw", mode, 0, 1).im


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """A PIL image as a contiguous uint8 tensor (C, H, W); the same values as ``np.asarray(img)``.

    Greyscale wider than 8 bits (modes I;16, I, F: e.g. a PIL transform's output) must hold integers
    in 0..255, else ValueError: ``np.asarray(img, dtype=np.uint8)`` would wrap them around, and their
    scale is unknown here (16-bit image files are scaled by :class:`ImageDecoder`).

    For 8-bit modes (L, P, RGB, RGBA, CMYK, ...) the pixels are copied without holding the GIL:
    Pillow pastes them into a NumPy array that an image maps (``paste`` releases the GIL), and
    NumPy reorders the bands into planes (plain-dtype copies release it too). ``np.asarray``
    (Pillow's ``tobytes``) holds the GIL throughout, which bounds a thread decoder.
    Other modes (1, I, F, I;16, LA, LAB, ...) go through ``np.asarray``.
    """
    img.load()
    if img.mode in _WIDE_MODES:  # np.asarray(img, dtype=np.uint8) would wrap around
        img = _to_8bit(img, scale16=False)
    w, h = img.size
    plain = _PLAIN_MODES.get(img.mode)
    if plain is None or w == 0 or h == 0:
        arr = np.asarray(img, dtype=np.uint8)
        arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
        return torch.from_numpy(np.array(arr, order="C", copy=True))  # a copy: tobytes' buffer is read-only
    mapped, pixel, bands = plain
    if pixel == 1:  # one band: paste straight into the result
        out = np.empty((1, h, w), dtype=np.uint8)
        _map_array(out[0], mapped).paste(img.im, (0, 0, w, h))
        return torch.from_numpy(out)
    staged = np.empty((h, w, 4), dtype=np.uint8)
    _map_array(staged, mapped).paste(img.im, (0, 0, w, h))
    out = np.empty((bands, h, w), dtype=np.uint8)
    np.copyto(out, staged.transpose(2, 0, 1)[:bands])
    return torch.from_numpy(out)


_WIDE_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})


def _to_8bit(img: Image.Image, *, scale16: bool = True) -> Image.Image:
    """An "L" image of a loaded 16-bit, 32-bit integer or float greyscale image (see the module docstring):
    exact where every value is an integer in 0..255; else, with ``scale16``, 16-bit by the high byte (a
    16-bit file's full range), and otherwise a ValueError. (Pillow's own conversion clips at 255, and
    ``np.asarray(img, dtype=np.uint8)`` wraps around.)"""
    a = np.asarray(img)
    if scale16 and img.mode.startswith("I;16") and a.size and a.max() > 255:
        out = (a >> 8).astype(np.uint8)
    else:
        if a.size and not (np.all((a >= 0) & (a <= 255)) and np.array_equal(a, np.floor(a))):
            kind = {"F": "float", "I": "32-bit integer"}.get(img.mode, "16-bit")
            raise ValueError(f"a {kind} image (mode {img.mode}) with values in [{a.min()}, {a.max()}]: not integers in "
                             "0..255, so no uint8 image holds them; convert it to 8 bits yourself or give the field "
                             "its own decoder")
        out = a.astype(np.uint8)
    res = Image.fromarray(np.ascontiguousarray(out))  # uint8 (H, W): mode L
    res.info, res.format = dict(img.info), img.format
    return res


def _decode_into_array(img: Image.Image) -> np.ndarray | None:
    """Load a freshly opened JPEG into a NumPy array mapped as its pixel memory; return the array.

    Pillow would allocate zero-filled memory with the GIL held (``Image.core.new``, ~30 us for a
    640 x 480 RGB image); an uninitialised NumPy array costs ~2 us, and every pixel is written by
    the decoder. Other formats, truncated-image loading (``ImageFile.LOAD_TRUNCATED_IMAGES``: the
    undecoded rest must stay zero) or a Pillow that allocates anyway: loaded as usual, None.
    """
    mode = img.mode
    if (img.format != "JPEG" or mode not in ("L", "RGB", "CMYK") or len(getattr(img, "tile", ())) != 1
            or ImageFile.LOAD_TRUNCATED_IMAGES or 0 in img.size or not hasattr(Image.core, "map_buffer")):
        img.load()
        return None
    w, h = img.size
    arr = np.empty((h, w) if mode == "L" else (h, w, 4), dtype=np.uint8)
    try:
        core = Image.core.map_buffer(arr, (w, h), "raw", 0, (mode, 0, 1))
    except (TypeError, ValueError):
        img.load()
        return None
    img.im = core
    img.load()
    return arr if img.im is core and img.mode == mode and img.size == (w, h) else None


_MAGIC_FORMATS = ((b"\xff\xd8\xff", ("JPEG",)), (b"\x89PNG\r\n\x1a\n", ("PNG",)))


def open_image(data: bytes | memoryview) -> Image.Image:
    """``Image.open`` of in-memory bytes, asking the format's plugin first when the magic bytes name it.

    Without ``formats``, Pillow tries every registered plugin in registration order; once anything
    has called ``Image.init()`` (``registered_extensions``, ``save``, a failed open) that order is
    alphabetical and plugins without a prefix check (IM, ...) parse the header before JPEG's does:
    about 55 us per image with the GIL held. Bytes the named plugin rejects are opened as before.
    """
    head = bytes(data[:8])
    for magic, formats in _MAGIC_FORMATS:
        if head.startswith(magic):
            try:
                return Image.open(io.BytesIO(data), formats=formats)
            except Image.UnidentifiedImageError:
                break
    try:
        return Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        # Pillow names the stream object (its memory address): name the bytes instead
        raise Image.UnidentifiedImageError(
            f"cannot identify image file: {len(data)} bytes starting {head!r}") from None


_JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}
# Markers Pillow's JpegImagePlugin reads a length after and skips or parses (its MARKER table, less the
# SOF-like DHP, 0xDE). SOI and fill bytes are handled apart; anything else before the scan (an escaped
# 0xFF, RSTn, TEM, JPGn, DHP) is left to Pillow.
_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_JPEG_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_JPEG_LENGTH = frozenset({0xC4, 0xCC, 0xDB, 0xDC, 0xDD, 0xDF, 0xFE, *range(0xE0, 0xF0)}) | _JPEG_SOF


class _JpegHeader:
    """What Pillow's JPEG plugin reads from a JPEG's header, from one scan of its segment lengths."""

    __slots__ = ("height", "info", "mode", "plain", "width")

    def __init__(self, width: int, height: int, mode: str, info: dict[str, Any], plain: bool):
        self.width, self.height, self.mode, self.info, self.plain = width, height, mode, info, plain


def _jpeg_header(data: bytes | memoryview) -> _JpegHeader | None:
    """Size, mode and ``info`` of a JPEG as ``Image.open`` would give them, or None for anything unusual
    (no SOI, junk between segments, a segment past the end, not 8 bits, not 1/3/4 components, DHP, an
    MPO): Pillow then opens it, with its own errors. ``plain``: no metadata but a JFIF APP0 segment and the
    progressive flag, so ``info`` is all Pillow would put there (EXIF, ICC, XMP, comments: not plain).

    A few microseconds of Python instead of Pillow's ~60-100 (its plugin search, ``ImageFile`` set-up and
    per-marker handlers, which parse quantisation tables), all with the GIL held.
    """
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    info: dict[str, Any] = {}
    plain = True
    size: tuple[int, int, str] | None = None
    i = 2
    while i + 2 <= n:
        if data[i] != 0xFF:
            return None
        m = data[i + 1]
        if m == 0xFF:  # a fill byte
            i += 1
            continue
        if m == 0xD8:
            i += 2
            continue
        if m == 0xDA:  # start of scan: the header is complete
            if size is None:
                return None
            return _JpegHeader(size[0], size[1], size[2], info, plain)
        if m not in _JPEG_LENGTH or i + 4 > n:
            return None
        end = i + 2 + ((data[i + 2] << 8) | data[i + 3])
        if end > n or end < i + 4:
            return None
        if m in _JPEG_SOF:
            if end - i < 10 or data[i + 4] != 8 or data[i + 9] not in _JPEG_MODES:
                return None
            size = ((data[i + 7] << 8) | data[i + 8], (data[i + 5] << 8) | data[i + 6], _JPEG_MODES[data[i + 9]])
            if m in _JPEG_PROGRESSIVE:
                info["progressive"] = info["progression"] = 1
        elif m == 0xE0:
            seg = bytes(data[i + 4:end])
            if seg.startswith(b"JFIF"):  # as JpegImagePlugin.APP
                if len(seg) < 7:
                    return None
                info["jfif"] = version = (seg[5] << 8) | seg[6]
                info["jfif_version"] = divmod(version, 256)
                if len(seg) >= 12:
                    unit, density = seg[7], ((seg[8] << 8) | seg[9], (seg[10] << 8) | seg[11])
                    if unit == 1:
                        info["dpi"] = density
                    elif unit == 2:
                        info["dpi"] = tuple(d * 2.54 for d in density)
                    info["jfif_unit"] = unit
                    info["jfif_density"] = density
        elif m == 0xE2 and bytes(data[i + 4:i + 8]) == b"MPF\0":
            return None  # a multi-picture file: Pillow's MPO plugin
        elif 0xE1 <= m <= 0xEF or m == 0xFE:
            plain = False  # EXIF, ICC, XMP, Adobe, comments...: info only Pillow fills
        i = end
    return None


def _decode_jpeg(data: bytes | memoryview, head: _JpegHeader, mode: str | None,
                 want: int | None) -> tuple[str, np.ndarray] | None:
    """Decode a JPEG with Pillow's libjpeg decoder straight into a new NumPy array, as ``Image.open`` +
    ``draft`` + ``load`` would (the same decoder and arguments, so the same pixels), without the Python of
    ``ImageFile``: (mode, array: (H, W) for L, (H, W, 4) otherwise), or None where it cannot or the data
    is bad (the caller then goes through Pillow, which raises its usual error)."""
    w, h, img_mode = head.width, head.height, head.mode
    rawmode = "CMYK;I" if img_mode == "CMYK" else img_mode  # as JpegImagePlugin: Adobe conventions
    scale = 1
    if want and min(w, h) >= 2 * want:  # as ImageDecoder's Image.draft call, and JpegImageFile.draft
        if img_mode == "RGB" and mode in ("L", "YCbCr"):
            img_mode = rawmode = mode
        f = want / min(w, h)
        s = min(w // (int(w * f) + 1), h // (int(h * f) + 1))
        scale = next(k for k in (8, 4, 2, 1) if s >= k)
        w, h = (w + scale - 1) // scale, (h + scale - 1) // scale
    if img_mode not in ("L", "RGB", "CMYK"):
        return None
    arr = np.empty((h, w) if img_mode == "L" else (h, w, 4), dtype=np.uint8)
    try:
        core = Image.core.map_buffer(arr, (w, h), "raw", 0, (img_mode, 0, 1))
        decoder = Image.core.jpeg_decoder(img_mode, rawmode, "", scale, 0)
    except (AttributeError, TypeError, ValueError, OSError):
        return None
    try:
        decoder.setimage(core, (0, 0, w, h))
        n, err = decoder.decode(data)  # releases the GIL; the whole file in one call
    finally:
        decoder.cleanup()
    if n >= 0 or err < 0:  # truncated or corrupt
        return None
    return img_mode, arr


def _as_image(arr: np.ndarray, mode: str, info: dict[str, Any]) -> Image.Image:
    """A PIL image whose pixels are ``arr`` (as :func:`_decode_jpeg` returns it), format JPEG, ``info``."""
    img = Image.Image()._new(Image.core.map_buffer(arr, (arr.shape[1], arr.shape[0]), "raw", 0, (mode, 0, 1)))
    img.info = dict(info)
    img.format = "JPEG"
    return img


class ImageDecoder:
    """Decode image bytes with Pillow.

    A JPEG is decoded by Pillow's own libjpeg decoder with the arguments ``Image.open`` would give it,
    but after a scan of its segment headers instead of ``Image.open`` (half the GIL-held Python per
    image, which bounds the thread decoder): the same pixels, and for :meth:`pil` the same mode, size,
    ``format`` and ``info``; a JPEG carrying EXIF, ICC, XMP or comment segments still goes through
    ``Image.open`` for :meth:`pil`, so its metadata is there. Anything unusual goes through Pillow as a
    whole, with Pillow's errors.

    Args:
        mode: Pillow mode of the result ("RGB" default, "L" for greyscale masks, None: as stored). A palette
            ("P") mask, such as Pascal VOC's, needs None: "L" (and "RGB") map its class ids through the palette
            to grey levels (colours).
        draft_size: shorter side the consumer needs. JPEGs whose shorter side is at least twice
            this are decoded at a reduced DCT scale (``Image.draft``), still >= ``draft_size``.
    """

    def __init__(self, mode: str | None = "RGB", *, draft_size: int | None = None, max_pixels: int | None = None):
        if draft_size is not None and (not isinstance(draft_size, int) or isinstance(draft_size, bool)
                                       or draft_size < 1):
            raise ValueError(f"draft_size must be an int >= 1 or None, got {draft_size!r}")
        if mode is not None and (not isinstance(mode, str) or mode not in Image.MODES):
            # else every image fails to convert, an error that blames the shard's data
            raise ValueError(f"ImageDecoder: mode must be None or a Pillow mode ({', '.join(Image.MODES)}), "
                             f"got {mode!r}")
        self.mode = mode
        self.draft_size = draft_size
        self.max_pixels = check_max_pixels(max_pixels)

    def pil(self, data: bytes | memoryview, *, draft_size: int | None = None) -> Image.Image:
        """Decoded (fully loaded) PIL image.

        Pillow's own limit stays in force: above ``PIL.Image.MAX_IMAGE_PIXELS`` it warns
        (``DecompressionBombWarning``, not silenced here), above twice that it raises. With
        ``max_pixels``, an image whose header claims more pixels is refused (ValueError) before decoding.
        """
        return cast(Image.Image, self._decode(data, draft_size)[0])  # an image: not pixels_only

    def _decode(self, data: bytes | memoryview, draft_size: int | None, *,
                pixels_only: bool = False) -> tuple[Image.Image | str, np.ndarray | None]:
        """(loaded image, the NumPy array holding its pixels where it was decoded into one, else None).

        A JPEG goes the short way (:func:`_decode_jpeg`: no ``Image.open``) when its header scans cleanly and
        either only its pixels are wanted (``pixels_only``: then the first item is just the mode) or it holds
        no metadata the short way would drop; anything else, and any JPEG the short way cannot decode, goes
        through Pillow as a whole, errors included.
        """
        head = None if ImageFile.LOAD_TRUNCATED_IMAGES else _jpeg_header(data)
        if head is not None and (pixels_only or head.plain):
            self._check_pixels(head.width, head.height)  # first: an image it refuses needs no bomb warning
            Image._decompression_bomb_check((head.width, head.height))  # as Image.open
            got = _decode_jpeg(data, head, self.mode, draft_size or self.draft_size)
            if got is not None:
                mode, arr = got
                if self.mode is None or mode == self.mode:
                    return (mode if pixels_only else _as_image(arr, mode, head.info)), arr
                return _as_image(arr, mode, head.info).convert(self.mode), None
        img = open_image(data)
        self._check_pixels(*img.size)
        want = draft_size or self.draft_size
        if want and img.format == "JPEG" and min(img.size) >= 2 * want:
            scale = want / min(img.size)
            img.draft(self.mode or img.mode, (int(img.size[0] * scale) + 1, int(img.size[1] * scale) + 1))
        if img.format == "JPEG":  # the whole file in one read (no chunk copies) and one decode call
            img.decodermaxblock = max(ImageFile.MAXBLOCK, data.nbytes if isinstance(data, memoryview) else len(data))
        arr = _decode_into_array(img)
        if img.mode in _WIDE_MODES and self.mode not in _WIDE_MODES:  # Pillow would clip at 255
            img, arr = _to_8bit(img), None
        if self.mode is not None and img.mode != self.mode:
            img = img.convert(self.mode)
            arr = None
        return img, arr

    def _check_pixels(self, width: int, height: int) -> None:
        if self.max_pixels is not None and width * height > self.max_pixels:
            raise ValueError(f"image of {width}x{height} = {width * height} pixels exceeds "
                             f"max_pixels={self.max_pixels} (a decompression bomb or an unexpectedly large image)")

    def __call__(self, data: bytes | memoryview) -> torch.Tensor:
        img, arr = self._decode(data, None, pixels_only=True)
        if arr is None:
            return image_to_tensor(img)  # type: ignore[arg-type]  # an image whenever arr is None
        if arr.ndim == 2:  # one band, decoded straight into the result's memory
            return torch.from_numpy(arr[None])
        bands = _PLAIN_MODES[img if isinstance(img, str) else img.mode][2]
        out = np.empty((bands, *arr.shape[:2]), dtype=np.uint8)
        np.copyto(out, arr.transpose(2, 0, 1)[:bands])  # releases the GIL
        return torch.from_numpy(out)

    def __repr__(self) -> str:
        return f"ImageDecoder(mode={self.mode!r}, draft_size={self.draft_size!r}, max_pixels={self.max_pixels!r})"


def _decode_npy(data: bytes, allow_pickle: bool) -> np.ndarray:
    with npy_lock():  # the header parse is not thread-safe (decode_threads)
        return np.lib.format.read_array(io.BytesIO(data), allow_pickle=allow_pickle)


def _decode_npz(data: bytes, allow_pickle: bool) -> dict[str, np.ndarray]:
    head = bytes(data[:4])
    if head not in (b"PK\x03\x04", b"PK\x05\x06"):  # np.load would take anything else for an .npy or a pickle
        raise ValueError(f"not an .npz (zip) archive: {len(data)} bytes starting {bytes(data[:8])!r}")
    with npy_lock(), np.load(io.BytesIO(data), allow_pickle=allow_pickle) as z:  # each member's header too
        return {k: z[k] for k in z.files}


def _decode_torch(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _bytes(value: Any) -> bytes | memoryview | None:
    if isinstance(value, (bytes, memoryview)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
        return value.tobytes()  # vlen bytes stored as uint8 arrays
    return None


# suffixes whose values are encoded bytes: a 1-D uint8 array under another suffix (npy, npz, none known) is a
# value (an HDF5 field of kind "array", e.g. an embedding of shape (8,)), not bytes to decode
_ENCODED_SUFFIXES = IMAGE_SUFFIXES | INT_SUFFIXES | _TEXT_SUFFIXES | _JSON_SUFFIXES | PICKLE_SUFFIXES
# every suffix the default decoding treats specially (a decode= mapping shared by several datasets names some of
# these that a given dataset lacks)
DECODED_SUFFIXES = _ENCODED_SUFFIXES | {"npy", "npz"}


class SampleDecoder:
    """Decode the fields of a sample dict.

    Args:
        decode: True (default decoders), False (raw values), or a mapping from field name or
            suffix to a decoder ``bytes -> value`` (None: keep raw); unlisted fields use the
            defaults. A full field name wins over a suffix.
        allow_pickle: allow pickle/torch members and object arrays in npy (runs code from the
            shard: only for data you trust).
        draft_size: forwarded to image decoding (see :class:`ImageDecoder`).
        max_pixels: refuse images whose header claims more pixels (a ``DecodeError`` naming shard,
            key and field) before decoding them; None: Pillow's ``MAX_IMAGE_PIXELS`` rules only.
        images_as_pil: return default-decoded images as PIL images instead of tensors (for a
            transform that works on PIL images).
    """

    def __init__(
        self,
        decode: bool | Mapping[str, Decoder | None] = True,
        *,
        allow_pickle: bool = False,
        draft_size: int | None = None,
        images_as_pil: bool = False,
        max_pixels: int | None = None,
    ):
        if not isinstance(decode, (bool, Mapping)):
            raise TypeError(f"decode must be True, False or a mapping of field -> decoder, got {decode!r}")
        if isinstance(decode, Mapping):
            for name, fn in decode.items():
                if fn is not None and not callable(fn):
                    raise TypeError(f"decode[{name!r}] must be callable or None, got {fn!r}")
        for arg, value in (("allow_pickle", allow_pickle), ("images_as_pil", images_as_pil)):
            if not isinstance(value, bool):  # "false" from a config file is truthy: pickles would run their code
                raise ValueError(f"{arg} must be True or False, got {value!r}")
        self.decode = decode
        self.allow_pickle = allow_pickle
        self.image = ImageDecoder(draft_size=draft_size, max_pixels=max_pixels)
        self.images_as_pil = images_as_pil

    def __call__(self, sample: dict[str, Any], *, shard: str) -> dict[str, Any]:
        if self.decode is False:
            return sample
        key = sample.get("__key__", "?")
        out: dict[str, Any] = {}
        for name, value in sample.items():
            out[name] = value if name.startswith("__") else self.field(name, value, shard=shard, key=key)
        return out

    def field(self, name: str, value: Any, *, shard: str, key: str) -> Any:
        """Decode one field; errors become :class:`DecodeError` naming shard, key and field."""
        fn: Decoder | None | bool = True
        if isinstance(self.decode, Mapping):
            if name in self.decode:
                fn = self.decode[name]
            elif suffix(name) in self.decode:
                fn = self.decode[suffix(name)]
        if fn is None:
            return value
        try:
            if fn is True:
                return self._default(name, value, shard=shard, key=key)
            data = _bytes(value)
            return fn(data if data is not None else value)  # type: ignore[operator]
        except DecodeError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a decoder on shard bytes
            raise DecodeError(f"{shard}: sample {key!r} field {name!r}: {type(e).__name__}: {e}") from e

    def _default(self, name: str, value: Any, *, shard: str, key: str) -> Any:
        ext = suffix(name)
        data = None if isinstance(value, np.ndarray) and ext not in _ENCODED_SUFFIXES else _bytes(value)
        if data is None:  # already decoded (HDF5 arrays, ints)
            if ext in INT_SUFFIXES and isinstance(value, (np.integer, np.ndarray)) and np.ndim(value) == 0:
                return int(value)
            return value
        if ext in IMAGE_SUFFIXES:
            return self.image.pil(data) if self.images_as_pil else self.image(data)
        if ext == "npy":
            return _decode_npy(data, self.allow_pickle)
        if ext == "npz":
            return _decode_npz(data, self.allow_pickle)
        if ext in INT_SUFFIXES:
            return int(bytes(data).decode("utf-8").strip())
        if ext in _TEXT_SUFFIXES:
            return bytes(data).decode("utf-8")
        if ext in _JSON_SUFFIXES:
            return json.loads(bytes(data))
        if ext in PICKLE_SUFFIXES:
            if not self.allow_pickle:
                raise DecodeError(
                    f"{shard}: sample {key!r} field {name!r}: refusing to unpickle a shard member "
                    "(it could run arbitrary code); pass allow_pickle=True only for data you trust"
                )
            if ext in ("pth", "pt"):
                return _decode_torch(bytes(data))
            return pickle.loads(data)  # noqa: S301 - explicitly allowed by the user
        return bytes(data)
