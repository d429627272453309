"""CPU image transforms: deterministic ones with fingerprints (what the preprocessing cache keys on),
and seeded random ones that a resumed epoch repeats exactly.

A *deterministic* transform gives the same output for the same input every time, so its output can
be computed once and cached. It declares ``fingerprint`` (changes whenever the output could change;
the cache keys stores on it), optionally ``target_size`` (the shorter side it needs: large JPEGs are
decoded at a reduced scale) and ``accepts_pil`` (it takes a PIL image instead of a tensor).

Random augmentations go to ``ShardedDataset(transform=...)``, applied after the cache every epoch. A
transform with a ``generator`` parameter is called with a :class:`SampleGenerator`: a
``torch.Generator`` seeded by (dataset seed, epoch, sample index), so its draws, and the pixels, are
the same in a resumed epoch, on every loader path and at any worker count. ``RandomResizedCrop`` and
``RandomHorizontalFlip`` here draw from the same counter-based hash of (seed, epoch, sample index) as
their ``fastdata.gpu`` namesakes (one parameter function each, shared with them). See
docs/guide/resume-contract.md.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastdata._rng import rng_key, uniforms
from fastdata.decode import image_to_tensor

__all__ = ["Compose", "Deterministic", "RandomHorizontalFlip", "RandomResizedCrop", "ResizeCenterCrop",
           "SampleGenerator", "accepts_generator", "sample_generator"]

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


# ---------------------------------------------------------------------------------------------
# Seeded random transforms

CROP_SALT = 0x52524331  # the hash streams of RandomResizedCrop and RandomHorizontalFlip (CPU and GPU alike)
FLIP_SALT = 0x48464C50
GENERATOR_SALT = 0x53474E31  # the stream of the generator ShardedDataset passes to a transform


class SampleGenerator(torch.Generator):
    """A CPU ``torch.Generator`` seeded by (seed, epoch, sample index), made by :func:`sample_generator`.

    ``ShardedDataset`` passes one as ``generator=`` to a ``transform`` (or ``sample_transform``) that
    has a ``generator`` parameter: ``torch.rand((), generator=generator)`` then gives a sample the same
    draws in every run, whichever process, thread or loader path loads it. ``epoch`` and ``index``
    (the sample's global index) name the sample; the random transforms of this module draw their
    parameters from them (the hash their ``fastdata.gpu`` namesakes use) rather than from the stream.
    """

    epoch: int
    index: int


def sample_generator(seed: int, epoch: int, index: int) -> SampleGenerator:
    """The :class:`SampleGenerator` of sample ``index`` in ``epoch`` under the dataset's ``seed``."""
    g = SampleGenerator()
    g.manual_seed(rng_key(seed, GENERATOR_SALT, epoch, index))
    g.epoch, g.index = int(epoch), int(index)
    return g


def accepts_generator(fn: Any) -> bool:
    """Whether ``fn`` has a parameter named ``generator`` (then fastdata passes it a SampleGenerator)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    p = params.get("generator")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def check_size(owner: str, size: Any, *, allow_int_short: bool = False) -> tuple[int, int] | int:
    """``size`` as (height, width) (an int: square, or with ``allow_int_short`` the shorter side)."""
    if isinstance(size, bool):  # ValueError for every bad option value, like fastdata.gpu.Normalize
        raise ValueError(f"{owner}: size must be an int or (height, width), got {size!r}")  # noqa: TRY004
    if isinstance(size, int):
        if size < 1:
            raise ValueError(f"{owner}: size must be >= 1, got {size!r}")
        return size if allow_int_short else (size, size)
    try:
        h, w = size
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: size must be an int or (height, width), got {size!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (h, w)):
        raise ValueError(f"{owner}: size must be positive ints, got {size!r}")
    return (h, w)


def check_range(owner: str, name: str, value: Any, *, positive: bool) -> tuple[float, float]:
    """A (min, max) pair of finite numbers, min >= 0 (> 0 with ``positive``)."""
    try:
        if isinstance(value, (str, bytes)) or any(isinstance(v, (str, bytes)) for v in value):
            raise TypeError(name)  # "01" or ("0.1", "1") would pass float()
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: {name} must be a (min, max) pair of numbers, got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi or (positive and lo <= 0) or lo < 0:
        raise ValueError(f"{owner}: {name} must be finite with 0 {'<' if positive else '<='} min <= max, got {value!r}")
    return lo, hi


def check_seed(owner: str, seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{owner}: seed must be an int, got {seed!r}")  # noqa: TRY004
    return seed


def check_probability(owner: str, p: Any) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{owner}: p must be a number in [0, 1], got {p!r}")
    return float(p)


def crop_params(u: np.ndarray, heights: Any, widths: Any, scale: tuple[float, float],
                ratio: tuple[float, float]) -> tuple[np.ndarray, ...]:
    """``(top, left, height, width)`` int arrays of ``RandomResizedCrop`` for images of the given sizes,
    from ``u``: 40 uniforms per image. ``torchvision.transforms.RandomResizedCrop.get_params``'s
    semantics: up to ten tries of an area fraction uniform in ``scale`` and a log-uniform aspect ratio
    in ``ratio``, else a central crop clamped to ``ratio`` (at least one pixel)."""
    H, W = np.asarray(heights, np.float64).reshape(-1), np.asarray(widths, np.float64).reshape(-1)
    u = np.asarray(u, np.float64).reshape(len(H), 10, 4)
    lr0, lr1 = math.log(ratio[0]), math.log(ratio[1])
    target = (H * W)[:, None] * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    aspect = np.exp(lr0 + (lr1 - lr0) * u[..., 1])
    w = np.round(np.sqrt(target * aspect))
    h = np.round(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= W[:, None]) & (h > 0) & (h <= H[:, None])
    first = np.argmax(ok, axis=1)
    rows = np.arange(len(H))
    hit = ok[rows, first]
    h, w = h[rows, first], w[rows, first]
    top = np.minimum(np.floor(u[rows, first, 2] * (H - h + 1)), H - h)
    left = np.minimum(np.floor(u[rows, first, 3] * (W - w + 1)), W - w)
    # torchvision's fallback: a central crop with the aspect ratio clamped to ``ratio``, at least a pixel
    # (torchvision's rounds to 0 where a side is 1 and ``ratio`` far from 1: it fails; this gave a black image)
    in_ratio = W / H
    fw = np.where(in_ratio < ratio[0], W, np.where(in_ratio > ratio[1], np.maximum(np.round(H * ratio[1]), 1), W))
    fh = np.where(in_ratio < ratio[0], np.maximum(np.round(W / ratio[0]), 1), H)
    h, w = np.where(hit, h, fh), np.where(hit, w, fw)
    top = np.where(hit, top, (H - h) // 2)
    left = np.where(hit, left, (W - w) // 2)
    return top.astype(np.int64), left.astype(np.int64), h.astype(np.int64), w.astype(np.int64)


def _draws(salt: int, seed: int, k: int, generator: torch.Generator | None) -> np.ndarray:
    """``k`` uniforms for one image: from the hash of (seed, epoch, sample) for a SampleGenerator (the
    GPU transforms' draws), else from ``generator`` (None: torch's global generator)."""
    if isinstance(generator, SampleGenerator):
        return uniforms(seed, salt, generator.epoch, np.array([generator.index]), k)[0]
    return torch.rand(k, generator=generator, dtype=torch.float64).numpy()


def _as_tensor(img: Any) -> torch.Tensor:
    if isinstance(img, torch.Tensor):
        return img
    return image_to_tensor(_to_pil(img))


class RandomHorizontalFlip:
    """Mirror an image (uint8 ``(C, H, W)`` tensor, or a PIL image) with probability ``p``.

    Called by ``ShardedDataset(transform=...)`` with a :class:`SampleGenerator`, the decision is
    ``fastdata.gpu.RandomHorizontalFlip(p, seed=seed)``'s for that sample and epoch; called with
    another ``torch.Generator`` (or none: torch's global one) it draws from that.
    """

    def __init__(self, p: float = 0.5, *, seed: int = 0) -> None:
        self.p = check_probability("RandomHorizontalFlip", p)
        self.seed = check_seed("RandomHorizontalFlip", seed)

    def __call__(self, img: Any, generator: torch.Generator | None = None) -> Any:
        if not _draws(FLIP_SALT, self.seed, 1, generator)[0] < self.p:
            return img
        if isinstance(img, Image.Image):
            return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _as_tensor(img).flip(-1)  # out of place: cached tensors are read-only

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p}, seed={self.seed})"


class RandomResizedCrop:
    """Crop a random area and aspect ratio of a uint8 ``(C, H, W)`` image, resize it to ``size``.

    torchvision's semantics (``transforms.RandomResizedCrop``: the parameters of :func:`crop_params`,
    antialiased bilinear resampling). Called by ``ShardedDataset(transform=...)`` with a
    :class:`SampleGenerator`, the crop is ``fastdata.gpu.RandomResizedCrop(size, scale, ratio,
    seed=seed)``'s for that sample and epoch; with another ``torch.Generator`` (or none) it draws from that.
    """

    def __init__(self, size: int | tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0), *, seed: int = 0) -> None:
        self.size: tuple[int, int] = check_size("RandomResizedCrop", size)  # type: ignore[assignment]
        self.scale = check_range("RandomResizedCrop", "scale", scale, positive=False)
        self.ratio = check_range("RandomResizedCrop", "ratio", ratio, positive=True)
        self.seed = check_seed("RandomResizedCrop", seed)

    def __call__(self, img: Any, generator: torch.Generator | None = None) -> torch.Tensor:
        # torchvision is a dependency, imported where used (import fastdata stays cheap)
        from torchvision.transforms.v2 import functional as tvf

        x = _as_tensor(img)
        if x.dim() != 3:
            raise ValueError(f"RandomResizedCrop: expected a (C, H, W) image, got shape {tuple(x.shape)}")
        top, left, h, w = (int(v[0]) for v in crop_params(_draws(CROP_SALT, self.seed, 40, generator),
                                                           x.shape[1], x.shape[2], self.scale, self.ratio))
        return tvf.resized_crop(x, top, left, h, w, list(self.size), antialias=True)

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, seed={self.seed})"


class Compose:
    """Apply ``transforms`` in order, passing ``generator`` on to each that has that parameter."""

    def __init__(self, transforms: Sequence[Callable[..., Any]]) -> None:
        self.transforms = list(transforms)
        bad = [t for t in self.transforms if not callable(t)]
        if bad:
            raise ValueError(f"Compose: every transform must be callable, got {bad[0]!r}")
        self._takes = [accepts_generator(t) for t in self.transforms]

    def __call__(self, img: Any, generator: torch.Generator | None = None) -> Any:
        for t, takes in zip(self.transforms, self._takes):
            img = t(img, generator=generator) if takes else t(img)
        return img

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"
