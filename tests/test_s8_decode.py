"""Session 8, helper decode: a demanding user's bug hunt in decoding, packed images and the GPU stage's CPU path."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import gpu
from fastdata.dataset import EncodedImage, PackedImages, collate
from fastdata.errors import DecodeError


def _png(w: int = 4, h: int = 3, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), 90).save(buf, format="PNG")
    return buf.getvalue()


def _claiming(data: bytes, width: int, height: int) -> bytes:
    """A PNG whose IHDR claims another size (a corrupt header)."""
    out = bytearray(data)
    out[16:24] = struct.pack(">II", width, height)
    return bytes(out)


def test_a_header_claiming_a_side_of_2_to_the_31_pixels_is_a_bad_image_not_a_crash_of_the_collate():
    # a corrupt PNG header (height 0xFFFFFFFF) made the worker's collate raise a bare OverflowError
    # (no shard, no key), even under on_error="skip": the whole batch was lost
    datas = [_png(), _claiming(_png(), 5, 0xFFFFFFFF), _claiming(_png(), 0xFFFFFFFF, 0x80000000), _png()]
    batch = collate([{"png": EncodedImage(d, shard="s0.tar", key=f"k{i}", index=i, epoch=0), "cls": i}
                     for i, d in enumerate(datas)])
    sizes = batch["png"].sizes()
    assert sizes[0].tolist() == [3, 4] and (sizes[1:3] >= 2**31 - 1).any(axis=1).all()
    with pytest.raises(DecodeError, match=r"s0\.tar: sample 'k1' field 'png'.*max_pixels"):
        gpu.DecodeImages(device="cpu")(batch)
    dec = gpu.DecodeImages(device="cpu", on_error="skip")
    out = gpu.Compose(dec, gpu.CenterCrop(4))(batch)
    assert tuple(out["png"].shape) == (2, 3, 4, 4) and out["cls"].tolist() == [0, 3]
    assert [r["key"] for r in dec.skipped] == ["k1", "k2"]


@pytest.mark.parametrize("fmt", ["WEBP", "TIFF", "PPM"])
def test_max_pixels_refuses_images_whose_size_is_not_sniffed_too(fmt):
    # only JPEG/PNG/GIF/BMP sizes are sniffed in the worker; a WebP, TIFF or PNM over max_pixels was decoded
    # (the CPU path, SampleDecoder(max_pixels=), refuses them)
    buf = io.BytesIO()
    Image.new("RGB", (100, 80), (1, 2, 3)).save(buf, format=fmt)
    batch = collate([{"img": EncodedImage(d, shard="s.tar", key=f"k{i}", index=i, epoch=0)}
                     for i, d in enumerate([buf.getvalue(), _png(), buf.getvalue()])])
    with pytest.raises(DecodeError, match=r"s\.tar: sample 'k0' field 'img'.*8000 pixels exceeds max_pixels=1000"):
        gpu.DecodeImages(device="cpu", max_pixels=1000)(batch)
    dec = gpu.DecodeImages(device="cpu", max_pixels=1000, on_error="skip")
    assert tuple(dec(batch)["img"].images[0].shape) == (3, 3, 4) and [r["key"] for r in dec.skipped] == ["k0", "k2"]
    assert tuple(gpu.DecodeImages(device="cpu", max_pixels=8000)(batch)["img"].images[0].shape) == (3, 80, 100)


@pytest.mark.parametrize("mode", ["l", "rgb", "RGB ", 42, b"RGB"])
def test_image_decoder_refuses_a_mode_pillow_does_not_know_when_built(mode):
    # ImageDecoder("l") was accepted, then every image failed ("image has wrong mode"): a DecodeError blaming
    # each shard's data, or under on_error="skip" every sample dropped
    from fastdata.decode import ImageDecoder

    with pytest.raises(ValueError, match=r"ImageDecoder: mode must be None or a Pillow mode"):
        ImageDecoder(mode)
    assert ImageDecoder("L")(_png(mode="L"))[0, 0, 0] == 90 and ImageDecoder(None)(_png()).shape == (3, 3, 4)


def test_shard_resize_reads_wide_greyscale_as_the_decoder_does():
    # `fastdata shard --resize` converted a 16-bit greyscale PNG with Pillow's convert("RGB"), which clips at
    # 255: a nearly white image, where the decoder (and torchvision's to_dtype) keep the high byte
    from fastdata.decode import ImageDecoder
    from fastdata.shards._images import BadImage, resize_center_crop

    def encoded(a: np.ndarray, fmt: str) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format=fmt)
        return buf.getvalue()

    photo = encoded(np.full((8, 8), 40000, np.uint16), "PNG")
    assert (resize_center_crop(photo, 4, field="png") == 40000 >> 8).all()
    assert (ImageDecoder()(photo) == 40000 >> 8).all()
    mask = encoded(np.full((8, 8), 7, np.uint16), "PNG")  # 16-bit labels up to 255 keep their values
    assert (resize_center_crop(mask, 4, field="png") == 7).all()
    assert (resize_center_crop(encoded(np.full((8, 8), 9.0, np.float32), "TIFF"), 4, field="tif") == 9).all()
    with pytest.raises(BadImage, match="mode F.*not integers in 0..255"):  # a depth map in [0, 1]: no uint8 holds it
        resize_center_crop(encoded(np.full((8, 8), 0.5, np.float32), "TIFF"), 4, field="tif")


@pytest.mark.parametrize("value", ["no", 0.0, None, np.bool_(True)])
def test_normalize_channels_last_must_be_a_bool(value):
    # Normalize(channels_last="no") was taken as true (ToDtype(scale=) was already checked)
    with pytest.raises(ValueError, match="Normalize: channels_last must be a bool"):
        gpu.Normalize(channels_last=value)


@pytest.mark.parametrize("value", ["false", "False", 0, None, np.bool_(False)])
def test_allow_pickle_must_be_a_bool_not_a_truthy_string(value, tmp_path):
    # SampleDecoder(allow_pickle="false") (a config file's string) was truthy: a shard's pickle ran its code
    import pickle

    from fastdata.dataset import ShardedDataset
    from fastdata.decode import SampleDecoder
    from fastdata.shards.writer import ShardWriter

    with pytest.raises(ValueError, match="allow_pickle must be True or False"):
        SampleDecoder(allow_pickle=value)
    with ShardWriter(tmp_path / "ds") as w:
        w.write({"__key__": "k0", "x.pkl": pickle.dumps([1, 2]), "cls": 0})
    with pytest.raises(ValueError, match="allow_pickle must be True or False"):
        ShardedDataset(tmp_path / "ds", allow_pickle=value)
    assert next(iter(ShardedDataset(tmp_path / "ds", allow_pickle=True)))["x.pkl"] == [1, 2]
    with pytest.raises(DecodeError, match="refusing to unpickle"):
        next(iter(ShardedDataset(tmp_path / "ds")))


def test_packed_images_index_like_a_sequence():
    # info(-1) read the last sample index as a header code and info(n) a size (garbage, silently);
    # tobytes(-1) / tobytes(n) failed with "not enough values to unpack"
    datas = [_png(), b"abc", _png(5, 2)]
    p = PackedImages.pack([EncodedImage(d, shard="s.tar", key=f"k{i}", index=10 + i, epoch=0)
                           for i, d in enumerate(datas)])
    assert p.info(-1) == p.info(2) and p.info(-1).format == "png" and p.info(-2).format == "unknown"
    assert p.tobytes(-1) == datas[2] and p.tobytes(-3) == datas[0] and p.where(-1) == p.where(2)
    for i in (3, -4):
        for method in (p.info, p.tobytes, p.where):
            with pytest.raises(IndexError, match=f"image {i} of 3"):
                method(i)


def test_host_decoding_leaves_the_warnings_filters_alone(monkeypatch):
    # each host decode ran warnings.catch_warnings() (not thread-safe, and it resets every once-only warning):
    # with DecodeImages decoding in the prefetcher's thread, a training loop's warning that Python shows once
    # was shown at every step (194 times in 200 steps)
    import warnings

    from fastdata.gpu import _codec

    shown = []
    batch = collate([{"png": EncodedImage(_png(), shard="s.tar", key=f"k{i}", index=i, epoch=0)} for i in range(2)])
    dec = gpu.DecodeImages(device="cpu", host_decoder="pillow")
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: shown.append(a[0]))
        for _ in range(3):
            warnings.warn("the same warning at every step", UserWarning)
            dec(batch)
    assert len(shown) == 1
    # Pillow's limit still refuses a bomb on the host: before decoding, naming the limit (Image.open warns first)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 11)
    data = _png()
    with pytest.raises(ValueError, match="12 pixels exceeds max_pixels=11"), pytest.warns(Image.DecompressionBombWarning):
        _codec.decode_host(torch.frombuffer(bytearray(data), dtype=torch.uint8), batch["png"].info(0), "pillow")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=["name", "index", "torch-device"])
def test_decode_images_on_cuda_without_cuda_fails_when_built(device):
    # it failed only at the first batch, in the prefetcher's thread, with a bare AssertionError ("Torch not
    # compiled with CUDA enabled"); CUDAPrefetcher(device="cuda") already refused when built
    with pytest.raises(ValueError, match="DecodeImages: device=.*cuda.* but CUDA is not available"):
        gpu.DecodeImages(device=device)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.int16, torch.int32])
def test_normalize_of_wider_integer_images_is_not_a_silent_no_op(dtype):
    # 16-bit images (torchvision.io.decode_image of a 16-bit PNG gives uint16) passed Normalize() untouched:
    # the module docstring promises a ValueError for a batch whose only images it cannot take
    x = torch.randint(0, 30000, (2, 3, 4, 5), dtype=torch.int32).to(dtype)
    with pytest.raises(ValueError, match=rf"Normalize: batch\['img'\] is a {dtype} batch of shape \(2, 3, 4, 5\)"):
        gpu.Normalize()({"img": x, "cls": torch.arange(2)})
    labels = {"boxes": torch.zeros((2, 5, 4), dtype=dtype), "cls": torch.arange(2)}  # no image-like tensor: passes
    assert gpu.Normalize()(labels)["boxes"].dtype == dtype


def test_torchvision_host_path_checks_a_webps_size_before_decoding(monkeypatch):
    # torchvision's decode_image has no header peek: the WebP's size is read by Pillow first (no torchvision here:
    # a stand-in records the calls)
    from types import SimpleNamespace

    from fastdata.gpu import _codec

    calls = []
    fake = SimpleNamespace(ImageReadMode=SimpleNamespace(RGB="RGB"),
                           decode_image=lambda data, mode: calls.append(1) or torch.zeros((3, 80, 100), dtype=torch.uint8))
    monkeypatch.setattr(_codec, "torchvision_status", lambda: (fake, "stand-in"))
    buf = io.BytesIO()
    Image.new("RGB", (100, 80)).save(buf, format="WEBP")
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    info = PackedImages.pack([EncodedImage(buf.getvalue(), shard="s", key="k", index=0, epoch=0)]).info(0)
    with pytest.raises(ValueError, match="8000 pixels exceeds max_pixels=7999"):
        _codec.decode_host(data, info, "torchvision", 7999)
    assert not calls
    assert _codec.decode_host(data, info, "torchvision", 8000).shape == (3, 80, 100) and calls == [1]


def test_hdf5_fixed_shape_one_dimensional_uint8_arrays_come_back_as_arrays(tmp_path):
    # the decoder took every 1-D uint8 array for encoded bytes: an HDF5 "emb.npy" field of shape (8,) failed
    # every sample ("the magic string is not correct"), and a "tokens" field came back as bytes
    pytest.importorskip("h5py")
    from fastdata.dataset import ShardedDataset
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "h5", format="hdf5") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "emb.npy": np.arange(8, dtype=np.uint8) + i, "tokens": np.full(5, i, np.uint8),
                     "txt": f"caption {i}", "jpg": _png(), "cls": i})
    samples = list(ShardedDataset(tmp_path / "h5"))
    assert [s["emb.npy"].tolist() for s in samples] == [list(range(i, i + 8)) for i in range(3)]
    assert all(isinstance(s["tokens"], np.ndarray) and s["tokens"].tolist() == [i] * 5 for i, s in enumerate(samples))
    assert samples[2]["txt"] == "caption 2" and samples[2]["jpg"].shape == (3, 3, 4) and samples[2]["cls"] == 2


def test_an_os2_bmp_is_decoded_not_refused_as_a_bomb():
    # an OS/2 BMP (12-byte BITMAPCOREHEADER: 16-bit width and height) was sniffed with the 32-bit layout of later
    # headers: a 5x3 image "claimed 1572865x196613 pixels" and was refused as over max_pixels
    w, h = 5, 3
    row = bytes([10, 20, 30]) * w + b"\0"
    bmp = b"BM" + struct.pack("<IHHI", 26 + 3 * len(row), 0, 0, 26) + struct.pack("<IHHHH", 12, w, h, 1, 24) + row * h
    assert Image.open(io.BytesIO(bmp)).size == (w, h)
    batch = collate([{"img": EncodedImage(bmp, shard="s.tar", key="k0", index=0, epoch=0)}])
    assert batch["img"].sizes().tolist() == [[h, w]]
    out = gpu.DecodeImages(device="cpu")(batch)["img"].images[0]
    assert out.shape == (3, h, w) and out[:, 0, 0].tolist() == [30, 20, 10]


def test_normalize_before_decode_images_is_not_a_silent_no_op():
    # Compose(Normalize(), DecodeImages(), CenterCrop(8)) gave uint8 images: Normalize saw only encoded images
    # (PackedImages, no tensor) and passed the batch on untouched
    batch = collate([{"png": EncodedImage(_png(), shard="s.tar", key=f"k{i}", index=i, epoch=0), "cls": i}
                     for i in range(2)])
    with pytest.raises(ValueError, match=r"Normalize: batch\['png'\] holds encoded images.*DecodeImages before"):
        gpu.Compose(gpu.Normalize(), gpu.DecodeImages(device="cpu"), gpu.CenterCrop(8))(batch)
    out = gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.CenterCrop(8), gpu.Normalize())(batch)
    assert out["png"].dtype == torch.float32 and out["png"].shape == (2, 3, 8, 8)
    assert gpu.Normalize()({"cls": torch.arange(2), "txt": ["a", "b"]})["cls"].tolist() == [0, 1]  # no images: passes
