"""Deterministic image transforms with fingerprints (what the preprocessing cache keys on).

A *deterministic* transform gives the same output for the same input every time, so its
output can be computed once and cached. It declares:

- ``fingerprint``: a string that changes whenever the output could change (class name,
  parameters, implementation version). The cache keys stores on it.
- ``target_size`` (optional): the shorter side the transform needs from its input; the
  decoder uses it to decode large JPEGs at a reduced scale (``Image.draft``).
- ``accepts_pil`` (optional): the transform takes a PIL image (faster) instead of a tensor.

Random augmentations (flips, random crops, colour jitter) are *not* deterministic: pass them
as ``ShardedDataset(transform=...)``, which is applied after the cache every epoch.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastdata.decode import image_to_tensor

__all__ = ["Deterministic", "ResizeCenterCrop"]

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


def _to_pil(img: Any) -> Image.Image:
    if isinstance(img, Image.Image):
        return img
    if isinstance(img, torch.Tensor):
        img = img.detach().cpu().numpy()
    if isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[0] in (1, 3):
        return Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))
    raise TypeError(f"expected a PIL image or a uint8 (C, H, W) tensor/array with C in (1, 3), got {type(img).__name__}"
                    + (f" of shape {tuple(img.shape)} and dtype {img.dtype}" if hasattr(img, "shape") else ""))


class ResizeCenterCrop:
    """Resize the shorter side to ``resize``, centre-crop ``size``; returns uint8 (C, H, W).

    Same geometry as ``torchvision`` ``Resize(resize)`` + ``CenterCrop(size)``, but only the
    crop box is resampled (``Image.resize(size, box=...)``), and with ``target_size`` the decoder
    may first reduce large JPEGs by 1/2, 1/4 or 1/8 (``Image.draft``). Together these are about
    1.6x faster than resizing the whole image (PERF_NOTES.md); pixel values differ from the
    torchvision recipe by interpolation rounding only.

    Args:
        size: output side, or ``(height, width)``.
        resize: shorter side before cropping; default ``round(min(size) * 256 / 224)``, at least
            ``max(size)`` (the crop must fit: no padding).
        interpolation: "bilinear" (default, antialiased like torchvision on PIL), "bicubic",
            "lanczos" or "nearest".
    """

    version = "1"
    accepts_pil = True

    def __init__(self, size: int | tuple[int, int], *, resize: int | None = None, interpolation: str = "bilinear"):
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size, size)
        if (not isinstance(size, tuple) or len(size) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in size)):
            raise ValueError(f"size must be an int >= 1 or a (height, width) tuple of them, got {size!r}")
        if resize is None:  # a non-square crop's longer side must fit in the shorter side too
            resize = max(round(min(size) * 256 / 224), max(size))
        if not isinstance(resize, int) or isinstance(resize, bool) or resize < max(size):
            raise ValueError(f"resize must be an int >= max(size)={max(size)}, got {resize!r}")
        if interpolation not in _RESAMPLE:
            raise ValueError(f"interpolation must be one of {sorted(_RESAMPLE)}, got {interpolation!r}")
        self.size: tuple[int, int] = size
        self.resize = resize
        self.interpolation = interpolation

    @property
    def target_size(self) -> int:
        """Shorter side needed from the input (for ``Image.draft``)."""
        return self.resize

    @property
    def fingerprint(self) -> str:
        h, w = self.size
        return f"ResizeCenterCrop(size=({h},{w}),resize={self.resize},interpolation={self.interpolation},v{self.version})"

    def crop_box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The crop box in input pixel coordinates for an input of ``width x height``."""
        short, long_ = (width, height) if width <= height else (height, width)
        new_long = int(self.resize * long_ / short)
        new_w, new_h = (self.resize, new_long) if width <= height else (new_long, self.resize)
        ch, cw = self.size
        top = int(round((new_h - ch) / 2.0))
        left = int(round((new_w - cw) / 2.0))
        sx, sy = width / new_w, height / new_h
        return (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)

    def __call__(self, img: Any) -> torch.Tensor:
        pil = _to_pil(img)
        h, w = self.size
        out = pil.resize((w, h), _RESAMPLE[self.interpolation], box=self.crop_box(*pil.size))
        return image_to_tensor(out)

    def __repr__(self) -> str:
        return f"ResizeCenterCrop(size={self.size}, resize={self.resize}, interpolation={self.interpolation!r})"


class Deterministic:
    """Declare a user function deterministic (cacheable) with an explicit version string.

    Change ``version`` whenever the function's output could change; the cache keys on
    ``name``, ``version``, ``target_size`` and ``accepts_pil``, never on the code.
    ``accepts_pil=True`` passes PIL images (decoded images are uint8 (C, H, W) tensors otherwise); ``target_size`` enables
    reduced-scale JPEG decoding for inputs at least twice that size.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        version: str,
        name: str | None = None,
        accepts_pil: bool = False,
        target_size: int | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if not isinstance(version, str) or not version.strip():
            raise ValueError(f"version must be a non-empty string, got {version!r}")
        if target_size is not None and (not isinstance(target_size, int) or isinstance(target_size, bool)
                                        or target_size < 1):
            raise ValueError(f"target_size must be an int >= 1 or None, got {target_size!r}")
        if name is not None and (not isinstance(name, str) or not name.strip()):  # it goes into the cache key
            raise ValueError(f"name must be a non-empty string or None, got {name!r}")
        if not isinstance(accepts_pil, bool):  # "no" is truthy: PIL images would be passed, and keyed as such
            raise ValueError(f"accepts_pil must be True or False, got {accepts_pil!r}")
        self.fn = fn
        self.version = version
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.accepts_pil = accepts_pil
        self.target_size = target_size

    @property
    def fingerprint(self) -> str:
        # target_size changes the input (reduced-scale JPEG decoding), accepts_pil its type: both are
        # keyed (added only when set, so stores made without them keep their keys)
        extra = (f",target_size={self.target_size}" if self.target_size is not None else "") + (
            ",accepts_pil" if self.accepts_pil else "")
        return f"Deterministic(name={self.name},version={self.version}{extra})"

    def __call__(self, x: Any) -> Any:
        return self.fn(x)

    def __repr__(self) -> str:
        return f"Deterministic({self.name!r}, version={self.version!r})"
