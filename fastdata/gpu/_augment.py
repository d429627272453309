"""Batched geometric augmentation with torchvision semantics, on CPU or CUDA tensors.

``RandomResizedCrop``, ``RandomHorizontalFlip``, ``Resize`` and ``CenterCrop`` act on an
:class:`ImageBatch` (the images of a batch, each of its own size, as ``DecodeImages`` returns them)
by updating a *pending geometry* per image on the host: no device work. The pixels are resampled
once, when the batch is *rendered* into one uint8 tensor ``(N, C, H, W)``, so a chain of transforms
costs one resampling and nothing is rounded in between.

Invariants:
- Results match torchvision's for the usual chains (crop then resize, resize then crop, padding);
  resampling is antialiased bilinear (``interpolate(..., antialias=True)``'s filter).
- A render has no resampling launch per image: images are grouped by size and each group is
  resampled with two batched matrix products over a zero-padded canvas (float16 on CUDA).
- A batch is reproduced bit for bit; the same image in another batch may differ by one grey level.
- Random parameters come from a counter-based hash of ``(seed, epoch, sample index)`` on the host:
  a sample gets the same crop and flip in a resumed run, in any batch, worker count or device.

Design note (the geometry model, the filter, grouping and launches): docs/design/gpu-augment.md.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastdata._rng import uniforms
from fastdata.prefetch.tree import tensor_leaves
from fastdata.transforms import (
    CROP_SALT,
    FLIP_SALT,
    check_probability,
    check_range,
    check_seed,
    check_size,
    crop_params,
)

__all__ = [
    "CenterCrop", "ImageBatch", "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "render_images",
]

MAX_CANVAS = 1 << 28  # elements per resampling group: 512 MiB of float16 on CUDA (2 groups for 256 images of 640 px)
_WASTE = 3.0  # a group's padded canvas may hold up to this many times its images' pixels (fewer groups, fewer launches)
_WEIGHTS_SLACK = 1 << 22  # weight elements a run of groups may waste on padding whatever the ratio (fewer launches)


# ---------------------------------------------------------------------------------------------
# The ragged batch and its pending geometry


class ImageBatch:
    """Images of possibly different sizes on one device, with a pending crop/resize/flip each.

    Attributes:
        images: ``(C, H, W)`` uint8 tensors (same ``C``, same device).
        ids: int64 array, each image's sample identity (global index) for random parameters.
        epoch: the epoch of the batch (random parameters differ per epoch).
        geom: float64 ``(n, 4)``: ``ay, by, ax, bx`` (see the module docstring).
        clip: int64 ``(n, 4)``: source rows ``[y0, y1)`` and columns ``[x0, x1)`` the filter may read.
        frame: int64 ``(n, 4)``: the rows and columns (around ``clip``) it reads as pixels: zeros outside
            ``clip`` (a padding crop's).
        window: float64 ``(n, 4)``: the source region ``y0, y1, x0, x1`` the view shows; output pixels
            whose centre falls outside it are 0 (padding).
        size: int64 ``(n, 2)``: the (virtual) output height and width of each image.
    """

    __slots__ = ("clip", "epoch", "frame", "geom", "ids", "images", "size", "window")

    def __init__(self, images: Sequence[torch.Tensor], ids: Any, epoch: int, *, geom: np.ndarray | None = None,
                 clip: np.ndarray | None = None, size: np.ndarray | None = None,
                 frame: np.ndarray | None = None, window: np.ndarray | None = None) -> None:
        self.images = list(images)
        self.ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.epoch = int(epoch)
        n = len(self.images)
        if len(self.ids) != n:
            raise ValueError(f"ImageBatch: {len(self.ids)} ids for {n} images")
        shapes = []
        for i, im in enumerate(self.images):
            if not isinstance(im, torch.Tensor) or im.dtype != torch.uint8 or im.dim() != 3:
                raise ValueError(f"ImageBatch: image {i} must be a uint8 (C, H, W) tensor, got "
                                 f"{getattr(im, 'dtype', type(im).__name__)} {tuple(getattr(im, 'shape', ()))}")
            if im.shape[1] < 1 or im.shape[2] < 1:  # nothing to crop or resample (a resize fails deep in torch)
                raise ValueError(f"ImageBatch: image {i} is empty: shape {tuple(im.shape)}")
            shapes.append(im.shape)
        if len({s[0] for s in shapes}) > 1 or len({im.device for im in self.images}) > 1:
            raise ValueError(f"ImageBatch: images differ in channels or device: "
                             f"{sorted({(s[0], str(im.device)) for s, im in zip(shapes, self.images)})}")
        hw = np.array([s[1:] for s in shapes], dtype=np.int64).reshape(n, 2)
        self.geom = geom if geom is not None else np.tile(np.array([1.0, 0.0, 1.0, 0.0]), (n, 1))
        self.clip = clip if clip is not None else np.stack([np.zeros(n, np.int64), hw[:, 0],
                                                            np.zeros(n, np.int64), hw[:, 1]], axis=1)
        self.size = size if size is not None else hw
        self.frame = frame if frame is not None else self.clip.copy()
        self.window = window if window is not None else self.frame.astype(np.float64)

    @classmethod
    def from_tensor(cls, x: torch.Tensor, ids: Any, epoch: int) -> ImageBatch:
        """An ``(N, C, H, W)`` uint8 batch as an ImageBatch (e.g. images decoded elsewhere)."""
        if x.dim() != 4:
            raise ValueError(f"ImageBatch.from_tensor: expected (N, C, H, W), got {tuple(x.shape)}")
        return cls(list(x.unbind(0)), ids, epoch)

    def __len__(self) -> int:
        return len(self.images)

    def __fastdata_tensors__(self) -> list[torch.Tensor]:
        """The images: ``CUDAPrefetcher`` protects their memory for the consumer's stream when a
        device transform leaves a ragged batch (``fastdata.prefetch.tree.HOLDS_TENSORS``)."""
        return self.images

    @property
    def device(self) -> torch.device | None:
        return self.images[0].device if self.images else None

    def uniform_size(self) -> tuple[int, int] | None:
        """The common output size, or None while images would come out in different sizes."""
        if len(self) == 0:
            return None
        h, w = self.size[0]
        return (int(h), int(w)) if bool(np.all(self.size == self.size[0])) else None

    def _with(self, geom: np.ndarray, clip: np.ndarray, size: np.ndarray, images: list | None = None,
              ids: np.ndarray | None = None, frame: np.ndarray | None = None,
              window: np.ndarray | None = None) -> ImageBatch:
        """A batch with new geometry (no re-validation of images already checked)."""
        out = ImageBatch.__new__(ImageBatch)
        out.images = self.images if images is None else images
        out.ids = self.ids if ids is None else ids
        out.epoch, out.geom, out.clip, out.size = self.epoch, geom, clip, size
        out.frame = self.frame if frame is None else frame
        out.window = self.window if window is None else window
        return out

    def select(self, keep: Sequence[int]) -> ImageBatch:
        """The images at positions ``keep``, with their geometry."""
        k = np.asarray(keep, dtype=np.int64)
        return self._with(self.geom[k], self.clip[k], self.size[k], [self.images[i] for i in k.tolist()], self.ids[k],
                          self.frame[k], self.window[k])

    # ----- geometry (host only) --------------------------------------------------------------
    def crop(self, top: np.ndarray, left: np.ndarray, height: np.ndarray, width: np.ndarray,
             out_size: tuple[int, int] | None = None) -> ImageBatch:
        """Crop each image's current view to ``[top, top + height) x [left, left + width)`` and
        resize the crop to ``out_size`` (default: the crop's size)."""
        top, left = np.asarray(top, np.float64), np.asarray(left, np.float64)
        height, width = np.asarray(height, np.int64), np.asarray(width, np.int64)
        oh = height if out_size is None else np.full(len(self), out_size[0], np.int64)
        ow = width if out_size is None else np.full(len(self), out_size[1], np.int64)
        geom, clip, frame, window = self.geom.copy(), self.clip.copy(), self.frame.copy(), self.window.copy()
        for axis, start, length, out in ((0, top, height, oh), (1, left, width, ow)):
            a, b = geom[:, 2 * axis], geom[:, 2 * axis + 1]
            plain = np.abs(a) == 1.0  # no resampling pending: the filter sees only the crop (and its padding)
            ends = np.stack([a * start + b, a * (start + length) + b])
            lo, hi = np.floor(ends.min(0) + 1e-9).astype(np.int64), np.ceil(ends.max(0) - 1e-9).astype(np.int64)
            c = clip[:, 2 * axis : 2 * axis + 2]
            c[:, 0] = np.where(plain, np.minimum(np.maximum(c[:, 0], lo), hi), c[:, 0])
            c[:, 1] = np.where(plain, np.maximum(np.minimum(c[:, 1], hi), c[:, 0]), c[:, 1])
            f = frame[:, 2 * axis : 2 * axis + 2]
            f[:, 0] = np.where(plain, lo, f[:, 0])
            f[:, 1] = np.where(plain, hi, f[:, 1])
            v = window[:, 2 * axis : 2 * axis + 2]
            v[:, 0] = np.where(plain, lo, np.maximum(v[:, 0], ends.min(0)))
            v[:, 1] = np.where(plain, hi, np.minimum(v[:, 1], ends.max(0)))
            geom[:, 2 * axis + 1] = b + a * start
            geom[:, 2 * axis] = a * length / out
        return self._with(geom, clip, np.stack([oh, ow], axis=1), frame=frame, window=window)

    def resize(self, height: np.ndarray, width: np.ndarray) -> ImageBatch:
        """Resize each image's current view to ``(height[i], width[i])``."""
        height, width = np.asarray(height, np.int64), np.asarray(width, np.int64)
        geom = self.geom.copy()
        geom[:, 0] *= self.size[:, 0] / height
        geom[:, 2] *= self.size[:, 1] / width
        return self._with(geom, self.clip.copy(), np.stack([height, width], axis=1))

    def hflip(self, mask: np.ndarray) -> ImageBatch:
        """Mirror the images where ``mask`` is true."""
        mask = np.asarray(mask, dtype=bool)
        geom = self.geom.copy()
        geom[:, 3] = np.where(mask, geom[:, 3] + geom[:, 2] * self.size[:, 1], geom[:, 3])
        geom[:, 2] = np.where(mask, -geom[:, 2], geom[:, 2])
        return self._with(geom, self.clip.copy(), self.size.copy())

    # ----- rendering (device) ------------------------------------------------------------------
    def render(self, *, out: torch.Tensor | None = None, rows: Sequence[int] | None = None,
               max_canvas: int = MAX_CANVAS) -> torch.Tensor:
        """Resample every image once into a uint8 ``(N, C, H, W)`` tensor (the sizes must agree).

        With ``out`` and ``rows``, image ``i`` is written to ``out[rows[i]]`` instead (``out`` is returned).
        """
        size = self.uniform_size()
        if size is None:
            if len(self) == 0:
                if out is not None:
                    return out
                raise ValueError("ImageBatch.render: an empty batch has no size; crop or resize it to a fixed size")
            raise ValueError(f"ImageBatch.render: images have different output sizes "
                             f"({sorted({tuple(s) for s in self.size.tolist()})[:4]}...); add a CenterCrop or "
                             "RandomResizedCrop, or Resize to a (height, width) pair")
        channels = int(self.images[0].shape[0])
        if out is None:
            out = torch.empty((len(self), channels, *size), dtype=torch.uint8, device=self.device)
            rows = range(len(self))
        elif rows is None or len(rows) != len(self) or tuple(out.shape[1:]) != (channels, *size):
            raise ValueError(f"ImageBatch.render: out {tuple(out.shape)} / rows do not fit {len(self)} images of "
                             f"{(channels, *size)}")
        frame = _reach(self.frame, self.clip, self.geom)
        ry, rx = frame[:, 1] - frame[:, 0], frame[:, 3] - frame[:, 2]
        groups = _groups(ry, rx, channels, max_canvas)
        order = np.concatenate(groups)
        # one host->device transfer for every group: ay, by, ax, bx, frame y0, y1, x0, x1, output row, window
        params = np.concatenate([self.geom, frame.astype(np.float64),
                                 np.asarray(rows, dtype=np.float64)[:, None], self.window], axis=1)[order]
        p = _to_device(params.astype(np.float32), out.device)
        dtype = torch.float16 if out.device.type == "cuda" else torch.float32
        start = 0
        for chunk in _weight_chunks(groups, ry, rx, size):
            # the weights of a run of groups at once (one set of launches, not one per group), sliced per group
            n = sum(len(g) for g in chunk)
            rows_ = np.concatenate(chunk)
            pc = p[start : start + n]
            wy = _weights(pc[:, 0], pc[:, 1], pc[:, 4], pc[:, 5], pc[:, 9:11], size[0], max(int(ry[rows_].max()), 1),
                          dtype)
            wx = _weights(pc[:, 2], pc[:, 3], pc[:, 6], pc[:, 7], pc[:, 11:13], size[1], max(int(rx[rows_].max()), 1),
                          dtype)
            at = 0
            for group in chunk:
                sl = slice(at, at + len(group))
                _render_group([self.images[i] for i in group.tolist()], self.clip[group], frame[group], wy[sl],
                              wx[sl], pc[sl, 8], out)
                at += len(group)
            start += n
        return out


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)  # a private torch op (2.1+); a loop where it is missing


def _groups(h: np.ndarray, w: np.ndarray, channels: int, max_canvas: int) -> list[np.ndarray]:
    """Images grouped so that each group's padded canvas wastes little and fits ``max_canvas``."""
    order = np.argsort(h * w, kind="stable").tolist()
    groups: list[list[int]] = []
    cur: list[int] = []
    my = mx = area = 0
    for i in order:
        ny, nx = max(my, int(h[i])), max(mx, int(w[i]))
        pixels = (len(cur) + 1) * ny * nx
        if cur and (pixels * channels > max_canvas or pixels > _WASTE * (area + h[i] * w[i]) + 4096):
            groups.append(cur)
            cur, area, ny, nx = [], 0, int(h[i]), int(w[i])
        cur.append(i)
        my, mx, area = ny, nx, area + int(h[i] * w[i])
    if cur:
        groups.append(cur)
    return [np.asarray(g, dtype=np.int64) for g in groups]


def _reach(frame: np.ndarray, clip: np.ndarray, geom: np.ndarray) -> np.ndarray:
    """``frame`` cut to the padding the filter can blend with the image: an output pixel whose filter
    (radius ``s = max(|a|, 1)``) reaches an image pixel reads no further than ``2 s`` beyond the image;
    one that reaches none is 0 either way. So padding a small image costs no large canvas."""
    out = frame.copy()
    for axis in (0, 1):
        m = 2 * np.ceil(np.maximum(np.abs(geom[:, 2 * axis]), 1.0)).astype(np.int64) + 1
        out[:, 2 * axis] = np.maximum(frame[:, 2 * axis], clip[:, 2 * axis] - m)
        out[:, 2 * axis + 1] = np.minimum(frame[:, 2 * axis + 1], clip[:, 2 * axis + 1] + m)
    return out


def _weight_chunks(groups: list[np.ndarray], h: np.ndarray, w: np.ndarray,
                   size: tuple[int, int]) -> list[list[np.ndarray]]:
    """Consecutive groups whose weights are computed together: all of them unless padding every image's
    weights to the largest image's would cost more than twice the tight size (one large image in a batch
    of small ones: 256 x 224 x 4000 float32 weights, 875 MiB per axis, for one 4000 px image)."""
    chunks: list[list[np.ndarray]] = []
    cur: list[np.ndarray] = []
    n = ky = kx = tight = 0
    for g in groups:
        gy, gx = max(int(h[g].max()), 1), max(int(w[g].max()), 1)
        my, mx = max(ky, gy), max(kx, gx)
        t = tight + len(g) * (size[0] * gy + size[1] * gx)
        if cur and (n + len(g)) * (size[0] * my + size[1] * mx) > 2 * t + _WEIGHTS_SLACK:
            chunks.append(cur)
            cur, n, my, mx, t = [], 0, gy, gx, len(g) * (size[0] * gy + size[1] * gx)
        cur.append(g)
        n, ky, kx, tight = n + len(g), my, mx, t
    if cur:
        chunks.append(cur)
    return chunks


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without a host sync (pinned + non_blocking on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _render_group(images: list[torch.Tensor], clip: np.ndarray, frame: np.ndarray, wy: torch.Tensor,
                  wx: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """Resample one group of images (their host ``clip`` regions, placed in their ``frame``; weights
    ``(g, out, k)`` computed for its run of groups, cut here to the group's canvas) into ``out[rows]``."""
    # the zero-padded canvas of the frames: one copy per image (torch.nested.to_padded_tensor
    # would do it in one kernel but synchronises the host on CUDA: it copies its size metadata blocking)
    ry, rx = frame[:, 1] - frame[:, 0], frame[:, 3] - frame[:, 2]
    ky, kx = max(int(ry.max()), 1), max(int(rx.max()), 1)
    canvas = torch.zeros((len(images), images[0].shape[0], ky, kx), dtype=wy.dtype, device=out.device)
    dst, src = [], []
    for k, (im, (y0, y1, x0, x1), (fy, _, fx, _)) in enumerate(zip(images, clip.tolist(), frame.tolist())):
        if y1 > y0 and x1 > x0:
            dst.append(canvas[k, :, y0 - fy : y1 - fy, x0 - fx : x1 - fx])
            src.append(im[:, y0:y1, x0:x1])
    if _FOREACH_COPY is None:  # torch without _foreach_copy_
        for d, s_ in zip(dst, src):
            d.copy_(s_)
    elif dst:
        _FOREACH_COPY(dst, src)  # one call: the per-image copies are dispatched in C++
    wy, wxt = wy[:, :, :ky].unsqueeze(1), wx[:, :, :kx].transpose(1, 2).unsqueeze(1)  # (g,1,oh,ky), (g,1,kx,ow)
    oh, ow = wy.shape[2], wxt.shape[3]
    if ky * kx * ow + oh * ky * ow <= oh * ky * kx + oh * kx * ow:
        res = torch.matmul(wy, torch.matmul(canvas, wxt))
    else:
        res = torch.matmul(torch.matmul(wy, canvas), wxt)
    res = res.float().add_(0.5).clamp_(0, 255).floor_().to(torch.uint8)
    out.index_copy_(0, rows.long(), res)


def _weights(a: torch.Tensor, b: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, window: torch.Tensor, out: int,
             k: int, dtype: torch.dtype) -> torch.Tensor:
    """Antialiased bilinear weights ``(g, out, k)`` from canvas positions ``k`` (source pixel ``lo + k``,
    valid below ``hi``) to output pixels; 0 for an output pixel whose centre falls outside ``window``
    (``(g, 2)``: source start and end).
    A mirrored axis (``a < 0``) gets the unmirrored weights in reverse order, so a flip is exact."""
    j = torch.arange(out, dtype=torch.float32, device=a.device)
    pos = torch.arange(k, dtype=torch.float32, device=a.device)
    mirrored = a < 0
    b = torch.where(mirrored, b + a * out, b)
    a = a.abs()
    # distance from source pixel centre (lo + k + 0.5) to output pixel centre (a (j + 0.5) + b), in filter units
    centre = torch.addcmul((b + 0.5 * a - lo - 0.5)[:, None], a[:, None], j[None, :])
    w = (pos[None, None, :] - centre[:, :, None]).abs_().mul_((1.0 / a.clamp_min(1.0))[:, None, None])
    w = (1.0 - w).clamp_min_(0.0).mul_((pos[None, :] < (hi - lo)[:, None]).to(w.dtype)[:, None, :])
    shown = window - (lo + 0.5)[:, None]  # in the frame of ``centre``; centres in view are >= a / 2 inside
    inside = (centre > shown[:, :1]) & (centre < shown[:, 1:])
    w.mul_(inside.to(w.dtype)[:, :, None])
    w.div_(w.sum(-1, keepdim=True).clamp_min_(1e-12))  # rows of pixels outside the frame stay 0
    w = torch.where(mirrored[:, None, None], w.flip(1), w)
    return w.to(dtype)


# ---------------------------------------------------------------------------------------------
# Transforms


class _Geometric:
    """Base: ``lazy(batch)`` updates every :class:`ImageBatch` leaf's geometry; ``batch(...)`` also renders."""

    def apply(self, images: ImageBatch) -> ImageBatch:  # pragma: no cover - abstract
        """``images`` with this transform's geometry recorded (resampled later, once, by ``render``)."""
        raise NotImplementedError

    def lazy(self, batch: Any) -> Any:
        """The batch with this transform pending on every ImageBatch in it (nothing resampled)."""
        return _map_images(batch, self.apply, type(self).__name__)

    def __call__(self, batch: Any) -> Any:
        """The batch with this transform applied; ImageBatches of one output size become tensors."""
        return render_images(self.lazy(batch))


class RandomResizedCrop(_Geometric):
    """Crop a random area and aspect ratio, resize it to ``size`` (torchvision semantics, batched).

    The crop parameters follow ``torchvision.transforms.RandomResizedCrop.get_params``: up to ten
    tries of an area fraction uniform in ``scale`` and a log-uniform aspect ratio in ``ratio``,
    else a central crop clamped to ``ratio`` (at least one pixel); drawn from a hash of
    ``(seed, epoch, sample index)``.
    """

    def __init__(self, size: int | tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0), *, seed: int = 0) -> None:
        self.size = check_size("RandomResizedCrop", size)
        self.scale = check_range("RandomResizedCrop", "scale", scale, positive=False)
        self.ratio = check_range("RandomResizedCrop", "ratio", ratio, positive=True)
        self.seed = check_seed("RandomResizedCrop", seed)

    def params(self, heights: np.ndarray, widths: np.ndarray, ids: np.ndarray, epoch: int) -> tuple[np.ndarray, ...]:
        """``(top, left, height, width)`` int arrays for images of the given sizes."""
        u = uniforms(self.seed, CROP_SALT, epoch, ids, 40)
        return crop_params(u, heights, widths, self.scale, self.ratio)

    def apply(self, images: ImageBatch) -> ImageBatch:
        top, left, h, w = self.params(images.size[:, 0], images.size[:, 1], images.ids, images.epoch)
        return images.crop(top, left, h, w, out_size=self.size)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, seed={self.seed})"


class RandomHorizontalFlip(_Geometric):
    """Mirror each image with probability ``p``, drawn from a hash of ``(seed, epoch, sample index)``."""

    def __init__(self, p: float = 0.5, *, seed: int = 0) -> None:
        self.p = check_probability("RandomHorizontalFlip", p)
        self.seed = check_seed("RandomHorizontalFlip", seed)

    def flips(self, ids: np.ndarray, epoch: int) -> np.ndarray:
        """Which of the samples ``ids`` are mirrored in ``epoch``."""
        return uniforms(self.seed, FLIP_SALT, epoch, ids, 1)[:, 0] < self.p

    def apply(self, images: ImageBatch) -> ImageBatch:
        return images.hflip(self.flips(images.ids, images.epoch))

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p}, seed={self.seed})"


class Resize(_Geometric):
    """Resize to ``(height, width)``, or an int: the shorter side to ``size`` (torchvision's rounding)."""

    def __init__(self, size: int | tuple[int, int]) -> None:
        self.size = check_size("Resize", size, allow_int_short=True)

    def apply(self, images: ImageBatch) -> ImageBatch:
        if isinstance(self.size, tuple):
            n = len(images)
            return images.resize(np.full(n, self.size[0]), np.full(n, self.size[1]))
        h, w = images.size[:, 0], images.size[:, 1]
        short, long = np.minimum(h, w), np.maximum(h, w)
        new_long = (self.size * long / short).astype(np.int64)  # torchvision truncates
        portrait = h > w
        return images.resize(np.where(portrait, new_long, self.size), np.where(portrait, self.size, new_long))

    def __repr__(self) -> str:
        return f"Resize(size={self.size})"


class CenterCrop(_Geometric):
    """Crop the centre ``(height, width)`` (an int: square); a larger crop pads with zeros (torchvision)."""

    def __init__(self, size: int | tuple[int, int]) -> None:
        self.size = check_size("CenterCrop", size)

    def apply(self, images: ImageBatch) -> ImageBatch:
        ch, cw = self.size  # type: ignore[misc]
        H, W = images.size[:, 0], images.size[:, 1]
        top = np.where(H >= ch, np.round((H - ch) / 2.0), -((ch - H) // 2)).astype(np.int64)
        left = np.where(W >= cw, np.round((W - cw) / 2.0), -((cw - W) // 2)).astype(np.int64)
        n = len(images)
        return images.crop(top, left, np.full(n, ch), np.full(n, cw))

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size})"


# ---------------------------------------------------------------------------------------------
# Finding ImageBatches in a batch


def _map_images(batch: Any, fn: Callable[[ImageBatch], Any], owner: str, _found: list | None = None) -> Any:
    found: list[int] = [] if _found is None else _found
    out = _walk(batch, fn, found)
    if _found is None and not found:
        # Compose(..., Normalize(), RandomHorizontalFlip()): torchvision's order
        if any(x.dtype.is_floating_point and x.dim() >= 4 for _, x in tensor_leaves(batch)):
            raise ValueError(f"{owner}: the batch holds no ImageBatch, only floating-point image tensors; geometric "
                             "transforms act on uint8 images: put them before Normalize/ToDtype in the Compose")
        raise ValueError(f"{owner}: the batch holds no ImageBatch; decode packed images first "
                         "(fastdata.gpu.DecodeImages), or wrap tensors with ImageBatch.from_tensor")
    return out


def _walk(obj: Any, fn: Callable[[ImageBatch], Any], found: list[int]) -> Any:
    if isinstance(obj, ImageBatch):
        found.append(1)
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn, found) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, fn, found) for v in obj]
    if isinstance(obj, tuple):
        items = [_walk(v, fn, found) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def render_images(batch: Any) -> Any:
    """Render every :class:`ImageBatch` in ``batch`` whose images share one output size into a tensor."""
    return _walk(batch, lambda ib: ib.render() if ib.uniform_size() is not None else ib, [])
