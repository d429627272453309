"""ImageDecoder on images off the common path: 16-bit and wide integer or float images, unknown modes,
bytes that are no image."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import gpu
from tests.helpers.images import flat_png


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


def test_an_unidentifiable_image_is_named_by_its_bytes_not_a_memory_address(tmp_path):
    from fastdata import DecodeError, ShardedDataset
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "s") as w:
        w.write({"__key__": "k013", "jpg": b"\xff\xd8garbage", "cls": 0})
    with pytest.raises(DecodeError) as info:
        next(iter(ShardedDataset(tmp_path / "s")))
    msg = str(info.value)
    assert "'k013'" in msg and "'jpg'" in msg and "cannot identify image file" in msg
    assert not re.search("0x[0-9a-f]{6}", msg) and "BytesIO" not in msg and "9 bytes starting b'\\xff\\xd8garbag'" in msg


@pytest.mark.parametrize("mode", ["l", "rgb", "RGB ", 42, b"RGB"])
def test_image_decoder_refuses_a_mode_pillow_does_not_know_when_built(mode):
    # ImageDecoder("l") was accepted, then every image failed ("image has wrong mode"): a DecodeError blaming
    # each shard's data, or under on_error="skip" every sample dropped
    from fastdata.decode import ImageDecoder

    with pytest.raises(ValueError, match=r"ImageDecoder: mode must be None or a Pillow mode"):
        ImageDecoder(mode)
    assert ImageDecoder("L")(flat_png(mode="L"))[0, 0, 0] == 90 and ImageDecoder(None)(flat_png()).shape == (3, 3, 4)
