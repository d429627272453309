"""Device-side batch transforms: uint8 -> float32/bfloat16/float16 with per-channel normalisation,
dtype conversion and channels_last.

Each transform is a callable ``batch -> batch`` over nested batches (dicts, lists, tuples,
namedtuples, dataclasses). Give one to ``CUDAPrefetcher(transform=...)`` and it runs on the copy
stream right after the host-to-device copy, so images travel as uint8 (a quarter of the bytes of
float32) and are normalised on the GPU. They are plain torch ops and work on CPU tensors as well.

Which tensors are transformed: those whose path contains one of ``keys`` (dict keys, field names,
indices), or with ``keys=None`` every image-like tensor: uint8 with at least 3 dimensions (for
``Normalize`` also with ``len(mean)`` channels at ``channel_dim``, and 3-D only where the batch holds
no uint8 tensor of 4 or more dimensions: beside a batch of images, an ``(N, H, W)`` tensor is a stack
of masks, whatever ``N``; for ``ChannelsLast`` any 4-D or 5-D tensor). ``keys`` under which no tensor
sits, images left in an ``ImageBatch`` of several sizes, and ``Normalize()`` over a batch whose only
images it cannot take (floating-point ones, as after torchvision's order ``ToDtype(float32,
scale=True)``, integer ones wider than 8 bits, or a channel count other than ``len(mean)``) are a
``ValueError`` rather than a batch passed on untouched.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdata.dataset import PackedImages
from fastdata.gpu._augment import ImageBatch, render_images
from fastdata.prefetch.tree import (
    Path,
    format_path,
    keys_matcher,
    map_tensors,
    tensor_leaves,
)

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "ChannelsLast", "Compose", "Normalize", "ToDtype"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_keys(owner: str, keys: Any) -> tuple[Any, ...] | None:
    if keys is None:
        return None
    if isinstance(keys, (str, int)):
        keys = (keys,)
    try:
        if isinstance(keys, (bytes, bytearray)):  # not a sequence of keys: its items are ints
            raise TypeError
        keys = tuple(keys)
    except TypeError:
        raise ValueError(f"{owner}: keys must be None, a key or a sequence of keys, got {keys!r}") from None
    if not keys or any(isinstance(k, bool) or not isinstance(k, (str, int)) for k in keys):
        raise ValueError(f"{owner}: keys must be a non-empty sequence of str/int keys, got {keys!r}")
    return keys


def _check_dtype(owner: str, dtype: Any) -> None:
    if dtype not in _FLOAT_DTYPES:
        names = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"{owner}: dtype must be one of {names}, got {dtype!r}")


def _memory_format(x: torch.Tensor, path: Path, owner: str) -> torch.memory_format:
    if x.dim() == 4:
        return torch.channels_last
    if x.dim() == 5:
        return torch.channels_last_3d
    raise ValueError(f"{owner}: channels_last needs a 4-D or 5-D tensor, {format_path(path)} has shape {tuple(x.shape)}")


def _scale_of(x: torch.Tensor, path: Path, owner: str) -> float:
    if x.dtype == torch.uint8:
        return 255.0
    if x.dtype.is_floating_point:
        return 1.0
    raise ValueError(f"{owner}: {format_path(path)} has dtype {x.dtype}; expected uint8 or a floating dtype")


@dataclass(frozen=True)
class Normalize:
    """``(x / 255 - mean) / std`` per channel for uint8 images (float inputs are not divided by 255).

    ``mean``/``std`` are on the [0, 1] scale (torchvision convention), one value per channel or a single
    value for all. One fused kernel (``addcmul``) reads the uint8 input, computes in float32 and
    stores ``dtype``; with ``channels_last`` it writes straight into a channels_last tensor.
    """

    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    keys: Sequence[str | int] | None = None
    channel_dim: int = -3
    _consts: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            value = getattr(self, name)
            try:  # b"x" iterates as (120,) and "5" as ("5",); True would be 1.0
                items = tuple(value)
                if isinstance(value, (str, bytes, bytearray)) or any(isinstance(v, bool) for v in items):
                    raise TypeError(name)
                values = tuple(float(v) for v in items)
            except (TypeError, ValueError):
                raise ValueError(f"Normalize: {name} must be a sequence of numbers, got {value!r}") from None
            if not values or not all(math.isfinite(v) for v in values):
                raise ValueError(f"Normalize: {name} must be non-empty and finite, got {value!r}")
            object.__setattr__(self, name, values)
        if len(self.mean) != len(self.std):
            raise ValueError(f"Normalize: mean and std differ in length: {self.mean!r} vs {self.std!r}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"Normalize: std must be > 0, got {self.std!r}")
        _check_dtype("Normalize", self.dtype)
        if not isinstance(self.channels_last, bool):
            raise ValueError(f"Normalize: channels_last must be a bool, got {self.channels_last!r}")
        if isinstance(self.channel_dim, bool) or not isinstance(self.channel_dim, int):
            raise ValueError(f"Normalize: channel_dim must be an int, got {self.channel_dim!r}")
        object.__setattr__(self, "keys", _check_keys("Normalize", self.keys))

    def __call__(self, batch: Any) -> Any:
        if self.keys is not None:
            return _apply(batch, self.keys, self._selected, self.apply, "Normalize")
        leaves = tensor_leaves(batch)
        images = any(x.dtype == torch.uint8 and x.dim() >= 4 for _, x in leaves)
        # in a batch of images, 3-D uint8 tensors are (N, H, W) masks, even where N == len(mean)
        chosen = {id(x) for _, x in leaves if self._selected(x) and (x.dim() >= 4 or not images)}
        if not chosen and not _image_batch_paths(batch, ()):  # nothing to do: say so where images show
            self._refuse_unselected_images(leaves)            # that the user meant them
            for path in _packed_paths(batch, ()):  # Compose(Normalize(), DecodeImages(), ...): still encoded
                raise ValueError(f"Normalize: {format_path(path)} holds encoded images (PackedImages); decode them "
                                 "first: put DecodeImages before Normalize in the Compose")
        return _apply(batch, None, lambda x: id(x) in chosen, self.apply, "Normalize")

    def _refuse_unselected_images(self, leaves: list[tuple[Path, torch.Tensor]]) -> None:
        """Images Normalize() would pass on untouched: torchvision's order (``ToDtype(float32, scale=True)``
        first) left floats unnormalised, and greyscale images with ImageNet's 3-value mean stayed uint8."""
        for path, x in leaves:
            if x.dtype == torch.uint8 and x.dim() >= 4 and -x.dim() <= self.channel_dim < x.dim():
                raise ValueError(
                    f"Normalize: {format_path(path)} has shape {tuple(x.shape)}: {x.shape[self.channel_dim]} channels "
                    f"at dim {self.channel_dim}, but mean/std have {len(self.mean)} values; give mean/std one value "
                    "per channel (or one for all), or name the images in keys=")
        for path, x in leaves:
            if (x.dtype.is_floating_point and x.dim() >= 4 and -x.dim() <= self.channel_dim < x.dim()
                    and (len(self.mean) == 1 or x.shape[self.channel_dim] == len(self.mean))):
                raise ValueError(
                    f"Normalize: the batch holds no uint8 images, but {format_path(path)} is a {x.dtype} batch of "
                    f"shape {tuple(x.shape)}; without keys, Normalize takes uint8 images ((x / 255 - mean) / std): "
                    "put it before ToDtype, or name the tensor in keys= to normalise floats as (x - mean) / std")
        for path, x in leaves:  # 16-bit images (torchvision.io.decode_image of a 16-bit PNG): no scale known here
            if (not x.dtype.is_floating_point and x.dtype not in (torch.uint8, torch.bool) and x.dim() >= 4
                    and -x.dim() <= self.channel_dim < x.dim()
                    and (len(self.mean) == 1 or x.shape[self.channel_dim] == len(self.mean))):
                raise ValueError(
                    f"Normalize: {format_path(path)} is a {x.dtype} batch of shape {tuple(x.shape)}; Normalize takes "
                    "uint8 images ((x / 255 - mean) / std), or floats named in keys=: convert it first (16-bit "
                    "images: (x.int() >> 8).to(torch.uint8), or to floats in [0, 1])")

    def _selected(self, x: torch.Tensor) -> bool:
        if x.dtype != torch.uint8 or x.dim() < 3 or not -x.dim() <= self.channel_dim < x.dim():
            return False  # a mask with fewer dimensions than channel_dim needs is no image
        return len(self.mean) == 1 or x.shape[self.channel_dim] == len(self.mean)

    def apply(self, x: torch.Tensor, path: Path = ()) -> torch.Tensor:
        """Normalise one tensor."""
        if x.dim() < 1 or not -x.dim() <= self.channel_dim < x.dim():
            raise ValueError(f"Normalize: channel_dim {self.channel_dim} out of range for {format_path(path)} of shape {tuple(x.shape)}")
        channels = len(self.mean)
        if channels != 1 and x.shape[self.channel_dim] != channels:
            raise ValueError(
                f"Normalize: {format_path(path)} has shape {tuple(x.shape)}, expected {channels} channels "
                f"at dim {self.channel_dim}"
            )
        scale, bias = self._constants(x, _scale_of(x, path, "Normalize"))
        fmt = _memory_format(x, path, "Normalize") if self.channels_last else torch.contiguous_format
        out = torch.empty(x.shape, dtype=self.dtype, device=x.device, memory_format=fmt)
        torch.addcmul(bias, x, scale, out=out)  # computed in float32, cast on store: one pass
        return out

    def _constants(self, x: torch.Tensor, input_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel ``1 / (s * std)`` and ``-mean / std``, shaped to broadcast, cached per device."""
        key = (x.device, x.dim(), input_scale)
        cached = self._consts.get(key)
        if cached is None:
            shape = [1] * x.dim()
            shape[self.channel_dim] = len(self.mean)
            scale = torch.tensor([1.0 / (input_scale * s) for s in self.std], dtype=torch.float32)
            bias = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], dtype=torch.float32)
            cached = (scale.view(shape).to(x.device), bias.view(shape).to(x.device))
            self._consts[key] = cached
        return cached


@dataclass(frozen=True)
class ToDtype:
    """Cast selected tensors to a floating ``dtype``; with ``scale=True`` uint8 is divided by 255."""

    dtype: torch.dtype = torch.float32
    scale: bool = False
    keys: Sequence[str | int] | None = None

    def __post_init__(self) -> None:
        _check_dtype("ToDtype", self.dtype)
        if not isinstance(self.scale, bool):
            raise ValueError(f"ToDtype: scale must be a bool, got {self.scale!r}")
        object.__setattr__(self, "keys", _check_keys("ToDtype", self.keys))

    def __call__(self, batch: Any) -> Any:
        return _apply(batch, self.keys, _image_like, self.apply, "ToDtype")

    def apply(self, x: torch.Tensor, path: Path = ()) -> torch.Tensor:
        """Cast one tensor (``path`` names it in errors)."""
        if not self.scale:
            return x.to(self.dtype)
        factor = _scale_of(x, path, "ToDtype")
        if factor == 1.0:
            return x.to(self.dtype)
        out = torch.empty_like(x, dtype=self.dtype)
        torch.mul(x, 1.0 / factor, out=out)  # computed in float32, cast on store: one pass
        return out


@dataclass(frozen=True)
class ChannelsLast:
    """Make selected 4-D (5-D) tensors channels_last (channels_last_3d); values are unchanged."""

    keys: Sequence[str | int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", _check_keys("ChannelsLast", self.keys))

    def __call__(self, batch: Any) -> Any:
        return _apply(batch, self.keys, lambda x: x.dim() in (4, 5), self.apply, "ChannelsLast")

    def apply(self, x: torch.Tensor, path: Path = ()) -> torch.Tensor:
        """One tensor in channels_last (4-D) or channels_last_3d (5-D) memory format."""
        return x.contiguous(memory_format=_memory_format(x, path, "ChannelsLast"))


class Compose:
    """Apply batch transforms in order.

    Consecutive geometric transforms (``RandomResizedCrop``, ``RandomHorizontalFlip``, ``Resize``,
    ``CenterCrop``) are fused: each only records its geometry on the batch's
    :class:`~fastdata.gpu.ImageBatch` es, which are resampled once, right before the next other
    transform and at the end (ImageBatches whose images end in different sizes stay ImageBatches).
    ``DecodeImages`` followed by geometric transforms runs as one step (:meth:`DecodeImages.fuse`),
    so that decoding and resampling overlap, unless an earlier ``DecodeImages`` of this Compose (with
    other ``keys``) left ImageBatches pending: the transforms then apply to those too.
    """

    def __init__(self, *transforms: Callable[[Any], Any]) -> None:
        for i, t in enumerate(transforms):
            if not callable(t):
                raise ValueError(f"Compose: transform {i} is not callable: {t!r}")
        self.transforms = transforms

    def __call__(self, batch: Any) -> Any:
        ts, i = self.transforms, 0
        given = set(_image_batch_paths(batch, ()))  # ImageBatches of the input (a fused stage leaves them alone)
        while i < len(ts):
            fuse = getattr(ts[i], "fuse", None)  # DecodeImages: decode and resample chunk by chunk
            if fuse is not None:
                j = i + 1
                while j < len(ts) and getattr(ts[j], "lazy", None) is not None:
                    j += 1
                if j > i + 1 and set(_image_batch_paths(batch, ())) - given:  # images an earlier stage decoded are
                    batch, i = ts[i](batch), i + 1  # pending: the geometric transforms that follow apply to them too
                    continue
                batch, i = fuse(render_images(batch), ts[i + 1 : j]), j
                continue
            lazy = getattr(ts[i], "lazy", None)
            batch = lazy(batch) if lazy is not None else ts[i](render_images(batch))
            i += 1
        return render_images(batch)

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.transforms))})"


def _image_like(x: torch.Tensor) -> bool:
    return x.dtype == torch.uint8 and x.dim() >= 3


def _apply(
    batch: Any,
    keys: Sequence[Any] | None,
    default: Callable[[torch.Tensor], bool],
    fn: Callable[[torch.Tensor, Path], torch.Tensor],
    owner: str,
) -> Any:
    """``batch`` with ``fn`` applied to the tensors ``keys`` select (None: those ``default`` picks).

    Never a silent no-op: keys under which no tensor sits, and images still in an :class:`ImageBatch`
    (several sizes: nothing to apply a tensor op to) are errors naming them.
    """
    matches = keys_matcher(keys)
    for path in _image_batch_paths(batch, ()):
        if matches is None or matches(path):
            raise ValueError(f"{owner}: {format_path(path)} holds images of different sizes (an ImageBatch); give "
                             "them one size first, e.g. RandomResizedCrop(n), CenterCrop(n) or Resize((h, w))")
    if matches is None:
        return map_tensors(batch, lambda x, p: fn(x, p) if default(x) else x)
    hits = 0

    def leaf(x: torch.Tensor, p: Path) -> torch.Tensor:
        nonlocal hits
        if not matches(p):
            return x
        hits += 1
        return fn(x, p)

    out = map_tensors(batch, leaf)
    if not hits:
        have = f"keys {list(batch)}" if isinstance(batch, dict) else f"a {type(batch).__name__}"
        raise ValueError(f"{owner}: no tensor of the batch is under keys {list(keys or ())}; the batch has {have}")
    return out


def _packed_paths(obj: Any, path: Path) -> list[Path]:
    """Paths of the PackedImages (encoded images) in dicts, lists and tuples of ``obj``."""
    if isinstance(obj, PackedImages):
        return [path] if len(obj) else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _packed_paths(v, (*path, k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) if not isinstance(v, (torch.Tensor, str, int, float))
                for p in _packed_paths(v, (*path, i))]
    return []


def _image_batch_paths(obj: Any, path: Path) -> list[Path]:
    """Paths of the non-empty ImageBatch leaves in dicts, lists and tuples of ``obj`` (cheap: stops at
    tensors). An empty one (every sample of the batch skipped by ``DecodeImages(on_error="skip")``) has no
    size to render to and nothing to transform: it passes."""
    if isinstance(obj, ImageBatch):
        return [path] if len(obj) else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() if not isinstance(v, (torch.Tensor, str))
                for p in _image_batch_paths(v, (*path, k))]
    if isinstance(obj, (list, tuple)):  # every item: ("tag", images) hides nothing behind its first one
        return [p for i, v in enumerate(obj) if not isinstance(v, (torch.Tensor, str, int, float))
                for p in _image_batch_paths(v, (*path, i))]
    return []
