"""The decoder libraries behind fastdata.gpu._codec: what "auto" picks, the Pillow-only fallback, and the
same pixels and conventions from every library that loads here (named, not whatever "auto" picks)."""
from __future__ import annotations

import io
import pickle
import struct
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import gpu
from fastdata.gpu import _codec

from tests.helpers.decoders import HOST_DECODERS, unimportable
from tests.helpers.images import jpeg, packed, pillow_rgb

CPU = torch.device("cpu")
LIBRARIES = ("torchcodec", "torchvision", "nvimgcodec")


@pytest.fixture
def fresh_status():
    """The libraries' status re-evaluated in the test (after its monkeypatches) and again after it."""
    statuses = [_codec.torchcodec_status, _codec.torchvision_status, _codec.nvimgcodec_status]
    for s in statuses:
        s.cache_clear()
    yield
    for s in statuses:
        s.cache_clear()


def _loaded(name: str) -> tuple[object, str]:
    return types.SimpleNamespace(name=name), f"{name} (stand-in)"


@pytest.mark.parametrize(("codec", "vision", "want"), [
    (True, (0, 29), "torchcodec"),  # TorchCodec first, wherever it loads
    (True, (0, 26), "torchcodec"),
    (False, (0, 28), "torchvision"),  # torchvision before its decoders were deprecated, without TorchCodec
    (False, (0, 29), "pillow"),  # a deprecated torchvision is no fallback
    (False, None, "pillow"),
])
def test_auto_prefers_torchcodec_then_torchvision_before_0_29_then_pillow(monkeypatch, codec, vision, want):
    monkeypatch.delenv(_codec.DEVICE_DECODER_ENV, raising=False)
    monkeypatch.setattr(_codec, "torchcodec_status", lambda: _loaded("tc") if codec else (None, "missing"))
    monkeypatch.setattr(_codec, "torchvision_status", lambda: _loaded("tv") if vision else (None, "missing"))
    monkeypatch.setattr(_codec, "_torchvision_version", lambda: vision)
    assert _codec.host_backend("auto") == _codec.device_backend("auto") == want
    monkeypatch.setenv(_codec.DEVICE_DECODER_ENV, "torchvision")  # the variable decides the device's "auto"
    assert _codec.device_backend("auto") == "torchvision" and _codec.host_backend("auto") == want


def test_torchcodec_older_than_0_16_is_not_used(monkeypatch, fresh_status):
    old = types.ModuleType("torchcodec")
    old.__version__ = "0.15.0"
    old.decoders = types.ModuleType("torchcodec.decoders")
    monkeypatch.setitem(sys.modules, "torchcodec", old)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", old.decoders)
    lib, reason = _codec.torchcodec_status()
    assert lib is None and reason == "torchcodec 0.15.0 is older than 0.16"
    with pytest.raises(_codec.DecoderUnavailableError, match="'torchcodec' requested but torchcodec 0.15.0 is older"):
        gpu.DecodeImages(device="cpu", host_decoder="torchcodec")


def test_pillow_only_fallback_when_no_library_loads(monkeypatch, fresh_status):
    """Neither TorchCodec, torchvision nor nvImageCodec imports (as on an install without them): "auto"
    decodes with Pillow on both sides, and a library named explicitly says how to install it."""
    unimportable(monkeypatch, "torchcodec", "torchcodec.decoders", "torchvision", "torchvision.io",
                 "nvidia.nvimgcodec")
    monkeypatch.delenv(_codec.DEVICE_DECODER_ENV, raising=False)
    assert _codec.host_backend("auto") == _codec.device_backend("auto") == "pillow"
    datas = [jpeg(0), jpeg(1, mode="L"), jpeg(2, format="PNG"), jpeg(3, progressive=True)]
    stage = gpu.DecodeImages(device="cpu")
    assert stage.resolved_device_decoder == "pillow"
    ib = stage({"jpg": packed(datas)})["jpg"]
    for d, img in zip(datas, ib.images):
        assert torch.equal(img, pillow_rgb(d))
    for name in ("torchcodec", "torchvision"):
        with pytest.raises(_codec.DecoderUnavailableError, match=f"'{name}' requested but .*paired with your torch"):
            _codec.host_backend(name)
    with pytest.raises(_codec.DecoderUnavailableError, match="'torchcodec' requested but"):
        gpu.DecodeImages(device="cpu", device_decoder="torchcodec")
    with pytest.raises(_codec.DecoderUnavailableError, match="no device JPEG decoder here"):
        _codec.decode_device(packed(datas[:1]).views(), CPU)


def test_the_default_cpu_stage_warns_nothing():
    # the host path of "auto" is no deprecated call (torchvision 0.29 warned at every image)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = gpu.DecodeImages(device="cpu")({"jpg": packed([jpeg(i) for i in range(4)] + [jpeg(9, format="PNG")])})
    assert len(out["jpg"].images) == 5


@pytest.mark.parametrize("backend", HOST_DECODERS)
def test_every_host_decoder_gives_pillows_pixels_and_conventions(backend):
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90": never applied (TorchCodec's own decode would)
    rgba = Image.fromarray(np.random.default_rng(3).integers(0, 256, (20, 30, 4), dtype=np.uint8), "RGBA")
    buf = io.BytesIO()
    rgba.save(buf, format="WEBP", lossless=True)
    datas = [jpeg(0), jpeg(1, mode="L"), jpeg(2, mode="CMYK"), jpeg(3, progressive=True),
             jpeg(4, 64, 48, exif=exif.tobytes()), jpeg(5, format="PNG"), jpeg(6, mode="P", format="PNG"),
             jpeg(7, mode="RGBA", format="PNG"), buf.getvalue(), jpeg(8, format="GIF")]
    p = packed(datas)
    for i, d in enumerate(datas):
        out = _codec.decode_host(p.views()[i], p.info(i), backend)
        ref = pillow_rgb(d)
        assert out.dtype == torch.uint8 and out.shape == ref.shape, (backend, i)
        assert (out.int() - ref.int()).abs().max() <= (1 if i < 5 else 0), (backend, i)


@pytest.mark.parametrize("backend", HOST_DECODERS)
def test_every_host_decoder_keeps_a_16_bit_pngs_high_byte(backend):
    values = np.array([[0, 255, 256, 1000, 30000, 65535]], dtype=np.uint16)
    labels = np.array([[0, 3, 7, 255]], dtype=np.uint16)  # a label mask: kept exactly
    for v, want in ((values, values >> 8), (labels, labels)):
        buf = io.BytesIO()
        Image.fromarray(v).save(buf, format="PNG")
        p = packed([buf.getvalue()])
        out = _codec.decode_host(p.views()[0], p.info(0), backend)
        assert out.dtype == torch.uint8 and (out.numpy() == want.astype(np.uint8)).all(), backend


def test_exif_rotated_reads_the_orientation_of_either_byte_order():
    def app1(order: bytes, orientation: int) -> bytes:
        end = "<" if order == b"II" else ">"
        tiff = order + struct.pack(end + "HI", 42, 8) + struct.pack(end + "H", 1)
        tiff += struct.pack(end + "HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(end + "I", 0)
        body = b"Exif\0\0" + tiff
        return b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body

    plain = jpeg(0)
    for order in (b"II", b"MM"):
        for orientation, rotated in ((1, False), (6, True), (8, True), (9, False)):
            data = plain[:2] + app1(order, orientation) + plain[2:]
            assert _codec.exif_rotated(data) is rotated, (order, orientation)
            assert _codec.exif_rotated(np.frombuffer(data, dtype=np.uint8)) is rotated
    assert not _codec.exif_rotated(plain) and not _codec.exif_rotated(jpeg(1, format="PNG"))
    assert not _codec.exif_rotated(plain[:2] + app1(b"II", 6)[:9])  # cut inside the segment
    exif = Image.Exif()
    exif[0x0112] = 3
    assert _codec.exif_rotated(jpeg(2, exif=exif.tobytes()))


def test_torchcodec_device_call_leaves_exif_rotated_jpegs_to_the_host():
    pytest.importorskip("torchcodec")
    if "torchcodec" not in HOST_DECODERS:
        pytest.skip("TorchCodec does not load here")
    exif = Image.Exif()
    exif[0x0112] = 6
    datas = [jpeg(0), jpeg(1, 64, 48, exif=exif.tobytes()), jpeg(2)]
    out = _codec.decode_device(packed(datas).views(), CPU, backend="torchcodec")  # TorchCodec's CPU path
    assert out[1] is None and all(torch.equal(out[i], pillow_rgb(datas[i])) for i in (0, 2))


def test_host_image_decoder_pickles_and_decodes_like_the_stage(monkeypatch):
    datas = [jpeg(0), jpeg(1, format="PNG")]
    for backend in HOST_DECODERS:
        dec = pickle.loads(pickle.dumps(gpu.HostImageDecoder(backend)))
        assert repr(dec) == f"HostImageDecoder({backend!r})"
        for d in datas:
            assert torch.equal(dec(memoryview(d)), pillow_rgb(d)), backend
        with pytest.raises(ValueError, match="exceeds max_pixels=100"):
            gpu.HostImageDecoder(backend, max_pixels=100)(datas[0])
    used: list[str] = []  # which library decodes: a HostImageDecoder() decodes with what "auto" resolves to
    for name, real in list(_codec._HOST_DECODERS.items()):
        monkeypatch.setitem(_codec._HOST_DECODERS, name,
                            lambda data, info, name=name, real=real: used.append(name) or real(data, info))
    pillow = _codec._pillow_rgb
    monkeypatch.setattr(_codec, "_pillow_rgb", lambda data, max_pixels=None: used.append("pillow") or pillow(
        data, max_pixels))
    for d in datas:
        assert torch.equal(gpu.HostImageDecoder()(d), pillow_rgb(d))
    assert used == [_codec.host_backend("auto")] * 2
