"""Normalize, ToDtype and ChannelsLast: values against a reference, the batches they refuse to pass on
silently (masks, other channel counts, encoded images, several sizes), their arguments."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata import gpu
from fastdata.dataset import EncodedImage, collate
from fastdata.gpu import (ChannelsLast, Compose, ImageBatch, IMAGENET_MEAN, IMAGENET_STD, Normalize,
                          RandomHorizontalFlip, RandomResizedCrop, ToDtype)
from fastdata.prefetch import CUDAPrefetcher
from tests.helpers.images import flat_png, smooth
from tests.helpers.prefetch import normalize_reference


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


def test_geometric_transform_after_normalize_says_to_move_it():
    """torchvision's order (flip after Normalize) pointed to ImageBatch.from_tensor, which takes uint8 only."""
    batch = {"x": ImageBatch([smooth(10, 12)], [0], 0), "y": torch.zeros(1)}
    with pytest.raises(ValueError, match="RandomHorizontalFlip: .* put them before Normalize/ToDtype"):
        Compose(RandomResizedCrop(8), gpu.Normalize(), RandomHorizontalFlip())(batch)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_normalize_matches_reference(dtype: torch.dtype, channels_last: bool) -> None:
    x = torch.randint(0, 256, (4, 3, 9, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batch = {"img": x, "label": torch.arange(4), "mask": torch.zeros(4, 9, 7, dtype=torch.uint8)}
    out = Normalize(IMAGENET_MEAN, IMAGENET_STD, dtype=dtype, channels_last=channels_last)(batch)
    ref = normalize_reference(x, IMAGENET_MEAN, IMAGENET_STD)
    assert out["img"].dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out["img"].float(), ref.to(dtype).float(), atol=tol, rtol=tol)
    assert out["img"].is_contiguous(memory_format=torch.channels_last) == channels_last
    assert out["label"] is batch["label"] and out["mask"] is batch["mask"]  # not image-like: untouched


def test_normalize_single_image_keys_and_errors() -> None:
    x = torch.randint(0, 256, (3, 5, 5), dtype=torch.uint8)
    out = Normalize(keys=[0])((x, x))
    torch.testing.assert_close(out[0], normalize_reference(x, IMAGENET_MEAN, IMAGENET_STD))
    assert out[1] is x
    gray = torch.randint(0, 256, (2, 1, 4, 4), dtype=torch.uint8)
    torch.testing.assert_close(Normalize([0.5], [0.25])(gray), normalize_reference(gray, [0.5], [0.25]))
    f = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(Normalize(keys=["f"])({"f": f})["f"], normalize_reference(f * 255, IMAGENET_MEAN, IMAGENET_STD))
    with pytest.raises(ValueError, match=r"batch\['m'\] has shape \(2, 4, 4\), expected 3 channels at dim -3"):
        Normalize(keys=["m"])({"m": torch.zeros(2, 4, 4, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"channels_last needs a 4-D or 5-D tensor, batch\[0\]"):
        Normalize(channels_last=True)([x])
    with pytest.raises(ValueError, match="std must be > 0"):
        Normalize(std=(0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match="mean and std differ in length"):
        Normalize(mean=(0.5,), std=(0.2, 0.2))
    with pytest.raises(ValueError, match="dtype must be one of"):
        Normalize(dtype=torch.int32)
    with pytest.raises(ValueError, match="keys must be a non-empty"):
        Normalize(keys=[])


def test_todtype_channelslast_compose() -> None:
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    torch.testing.assert_close(ToDtype(torch.float32, scale=True)(x), x.float() / 255)
    assert ToDtype(torch.float16)(x).dtype == torch.float16
    cl = ChannelsLast()({"a": x, "b": torch.zeros(3)})
    assert cl["a"].is_contiguous(memory_format=torch.channels_last) and torch.equal(cl["a"], x)
    both = Compose(ToDtype(torch.bfloat16, scale=True), ChannelsLast())(x)
    assert both.dtype == torch.bfloat16 and both.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not callable"):
        Compose(ToDtype(), 3)


@pytest.mark.parametrize("transform", [
    fastdata.gpu.Normalize(keys=["image"]), fastdata.gpu.ToDtype(torch.float32, keys=["image"]),
    fastdata.gpu.ChannelsLast(keys=["image"])])
def test_device_transform_whose_keys_match_nothing_says_so(transform):
    # Normalize(keys=["image"]) on a batch whose images are under "jpg" returned it untouched: uint8 went on
    batch = {"jpg": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "cls": torch.tensor([0, 1]), "__key__": ["a", "b"]}
    with pytest.raises(ValueError, match=r"no tensor .*\['image'\].*'jpg'"):
        transform(batch)
    either = type(transform)(**{**_fields(transform), "keys": ["png", "jpg"]})
    assert either(batch)["jpg"] is not batch["jpg"]  # alternatives: one of them present is enough


def _fields(t):
    import dataclasses
    return {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.init}


@pytest.mark.parametrize("keys", [None, ["jpg"]])
def test_normalize_refuses_images_left_in_different_sizes(keys):
    # Resize(16) keeps the aspect ratio: the images stay an ImageBatch of several sizes, which
    # Normalize passed through untouched (uint8, not normalised) instead of saying why
    from fastdata import gpu
    images = gpu.ImageBatch([torch.zeros(3, 20, 30, dtype=torch.uint8), torch.zeros(3, 40, 20, dtype=torch.uint8)],
                            ids=[0, 1], epoch=0)
    with pytest.raises(ValueError, match=r"Normalize: batch\['jpg'\] .*different sizes"):
        gpu.Compose(gpu.Resize(16), gpu.Normalize(keys=keys))({"jpg": images, "cls": torch.tensor([0, 1])})
    out = gpu.Compose(gpu.Resize((16, 16)), gpu.Normalize(keys=keys))({"jpg": images, "cls": torch.tensor([0, 1])})
    assert out["jpg"].dtype == torch.float32 and out["jpg"].shape == (2, 3, 16, 16)


def test_normalize_passes_an_empty_image_batch():
    # DecodeImages(on_error="skip") over a batch whose every image is corrupt leaves an empty ImageBatch:
    # nothing to normalise, and no "different sizes" to complain about
    from fastdata import gpu
    empty = gpu.ImageBatch([], ids=[], epoch=0)
    out = gpu.Compose(gpu.RandomResizedCrop(8), gpu.Normalize())({"jpg": empty, "cls": torch.zeros(0)})
    assert len(out["jpg"]) == 0


@pytest.mark.parametrize("channel_dim", [3, -4])
def test_normalize_with_a_channel_dim_beyond_a_masks_dims_leaves_the_mask_alone(channel_dim):
    """``Normalize(channel_dim=3)`` (NHWC images given by a positive index) over a batch that also holds
    (N, H, W) uint8 masks: before, a bare ``IndexError: tuple index out of range`` from the mask."""
    from fastdata import gpu

    if channel_dim == 3:
        img = torch.randint(0, 256, (2, 5, 6, 3), dtype=torch.uint8)
    else:
        img = torch.randint(0, 256, (3, 2, 5, 6), dtype=torch.uint8)  # channels first of a 4-D batch
    mask = torch.randint(0, 3, (2, 5, 6), dtype=torch.uint8)
    norm = gpu.Normalize(channel_dim=channel_dim)
    out = norm({"img": img, "mask": mask})
    assert out["img"].dtype == torch.float32 and out["mask"] is mask
    assert torch.allclose(out["img"], norm.apply(img))


def test_keys_given_as_bytes_are_refused():
    """``keep_on_host=b"meta"`` (and ``keys=b"img"`` of the transforms and DecodeImages) was read as the
    integer keys (109, 101, 116, 97): indices, silently matching nothing the user meant."""
    from fastdata import gpu

    with pytest.raises(ValueError, match="keep_on_host must be a key or a sequence of keys"):
        CUDAPrefetcher([], device="cpu", keep_on_host=b"meta")
    for make in (gpu.Normalize, gpu.ToDtype, gpu.ChannelsLast, gpu.DecodeImages):
        with pytest.raises(ValueError, match="keys must be None, a key or a sequence of keys"):
            make(keys=bytearray(b"img"))


@pytest.mark.parametrize("wrap", [lambda ib: ("tag", ib), lambda ib: [3, ib], lambda ib: {"x": ["a", ib]}])
def test_images_of_several_sizes_behind_a_string_are_not_passed_on_silently(wrap):
    """Normalize/ToDtype/ChannelsLast refuse images left in an ImageBatch of several sizes (module docstring).
    Before: in a list or tuple whose first item was a str, int or float, the ImageBatch passed through
    untouched (uint8, unnormalised, not even a tensor)."""
    from fastdata import gpu

    ib = gpu.ImageBatch([torch.zeros((3, 4, 5), dtype=torch.uint8), torch.zeros((3, 6, 5), dtype=torch.uint8)],
                        [0, 1], 0)
    for t in (gpu.Normalize(), gpu.ToDtype(torch.float32), gpu.ChannelsLast()):
        with pytest.raises(ValueError, match="holds images of different sizes"):
            gpu.Compose(t)(wrap(ib))


@pytest.mark.parametrize("value", ["no", 0.0, None, np.bool_(True)])
def test_normalize_channels_last_must_be_a_bool(value):
    # Normalize(channels_last="no") was taken as true (ToDtype(scale=) was already checked)
    with pytest.raises(ValueError, match="Normalize: channels_last must be a bool"):
        gpu.Normalize(channels_last=value)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.int16, torch.int32])
def test_normalize_of_wider_integer_images_is_not_a_silent_no_op(dtype):
    # 16-bit images (torchvision.io.decode_image of a 16-bit PNG gives uint16) passed Normalize() untouched:
    # the module docstring promises a ValueError for a batch whose only images it cannot take
    x = torch.randint(0, 30000, (2, 3, 4, 5), dtype=torch.int32).to(dtype)
    with pytest.raises(ValueError, match=rf"Normalize: batch\['img'\] is a {dtype} batch of shape \(2, 3, 4, 5\)"):
        gpu.Normalize()({"img": x, "cls": torch.arange(2)})
    labels = {"boxes": torch.zeros((2, 5, 4), dtype=dtype), "cls": torch.arange(2)}  # no image-like tensor: passes
    assert gpu.Normalize()(labels)["boxes"].dtype == dtype


def test_normalize_before_decode_images_is_not_a_silent_no_op():
    # Compose(Normalize(), DecodeImages(), CenterCrop(8)) gave uint8 images: Normalize saw only encoded images
    # (PackedImages, no tensor) and passed the batch on untouched
    batch = collate([{"png": EncodedImage(flat_png(), shard="s.tar", key=f"k{i}", index=i, epoch=0), "cls": i}
                     for i in range(2)])
    with pytest.raises(ValueError, match=r"Normalize: batch\['png'\] holds encoded images.*DecodeImages before"):
        gpu.Compose(gpu.Normalize(), gpu.DecodeImages(device="cpu"), gpu.CenterCrop(8))(batch)
    out = gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.CenterCrop(8), gpu.Normalize())(batch)
    assert out["png"].dtype == torch.float32 and out["png"].shape == (2, 3, 8, 8)
    assert gpu.Normalize()({"cls": torch.arange(2), "txt": ["a", "b"]})["cls"].tolist() == [0, 1]  # no images: passes


@pytest.mark.parametrize("kw", [{"mean": b"x", "std": b"x"}, {"mean": "5", "std": "5"},
                                {"mean": (0.5,), "std": bytearray(b"\x01")}, {"mean": (True,), "std": (1.0,)}])
def test_normalize_refuses_strings_bytes_and_bools(kw):
    with pytest.raises(ValueError, match="Normalize: (mean|std)"):
        Normalize(**kw)
    assert Normalize(mean=np.array([0.5]), std=[0.25]).mean == (0.5,)
