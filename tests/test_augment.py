"""fastdata.gpu geometric augmentation: torchvision semantics, exact resampling, per-sample hashing."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastdata import gpu
from fastdata.gpu import (
    CenterCrop,
    Compose,
    ImageBatch,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)


def smooth_images(sizes, seed=0):
    """Random but smooth uint8 images (so resampling differences show as small values, not noise)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for h, w in sizes:
        x = torch.randint(0, 256, (1, 3, h, w), generator=g).float()
        out.append(F.avg_pool2d(x, 5, 1, 2, count_include_pad=False)[0].round().to(torch.uint8))
    return out


def reference(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's tensor resize: interpolate bilinear with antialias, rounded like the uint8 path."""
    y = F.interpolate(img.float()[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    return y.add(0.5).clamp(0, 255).floor()


def torchvision_get_params(H: int, W: int, scale, ratio, gen: np.random.Generator):
    """torchvision 0.28 ``RandomResizedCrop.get_params``, transcribed with a numpy RNG (the library's
    own function is used instead when torchvision is importable, see the test); its ``int(round(x))``
    kept as written."""
    area = H * W
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * gen.uniform(scale[0], scale[1])
        aspect = math.exp(gen.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))  # noqa: RUF046
        h = int(round(math.sqrt(target_area / aspect)))  # noqa: RUF046
        if 0 < w <= W and 0 < h <= H:
            return int(gen.integers(0, H - h + 1)), int(gen.integers(0, W - w + 1)), h, w
    in_ratio = W / H
    if in_ratio < min(ratio):
        w, h = W, int(round(W / min(ratio)))  # noqa: RUF046
    elif in_ratio > max(ratio):
        h, w = H, int(round(H * max(ratio)))  # noqa: RUF046
    else:
        w, h = W, H
    return (H - h) // 2, (W - w) // 2, h, w


def _torchvision_params(H, W, scale, ratio, n):
    try:
        from torchvision.transforms import RandomResizedCrop as TVCrop
        TVCrop.get_params(torch.zeros(3, 4, 4), [0.5, 1.0], [0.75, 1.3])
    except Exception:  # noqa: BLE001 - torchvision missing or its C extension broken: use the transcription
        gen = np.random.default_rng(123)
        return np.array([torchvision_get_params(H, W, scale, ratio, gen) for _ in range(n)])
    torch.manual_seed(123)
    img = torch.zeros(3, H, W)
    return np.array([TVCrop.get_params(img, list(scale), list(ratio)) for _ in range(n)])


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    grid = np.sort(np.concatenate([a, b]))
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


@pytest.mark.parametrize("H,W,scale,ratio", [
    (300, 400, (0.08, 1.0), (3 / 4, 4 / 3)),
    (480, 200, (0.08, 1.0), (3 / 4, 4 / 3)),  # elongated: many tries fail, the fallback matters
    (256, 256, (0.5, 0.9), (0.5, 2.0)),
])
def test_rrc_params_match_torchvision_statistically(H, W, scale, ratio):
    n = 4000
    ours = np.stack(RandomResizedCrop(224, scale, ratio, seed=7).params(
        np.full(n, H), np.full(n, W), np.arange(n), epoch=0), axis=1)
    ref = _torchvision_params(H, W, scale, ratio, n)
    crit = 1.95 * math.sqrt(2 / n)  # KS critical value at alpha = 0.001
    for name, f in (("area fraction", lambda p: p[:, 2] * p[:, 3] / (H * W)),
                    ("log aspect", lambda p: np.log(p[:, 3] / p[:, 2])),
                    ("top", lambda p: p[:, 0] / np.maximum(H - p[:, 2], 1)),
                    ("left", lambda p: p[:, 1] / np.maximum(W - p[:, 3], 1))):
        assert _ks(f(ours), f(ref)) < crit, name
    # every crop lies inside the image; tries that succeed respect scale and ratio up to rounding
    top, left, h, w = ours.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= H).all() and (left + w <= W).all()
    frac = h * w / (H * W)
    inside = (frac >= scale[0] * 0.97) & (frac <= scale[1] * 1.03)
    assert inside.mean() > 0.97
    assert (w / h >= ratio[0] * 0.95).all() and (w / h <= ratio[1] * 1.05).all()


def test_params_are_a_function_of_seed_epoch_and_index():
    crop = RandomResizedCrop(64, seed=3)
    hs, ws = np.array([300, 400, 500]), np.array([320, 280, 640])
    a = crop.params(hs, ws, np.array([10, 11, 12]), epoch=2)
    # the same sample in another batch position and batch composition: the same crop
    b = crop.params(hs[[2, 0]], ws[[2, 0]], np.array([12, 10]), epoch=2)
    assert [int(x[2]) for x in a] == [int(x[0]) for x in b] and [int(x[0]) for x in a] == [int(x[1]) for x in b]
    assert not all(np.array_equal(x, y) for x, y in zip(a, crop.params(hs, ws, np.array([10, 11, 12]), epoch=3)))
    assert not all(np.array_equal(x, y) for x, y in zip(a, RandomResizedCrop(64, seed=4).params(
        hs, ws, np.array([10, 11, 12]), epoch=2)))
    flips = RandomHorizontalFlip(seed=1).flips(np.arange(4000), epoch=0)
    assert 0.45 < flips.mean() < 0.55
    assert not np.array_equal(flips, RandomHorizontalFlip(seed=1).flips(np.arange(4000), epoch=1))


@pytest.mark.parametrize("size", [24, (40, 30), 96])  # 96: crops are mostly upscaled
def test_random_resized_crop_equals_crop_then_antialiased_resize(size):
    imgs = smooth_images([(50, 70), (64, 40), (33, 33), (80, 120), (200, 150)])
    batch = ImageBatch(imgs, [5, 6, 7, 8, 9], epoch=1)
    crop = RandomResizedCrop(size, seed=2)
    out = crop({"x": batch})["x"]
    oh, ow = (size, size) if isinstance(size, int) else size
    assert out.shape == (5, 3, oh, ow) and out.dtype == torch.uint8
    top, left, h, w = crop.params(batch.size[:, 0], batch.size[:, 1], batch.ids, 1)
    diffs = []
    for k, im in enumerate(imgs):
        ref = reference(im[:, top[k] : top[k] + h[k], left[k] : left[k] + w[k]], (oh, ow))
        diffs.append((out[k].float() - ref).abs())
    d = torch.stack(diffs)
    assert d.max() <= 1 and (d == 0).float().mean() > 0.95


def test_resize_center_crop_is_one_resampling_like_torchvision():
    imgs = smooth_images([(50, 70), (90, 40), (33, 33)], seed=1)
    out = Compose(Resize(30), CenterCrop(24))({"x": ImageBatch(imgs, [0, 1, 2], 0)})["x"]
    for k, im in enumerate(imgs):
        H, W = im.shape[1:]
        nh, nw = (30, int(30 * W / H)) if H <= W else (int(30 * H / W), 30)
        full = reference(im, (nh, nw))
        top, left = round((nh - 24) / 2), round((nw - 24) / 2)
        assert (out[k].float() - full[:, top : top + 24, left : left + 24]).abs().max() <= 1
    # Resize to a pair alone renders; Resize(int) alone leaves different sizes: an ImageBatch
    assert Resize((20, 10))({"x": ImageBatch(imgs, [0, 1, 2], 0)})["x"].shape == (3, 3, 20, 10)
    ragged = Resize(16)({"x": ImageBatch(imgs, [0, 1, 2], 0)})["x"]
    assert isinstance(ragged, ImageBatch) and ragged.size.tolist() == [[16, 22], [36, 16], [16, 16]]
    with pytest.raises(ValueError, match="different output sizes"):
        ragged.render()


def test_flip_is_exact_and_fused():
    imgs = smooth_images([(50, 70), (64, 40), (80, 120)], seed=2)
    batch = {"x": ImageBatch(imgs, [1, 2, 3], 0)}
    plain = RandomResizedCrop(32)(batch)["x"]
    flipped = Compose(RandomResizedCrop(32), RandomHorizontalFlip(p=1.0))(batch)["x"]
    assert torch.equal(flipped, plain.flip(-1))
    assert torch.equal(Compose(RandomResizedCrop(32), RandomHorizontalFlip(p=0.0))(batch)["x"], plain)
    # flipping first, then cropping: the crop is drawn on the mirrored image (same params, mirrored box)
    first = Compose(RandomHorizontalFlip(p=1.0), CenterCrop((40, 30)))(batch)["x"]
    assert torch.equal(first, CenterCrop((40, 30))(batch)["x"].flip(-1))


def test_center_crop_larger_than_image_pads_with_zeros():
    img = smooth_images([(33, 33)])[0]
    out = CenterCrop(40)({"x": ImageBatch([img], [0], 0)})["x"][0]
    assert torch.equal(out[:, 3:36, 3:36], img)  # (40 - 33) // 2 = 3 on top/left, like torchvision's pad
    assert out[:, :3].sum() == 0 and out[:, 36:].sum() == 0 and out[:, :, :3].sum() == 0


def test_groups_give_the_same_pixels_as_one_canvas():
    sizes = [(20 + 7 * k, 90 - 5 * k) for k in range(12)]
    imgs = smooth_images(sizes, seed=3)
    geo = RandomHorizontalFlip().apply(RandomResizedCrop(16).apply(ImageBatch(imgs, range(12), 4)))
    one = geo.render(max_canvas=1 << 30)
    many = geo.render(max_canvas=3 * 90 * 90)  # forces several groups
    # the padded matmul's summation order depends on the group's canvas: at most a rounding step apart
    d = (one.int() - many.int()).abs()
    assert d.max() <= 1 and (d == 0).float().mean() > 0.99
    assert torch.equal(many, geo.render(max_canvas=3 * 90 * 90))  # the same batch: bit for bit
    out = torch.zeros((14, 3, 16, 16), dtype=torch.uint8)
    rows = [13 - k for k in range(12)]
    geo.render(out=out, rows=rows, max_canvas=1 << 30)
    assert torch.equal(out[rows], one) and out[:2].sum() == 0


def test_from_tensor_and_validation():
    x = torch.stack(smooth_images([(40, 40)] * 3))
    out = RandomResizedCrop(16)({"img": ImageBatch.from_tensor(x, [0, 1, 2], 0), "y": torch.arange(3)})
    assert out["img"].shape == (3, 3, 16, 16) and torch.equal(out["y"], torch.arange(3))
    with pytest.raises(ValueError, match="holds no ImageBatch"):
        RandomResizedCrop(16)({"img": x})
    with pytest.raises(ValueError, match="size must be >= 1"):
        RandomResizedCrop(0)
    with pytest.raises(ValueError, match="scale must be finite"):
        RandomResizedCrop(8, scale=(0.9, 0.1))
    with pytest.raises(ValueError, match="ratio must be"):
        RandomResizedCrop(8, ratio=(0, 1))
    with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\]"):
        RandomHorizontalFlip(p=1.5)
    with pytest.raises(ValueError, match="seed must be an int"):
        RandomHorizontalFlip(seed="a")
    with pytest.raises(ValueError, match="2 ids for 3 images"):
        ImageBatch(list(x), [0, 1], 0)
    with pytest.raises(ValueError, match="uint8"):
        ImageBatch([x[0].float()], [0], 0)


def test_compose_normalises_after_rendering():
    imgs = smooth_images([(50, 70), (64, 40)], seed=4)
    pipe = gpu.Compose(RandomResizedCrop(16), RandomHorizontalFlip(),
                       gpu.Normalize(dtype=torch.bfloat16, channels_last=True))
    out = pipe({"x": ImageBatch(imgs, [0, 1], 0)})["x"]
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    raw = Compose(RandomResizedCrop(16), RandomHorizontalFlip())({"x": ImageBatch(imgs, [0, 1], 0)})["x"]
    assert torch.allclose(out.float(), gpu.Normalize().apply(raw).float(), atol=0.02)
