"""fastdata.gpu geometric augmentation: torchvision semantics, exact resampling, per-sample hashing,
padding, and images too small or empty."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastdata import gpu
from fastdata.gpu import CenterCrop, Compose, ImageBatch, RandomHorizontalFlip, RandomResizedCrop, Resize
from tests.helpers.images import smooth, smooth_images


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


def tv_resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's tensor resize (bilinear, antialias), rounded as its uint8 path."""
    return img.float() if tuple(img.shape[1:]) == tuple(size) else reference(img, size)


def tv_center_crop(img: torch.Tensor, ch: int, cw: int) -> torch.Tensor:
    """torchvision.transforms.functional.center_crop: zero padding where the crop is larger, then a crop."""
    H, W = img.shape[1:]
    if cw > W or ch > H:
        ltrb = ((cw - W) // 2 if cw > W else 0, (ch - H) // 2 if ch > H else 0,
                (cw - W + 1) // 2 if cw > W else 0, (ch - H + 1) // 2 if ch > H else 0)
        img = F.pad(img, (ltrb[0], ltrb[2], ltrb[1], ltrb[3]))
        H, W = img.shape[1:]
        if (H, W) == (ch, cw):
            return img
    top, left = int(round((H - ch) / 2.0)), int(round((W - cw) / 2.0))  # noqa: RUF046
    return img[:, top : top + ch, left : left + cw]


def one(chain: list, img: torch.Tensor) -> torch.Tensor:
    return Compose(*chain)({"x": ImageBatch([img], [0], 0)})["x"][0].float()


def test_center_crop_padding_around_a_resampling_is_torchvision_zero_padding():
    """A CenterCrop larger than the (resized) image pads with zeros, as torchvision's does, in every order.

    Before: Resize then a padding CenterCrop filled the padding with smeared image pixels (the filter read
    the image beyond the view: up to 170 grey levels off), and a padding CenterCrop then Resize normalised
    the filter over the image only, so the padding's zeros were not blended in at the border."""
    img = smooth(20, 30, seed=1)
    cases = [
        ([Resize((10, 12)), CenterCrop(14)], lambda x: tv_center_crop(tv_resize(x, (10, 12)), 14, 14)),  # down
        ([Resize((40, 50)), CenterCrop((44, 56))], lambda x: tv_center_crop(tv_resize(x, (40, 50)), 44, 56)),  # up
        ([Resize(16), CenterCrop(20)], lambda x: tv_center_crop(tv_resize(x, (16, 24)), 20, 20)),
        ([CenterCrop(36), Resize((15, 15))], lambda x: tv_resize(tv_center_crop(x.float(), 36, 36), (15, 15))),
        # a crop of the resized image, then a padding crop: zeros around that crop, not the image beyond it
        ([Resize((24, 32)), CenterCrop((6, 10)), CenterCrop((12, 16))],
         lambda x: tv_center_crop(tv_center_crop(tv_resize(x, (24, 32)), 6, 10), 12, 16)),
        ([CenterCrop((8, 9)), CenterCrop((14, 15)), RandomHorizontalFlip(1.0)],
         lambda x: tv_center_crop(tv_center_crop(x.float(), 8, 9), 14, 15).flip(-1)),
        ([RandomHorizontalFlip(1.0), Resize((9, 11)), CenterCrop((13, 17))],
         lambda x: tv_center_crop(tv_resize(x.flip(-1), (9, 11)), 13, 17)),
    ]
    for chain, ref in cases:
        out, want = one(chain, img), ref(img)
        assert out.shape == want.shape, chain
        assert (out - want).abs().max() <= 1, (chain, (out - want).abs().max())


def test_random_resized_crop_fallback_on_a_one_pixel_side_is_not_empty():
    """The centre-crop fallback rounds a side to 0 for a 1-pixel-wide image when ``ratio`` is far from 1
    (torchvision then fails in resize); the crop was empty and the image came out black."""
    row = torch.arange(3 * 1000, dtype=torch.int64).remainder(200).add(30).to(torch.uint8).view(3, 1, 1000)
    for img, ratio in ((row, (0.1, 0.3)), (row.transpose(1, 2).contiguous(), (3.0, 10.0))):
        crop = RandomResizedCrop(8, ratio=ratio)
        ib = ImageBatch([img], [0], 0)
        top, left, h, w = crop.params(ib.size[:, 0], ib.size[:, 1], ib.ids, 0)
        assert (h >= 1).all() and (w >= 1).all()
        assert (top + h <= img.shape[1]).all() and (left + w <= img.shape[2]).all()
        out = crop({"x": ib})["x"]
        assert out.shape == (1, 3, 8, 8) and out.min() >= 30  # the pixels of the crop, not zeros


def test_one_large_image_does_not_pad_every_images_weights(monkeypatch):
    """The resampling weights of a whole render were (images, out, k) with k the largest image's side: one
    4000 x 3000 image among 255 of 500 x 375 (RandomResizedCrop(224)) made 1.5 GiB of float32 weights,
    4x the render time on the CPU, GiBs on a GPU. Runs of groups of similar sizes now get their own."""
    from fastdata.gpu import _augment

    calls = []
    real = _augment._weights

    def spy(*args):
        w = real(*args)
        calls.append(tuple(w.shape))
        return w

    monkeypatch.setattr(_augment, "_weights", spy)
    small = smooth(20, 24)
    imgs = [small] * 64 + [torch.full((3, 8, 8000), 200, dtype=torch.uint8)]
    batch = Resize((16, 16)).apply(ImageBatch(imgs, range(65), 0))
    out = batch.render()
    assert out.shape == (65, 3, 16, 16) and (out[64] == 200).all()
    assert max(g * o * k for g, o, k in calls) <= 16 * 8000 * 2  # not 65 x 16 x 8000
    want = torch.cat([batch.select([i]).render() for i in (0, 1, 63, 64)])
    assert (out[[0, 1, 63, 64]].int() - want.int()).abs().max() <= 1


def test_padding_a_small_image_costs_no_large_canvas(monkeypatch):
    """With padding as pixels, CenterCrop(224) of 32 px images resampled a 224 x 224 canvas per image (3x
    the time); only the padding the filter can blend with the image (2 filter radii) goes on the canvas."""
    from fastdata.gpu import _augment

    frames = []
    real = _augment._render_group

    def spy(images, clip, frame, *rest):
        frames.append(frame.copy())
        return real(images, clip, frame, *rest)

    monkeypatch.setattr(_augment, "_render_group", spy)
    img = smooth(32, 30)
    out = CenterCrop(224)({"x": ImageBatch([img, img], [0, 1], 0)})["x"]
    assert torch.equal(out[0, :, 96:128, 97:127], img) and out.sum() == 2 * img.sum()
    f = np.concatenate(frames)
    assert (f[:, 1] - f[:, 0]).max() <= 32 + 6 and (f[:, 3] - f[:, 2]).max() <= 30 + 6


def test_random_resized_crop_scale_and_ratio_must_be_pairs_of_numbers():
    """scale="01" was read as (0.0, 1.0) and ("0.1", "1") as numbers."""
    for bad in ("01", ("0.1", "1"), (0.1,), (0.1, 0.5, 1.0), 0.5):
        with pytest.raises(ValueError, match=r"RandomResizedCrop: scale must be a \(min, max\) pair of numbers"):
            RandomResizedCrop(8, scale=bad)
    for bad in ((float("nan"), 1.0), (0.5, float("inf")), (0.9, 0.1), (-0.1, 1.0)):
        with pytest.raises(ValueError, match="RandomResizedCrop: scale must be finite with 0 <= min <= max"):
            RandomResizedCrop(8, scale=bad)
    for bad in ((0.0, 1.0), (4 / 3, 3 / 4), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="RandomResizedCrop: ratio must be finite with 0 < min <= max"):
            RandomResizedCrop(8, ratio=bad)
    ok = RandomResizedCrop(8, scale=np.array([0.5, 1.0]), ratio=(torch.tensor(1.0), 1))
    assert ok.scale == (0.5, 1.0) and ok.ratio == (1.0, 1.0)


@pytest.mark.parametrize("shape", [(2, 3, 0, 5), (2, 3, 5, 0)])
def test_an_image_batch_of_empty_images_is_refused(shape):
    """Before: RandomResizedCrop and CenterCrop turned a 0-pixel image into a black one with a NumPy
    divide-by-zero warning, and Resize failed deep in torch ('SymIntArrayRef expected to contain only concrete
    integers')."""
    from fastdata import gpu

    with pytest.raises(ValueError, match=r"ImageBatch: image 0 is empty: shape \(3, "):
        gpu.ImageBatch.from_tensor(torch.zeros(shape, dtype=torch.uint8), [0, 1], 0)
    assert len(gpu.ImageBatch.from_tensor(torch.zeros((0, 3, 4, 4), dtype=torch.uint8), [], 0)) == 0
