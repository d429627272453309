"""Session 6, decode and augmentation stage checked against torchvision's documented semantics (CPU path).

torchvision does not import here, so its behaviour is transcribed from its source (``center_crop`` of
``torchvision/transforms/functional.py``, the tensor ``resize``: ``interpolate(..., antialias=True)``).
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.test_augment import reference, smooth_images  # the same smooth images and torchvision resize reference

from fastdata import gpu
from fastdata.gpu import (
    CenterCrop,
    Compose,
    ImageBatch,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)


def smooth(h: int, w: int, seed: int = 0) -> torch.Tensor:
    return smooth_images([(h, w)], seed)[0]


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


@pytest.mark.parametrize("n", [2, 3, 4])
def test_normalize_leaves_masks_alone_whatever_the_batch_size(n):
    """Normalize() (keys=None) beside a batch of images left (N, H, W) uint8 masks alone, except when
    N == 3 == len(mean): the last, partial batch of an epoch could turn its masks into floats."""
    g = torch.Generator().manual_seed(n)
    batch = {"image": torch.randint(0, 256, (n, 3, 5, 6), dtype=torch.uint8, generator=g),
             "mask": torch.randint(0, 4, (n, 5, 6), dtype=torch.uint8, generator=g)}
    out = gpu.Normalize()(batch)
    assert out["image"].dtype == torch.float32
    assert out["mask"] is batch["mask"]
    # on its own, a (3, H, W) tensor is still one image, and two of them in a tuple are two images
    img = batch["image"][0]
    assert gpu.Normalize()(img).dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in gpu.Normalize()((img, img)))


def _png16(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(values.astype(np.uint16)).save(buf, format="PNG")
    return buf.getvalue()


def test_sixteen_bit_greyscale_keeps_its_high_byte_on_every_path(monkeypatch):
    """A 16-bit greyscale PNG came out clipped at 255 (near white) with mode RGB or L, as the low byte
    (wrapped around) with mode None, while Pillow reads a 16-bit colour PNG by its high byte. Values above
    255 now mean the full 16-bit range (the high byte); label masks (none above 255) keep their values."""
    from tests.helpers.images import packed

    from fastdata.decode import ImageDecoder, SampleDecoder, image_to_tensor
    from fastdata.gpu import _codec

    values = np.array([[0, 255, 256, 1000, 30000, 65535]])
    want = (values >> 8).astype(np.uint8)  # torchvision: decode_image -> uint16, to_dtype(uint8, scale=True)
    data = _png16(values)
    for mode in ("RGB", "L", None):
        out = ImageDecoder(mode)(data)
        assert out.dtype == torch.uint8 and (out.numpy() == want).all(), mode
    assert (SampleDecoder()({"__key__": "k", "depth.png": data}, shard="s")["depth.png"].numpy() == want).all()
    # a PIL image of unknown provenance (a transform's output): exact where it can be, else an error, not wrapped
    with pytest.raises(ValueError, match=r"a 16-bit image \(mode I;16\) with values in \[0, 65535\]"):
        image_to_tensor(Image.open(io.BytesIO(data)))
    assert image_to_tensor(Image.open(io.BytesIO(_png16(np.array([[0, 7, 255]]))))).tolist() == [[[0, 7, 255]]]
    batch = gpu.DecodeImages(device="cpu", host_decoder="pillow")({"x": packed([data])})["x"]
    assert (batch.images[0].numpy() == want).all()

    class FakeTorchvision:  # torchvision >= 0.21: decode_image gives uint16 for a 16-bit PNG
        class ImageReadMode:
            RGB = "RGB"

        @staticmethod
        def decode_image(data, mode):
            return torch.from_numpy(np.repeat(values[None], 3, 0).astype(np.int32)).to(torch.uint16)

    monkeypatch.setattr(_codec, "torchvision_status", lambda: (FakeTorchvision, "fake"))
    out = _codec.decode_host(torch.frombuffer(bytearray(data), dtype=torch.uint8), packed([data]).info(0),
                             "torchvision")
    assert out.dtype == torch.uint8 and (out.numpy() == want).all()
    # 16-bit label masks (no value above 255) keep their values, as they did when clipped, on every path
    labels = np.array([[0, 3, 7, 255]])
    mask = _png16(labels)
    for mode in ("RGB", "L", None):
        assert (ImageDecoder(mode)(mask).numpy() == labels).all(), mode
    values = labels
    out = _codec.decode_host(torch.frombuffer(bytearray(mask), dtype=torch.uint8), packed([mask]).info(0),
                             "torchvision")
    assert (out.numpy() == labels).all()


def test_wide_integer_and_float_images_are_exact_or_refused():
    """Mode I (16-bit PGM, 32-bit TIFF) and F (float TIFF) images were clipped (RGB, L) or wrapped (None)."""
    from fastdata.decode import ImageDecoder, SampleDecoder
    from fastdata.errors import DecodeError

    def enc(arr, fmt):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt)
        return buf.getvalue()

    small = np.array([[0, 3, 255]], dtype=np.int32)
    assert ImageDecoder()(enc(small, "TIFF"))[0].tolist() == [[0, 3, 255]]  # exact: nothing to lose
    assert ImageDecoder(None)(enc(small.astype(np.float32), "TIFF"))[0].tolist() == [[0, 3, 255]]
    for arr, fmt, what in ((np.array([[0, 1000, 65535]], dtype=np.uint16), "PPM", "32-bit integer"),
                           (np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "TIFF", "float"),
                           (np.array([[-1, 3, 255]], dtype=np.int32), "TIFF", "32-bit integer")):
        for mode in ("RGB", "L", None):
            with pytest.raises(ValueError, match=f"a {what} image .* no uint8 image holds them"):
                ImageDecoder(mode)(enc(arr, fmt))
    with pytest.raises(DecodeError, match=r"s: sample 'k' field 'x.tif': ValueError: a float image"):
        SampleDecoder()({"__key__": "k", "x.tif": enc(np.array([[0.5]], dtype=np.float32), "TIFF")}, shard="s")


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


def test_decode_chunks_joined_keep_their_padding():
    """DecodeImages joins per-chunk ImageBatches (CUDA, nvImageCodec) with ``_concat``: the padding frame
    and view window of each image go with it, so the joined batch renders as the parts do."""
    from fastdata.gpu._decode import _concat

    imgs = [smooth(20, 30, 1), smooth(9, 12, 2), smooth(25, 16, 3)]
    parts = [CenterCrop(22).apply(CenterCrop((6, 8)).apply(Resize(12).apply(ImageBatch(imgs[:2], [0, 1], 0)))),
             Resize((22, 22)).apply(CenterCrop(44).apply(ImageBatch(imgs[2:], [2], 0)))]
    joined = _concat(parts, [2, 0, 1])  # the first part's images were rows 2 and 0, the second's row 1
    want = torch.cat([p.render() for p in parts])[[1, 2, 0]]
    assert torch.equal(joined.render(), want)
    assert joined.ids.tolist() == [1, 2, 0]


def test_geometric_transform_after_normalize_says_to_move_it():
    """torchvision's order (flip after Normalize) pointed to ImageBatch.from_tensor, which takes uint8 only."""
    batch = {"x": ImageBatch([smooth(10, 12)], [0], 0), "y": torch.zeros(1)}
    with pytest.raises(ValueError, match="RandomHorizontalFlip: .* put them before Normalize/ToDtype"):
        Compose(RandomResizedCrop(8), gpu.Normalize(), RandomHorizontalFlip())(batch)


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


def test_normalize_after_to_dtype_is_not_a_silent_no_op():
    """torchvision's order, ToDtype(float32, scale=True) then Normalize(), returned the [0, 1] floats
    unnormalised: Normalize() without keys picks uint8 images only, and found none."""
    x = torch.randint(0, 256, (4, 3, 6, 5), dtype=torch.uint8)
    batch = {"img": x, "y": torch.arange(4)}
    with pytest.raises(ValueError, match=r"Normalize: the batch holds no uint8 images, but batch\['img'\] is a "
                                         r"torch.float32 batch .*put it before ToDtype"):
        Compose(gpu.ToDtype(torch.float32, scale=True), gpu.Normalize())(batch)
    want = gpu.Normalize()(batch)["img"]  # the order that works, and keys= for floats in [0, 1]
    got = Compose(gpu.ToDtype(torch.float32, scale=True), gpu.Normalize(keys=["img"]))(batch)["img"]
    assert torch.allclose(got, want, atol=1e-5)
    assert gpu.Normalize()({"y": torch.arange(4), "f": torch.rand(4, 7)})["f"].dtype == torch.float32  # no images


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


def test_resize_center_crop_default_resize_fits_a_non_square_crop():
    """ResizeCenterCrop((100, 120)) failed with "resize must be an int >= max(size)=120, got 114", an
    argument the user had not given; True was taken as a size of 1."""
    from fastdata.transforms import ResizeCenterCrop

    t = ResizeCenterCrop((100, 120))
    assert t.resize == 120
    tall = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 200, 3), dtype=np.uint8))
    assert t(tall).shape == (3, 100, 120)
    assert ResizeCenterCrop((200, 224)).resize == 229 and ResizeCenterCrop(224).resize == 256  # as before
    for bad in (True, (True, 4)):
        with pytest.raises(ValueError, match="size must be an int >= 1"):
            ResizeCenterCrop(bad)
    with pytest.raises(ValueError, match="resize must be an int"):
        ResizeCenterCrop(1, resize=True)


def _failing_device_decode(stage, monkeypatch):
    """``stage``'s device decode (CUDA or nvImageCodec) replaced by one that fails as torchvision's batched call
    does: a RuntimeError for the whole chunk (here: every image of the field routed to it)."""
    from concurrent.futures import Future

    def start(packed, views, device, ahead):
        fut: Future = Future()
        fut.set_exception(RuntimeError("no CUDA image decoding in this torchvision build"))
        rows = list(range(len(packed)))
        return device, rows, [(rows, fut)]

    monkeypatch.setattr(stage, "_start", start)


def test_a_device_decoder_that_fails_on_good_images_is_reported(monkeypatch):
    """A device decoder failing on every call (torchvision without working CUDA image ops) sent every batch
    to the host, many times slower, with a debug log line only: a batched call's RuntimeError is taken for
    a corrupt image in the chunk. Now a RuntimeWarning, once, when the host finds no corrupt image."""
    from tests.helpers.images import jpeg, packed

    stage = gpu.DecodeImages(device="cpu", host_decoder="pillow")
    _failing_device_decode(stage, monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"device decoder \(auto\) failed on 2 images that decode fine on the "
                                            r"host \(RuntimeError: no CUDA image decoding"):
        out = stage({"x": packed([jpeg(1), jpeg(2)])})
    assert len(out["x"]) == 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stage({"x": packed([jpeg(3)])})  # once per stage
        # a corrupt image explains the failed call: no warning, the image skipped as asked
        skip = gpu.DecodeImages(device="cpu", host_decoder="pillow", on_error="skip")
        _failing_device_decode(skip, monkeypatch)
        assert len(skip({"x": packed([jpeg(4), b"\xff\xd8\xffjunk"])})["x"]) == 1 and skip.num_skipped == 1
    assert not [w for w in seen if "device decoder" in str(w.message)]


def test_host_decoder_torchvision_without_torchvision_fails_when_built(monkeypatch):
    """DecodeImages(host_decoder="torchvision") without a working torchvision failed at the first batch, in the
    prefetcher's thread, with a plain RuntimeError; device_decoder="nvimgcodec" already failed when built."""
    from fastdata.gpu import _codec
    from fastdata.gpu._codec import DecoderUnavailableError

    monkeypatch.setattr(_codec, "torchvision_status", lambda: (None, "torchvision image ops unavailable: (as here)"))
    with pytest.raises(DecoderUnavailableError, match="decoder 'torchvision' requested but torchvision"):
        gpu.DecodeImages(device="cpu", host_decoder="torchvision")


def test_normalize_of_images_with_another_channel_count_is_not_a_silent_no_op():
    """Greyscale (or RGBA) uint8 batches under Normalize() with ImageNet's 3-value mean passed on as uint8."""
    gray = {"img": torch.zeros(4, 1, 5, 5, dtype=torch.uint8), "y": torch.arange(4)}
    with pytest.raises(ValueError, match=r"Normalize: batch\['img'\] has shape \(4, 1, 5, 5\): 1 channels at dim -3, "
                                         r"but mean/std have 3 values"):
        gpu.Normalize()(gray)
    assert gpu.Normalize([0.5], [0.25])(gray)["img"].dtype == torch.float32
    rgb_and_mask = {"img": torch.zeros(4, 3, 5, 5, dtype=torch.uint8), "m": torch.zeros(4, 1, 5, 5, dtype=torch.uint8)}
    out = gpu.Normalize()(rgb_and_mask)  # images found: other uint8 tensors pass, as documented
    assert out["img"].dtype == torch.float32 and out["m"] is rgb_and_mask["m"]


def test_sizes_given_as_bools_are_refused():
    """draft_size=True / target_size=True were taken as 1: JPEGs decoded at 1/8 scale for a cache."""
    from fastdata.decode import ImageDecoder, SampleDecoder
    from fastdata.transforms import Deterministic

    with pytest.raises(ValueError, match="draft_size must be an int >= 1 or None, got True"):
        ImageDecoder(draft_size=True)
    with pytest.raises(ValueError, match="draft_size must be an int >= 1 or None, got True"):
        SampleDecoder(draft_size=True)
    with pytest.raises(ValueError, match="target_size must be an int >= 1 or None, got True"):
        Deterministic(lambda x: x, version="1", target_size=True)


def test_a_skipped_sample_leaves_the_other_image_fields_too():
    """DecodeImages(keys=["jpg"], on_error="skip") dropped a bad sample from the tensors and lists of the batch
    but not from its other image fields (packed, or decoded by an earlier stage): 3 png images, 2 labels."""
    from tests.helpers.images import jpeg, packed

    bad = b"\xff\xd8\xffjunk"
    batch = {"jpg": packed([jpeg(1), bad, jpeg(3)]), "png": packed([jpeg(k, format="PNG") for k in (4, 5, 6)]),
             "depth": ImageBatch([smooth(4 + k, 5, k) for k in range(3)], [100, 101, 102], 0), "cls": torch.arange(3)}
    skip = gpu.DecodeImages(keys=["jpg"], device="cpu", host_decoder="pillow", on_error="skip")
    out = Compose(skip, CenterCrop(8))(batch)
    assert out["jpg"].shape[0] == 2 and out["cls"].tolist() == [0, 2]
    assert out["png"].keys == ("k0", "k2") and out["png"].indices.tolist() == [100, 102]
    assert [out["png"].tobytes(i) for i in range(2)] == [batch["png"].tobytes(0), batch["png"].tobytes(2)]
    assert out["depth"].ids.tolist() == [100, 102]
    png = gpu.DecodeImages(keys=["png"], device="cpu", host_decoder="pillow")(out)["png"]
    assert len(png) == 2  # decoded later, still one image per label
    # every sample bad: the other fields are empty too
    none = Compose(skip, CenterCrop(8))({"jpg": packed([bad, bad]), "png": packed([jpeg(7), jpeg(8)])})
    assert none["jpg"].shape[0] == 0 and len(none["png"]) == 0
