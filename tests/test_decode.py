"""Field decoding (each kind, pickle refusal) and the deterministic transforms."""
from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.decode import ImageDecoder, SampleDecoder, image_to_tensor, is_image_field, suffix
from fastdata.errors import DecodeError
from fastdata.transforms import Deterministic, ResizeCenterCrop


def _png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def test_suffix_rules():
    assert suffix("seg.PNG") == "png"
    assert is_image_field("jpg") and is_image_field("left.webp") and not is_image_field("img.npy")


def test_default_decoders_each_kind():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    sample = {
        "__key__": "a/b",
        "png": _png(rgb),
        "img.npy": _npy(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "cls": b"7",
        "txt": "héllo".encode(),
        "json": json.dumps({"x": [1, 2]}).encode(),
        "bin": b"\x00\x01",
    }
    out = SampleDecoder()(sample, shard="s.tar")
    assert out["__key__"] == "a/b"
    assert out["png"].dtype == torch.uint8 and out["png"].shape == (3, 5, 7)
    assert torch.equal(out["png"], torch.from_numpy(rgb).permute(2, 0, 1))
    assert out["png"].is_contiguous()
    np.testing.assert_array_equal(out["img.npy"], np.arange(6, dtype=np.int16).reshape(2, 3))
    assert out["cls"] == 7 and isinstance(out["cls"], int)
    assert out["txt"] == "héllo"
    assert out["json"] == {"x": [1, 2]}
    assert out["bin"] == b"\x00\x01"


def test_jpeg_and_webp_and_grayscale_to_rgb():
    img = synth_image(np.random.default_rng(1), 40, 30)
    buf = io.BytesIO()
    img.save(buf, format="WEBP")
    gray = _png(np.full((4, 4), 9, dtype=np.uint8))
    out = SampleDecoder()({"__key__": "k", "jpg": jpeg_bytes(img, 90), "webp": buf.getvalue(), "g.png": gray},
                          shard="s")
    assert out["jpg"].shape == (3, 30, 40) and out["webp"].shape == (3, 30, 40)
    assert out["g.png"].shape == (3, 4, 4)  # RGB by default, like torchvision's ImageFolder
    mask = SampleDecoder({"g.png": ImageDecoder(mode="L")})({"__key__": "k", "g.png": gray}, shard="s")
    assert mask["g.png"].shape == (1, 4, 4) and int(mask["g.png"][0, 0, 0]) == 9


def test_decode_false_and_mapping():
    sample = {"__key__": "k", "cls": b"3", "txt": b"x"}
    assert SampleDecoder(False)(sample, shard="s") is sample
    out = SampleDecoder({"cls": lambda b: int(b) * 10, "txt": None})(sample, shard="s")
    assert out == {"__key__": "k", "cls": 30, "txt": b"x"}
    with pytest.raises(TypeError, match=r"decode\['cls'\] must be callable"):
        SampleDecoder({"cls": 3})  # type: ignore[dict-item]


def test_non_bytes_values_pass_through():
    arr = np.zeros((3, 2, 2), dtype=np.uint8)
    out = SampleDecoder()({"__key__": "k", "img.npy": arr, "cls": np.int64(4)}, shard="s")
    assert out["img.npy"] is arr and out["cls"] == 4 and isinstance(out["cls"], int)


@pytest.mark.parametrize("field", ["pickle", "pyd", "pkl", "pth", "meta.pt"])
def test_pickle_members_are_refused(field):
    sample = {"__key__": "evil", field: pickle.dumps({"a": 1})}
    with pytest.raises(DecodeError, match=rf"shard-7\.tar: sample 'evil' field '{field}': refusing to unpickle"):
        SampleDecoder()(sample, shard="shard-7.tar")


def test_object_npy_is_refused():
    sample = {"__key__": "k", "npy": _npy(np.array([{"a": 1}], dtype=object))}
    with pytest.raises(DecodeError, match=r"s\.tar: sample 'k' field 'npy': ValueError"):
        SampleDecoder()(sample, shard="s.tar")


def test_allow_pickle():
    out = SampleDecoder(allow_pickle=True)({"__key__": "k", "pyd": pickle.dumps([1, 2])}, shard="s")
    assert out["pyd"] == [1, 2]
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3)}, buf)
    out = SampleDecoder(allow_pickle=True)({"__key__": "k", "pth": buf.getvalue()}, shard="s")
    assert torch.equal(out["pth"]["w"], torch.arange(3))


def test_corrupt_image_names_shard_key_field():
    with pytest.raises(DecodeError, match=r"shard-1\.tar: sample 'cat/01' field 'jpg': UnidentifiedImageError"):
        SampleDecoder()({"__key__": "cat/01", "jpg": b"not a jpeg"}, shard="shard-1.tar")
    with pytest.raises(DecodeError, match=r"field 'cls': ValueError"):
        SampleDecoder()({"__key__": "k", "cls": b"seven"}, shard="s")


def test_draft_only_for_large_jpegs():
    data = jpeg_bytes(synth_image(np.random.default_rng(2), 640, 500), 85)
    assert ImageDecoder(draft_size=256).pil(data).size == (640, 500)  # shorter side < 2x: full decode
    assert ImageDecoder(draft_size=120).pil(data).size == (160, 125)  # 1/4 scale, still >= 120
    assert ImageDecoder(draft_size=128).pil(data).size == (320, 250)  # 1/4 would give 125 < 128
    assert ImageDecoder(draft_size=200).pil(data).size == (320, 250)


def _reference_resize_crop(img: Image.Image, size: int, resize: int) -> np.ndarray:
    w, h = img.size
    nw, nh = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
    big = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = int(round((nw - size) / 2)), int(round((nh - size) / 2))
    return np.asarray(big.crop((left, top, left + size, top + size))).transpose(2, 0, 1)


@pytest.mark.parametrize("wh", [(640, 480), (300, 517), (256, 256), (225, 400)])
def test_resize_center_crop_matches_resize_then_crop(wh):
    img = synth_image(np.random.default_rng(3), *wh)
    t = ResizeCenterCrop(224)
    out = t(img)
    assert out.shape == (3, 224, 224) and out.dtype == torch.uint8 and out.is_contiguous()
    ref = _reference_resize_crop(img, 224, 256)
    diff = np.abs(out.numpy().astype(int) - ref.astype(int))
    assert diff.max() <= 2 and diff.mean() < 0.5
    # tensors are accepted too and give the same result
    assert torch.equal(t(image_to_tensor(img)), out)


def test_resize_center_crop_params_and_fingerprint():
    t = ResizeCenterCrop(224)
    assert t.resize == 256 and t.target_size == 256
    assert ResizeCenterCrop((100, 120), resize=150)(synth_image(np.random.default_rng(0), 300, 200)).shape == (3, 100, 120)
    assert t.fingerprint != ResizeCenterCrop(224, resize=240).fingerprint
    assert t.fingerprint == ResizeCenterCrop(224).fingerprint and "v1" in t.fingerprint
    with pytest.raises(ValueError, match=r"resize must be an int >= max\(size\)=224, got 200"):
        ResizeCenterCrop(224, resize=200)
    with pytest.raises(ValueError, match="size must be"):
        ResizeCenterCrop(0)
    with pytest.raises(ValueError, match="interpolation must be one of"):
        ResizeCenterCrop(10, interpolation="cubic")
    with pytest.raises(TypeError, match=r"uint8 \(C, H, W\)"):
        t(torch.zeros(3, 4, 4))


def test_deterministic_wrapper():
    d = Deterministic(lambda x: x * 2, version="2", name="double")
    assert d(3) == 6 and d.fingerprint == "Deterministic(name=double,version=2)"
    assert Deterministic(abs, version="1").name == "abs"
    with pytest.raises(ValueError, match="version must be a non-empty string, got ''"):
        Deterministic(abs, version="")
    with pytest.raises(ValueError, match="version must be a non-empty string"):
        Deterministic(abs, version=None)  # type: ignore[arg-type]
