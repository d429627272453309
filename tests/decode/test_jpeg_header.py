"""ImageDecoder's short way for JPEGs: a header scan and Pillow's libjpeg decoder called directly, no
``Image.open``. Same pixels, mode, size, ``info`` and errors as Pillow's own open + draft + load."""
from __future__ import annotations

import io
import re
import struct
import warnings

import numpy as np
import pytest
from PIL import Image, ImageFile

import fastdata.decode as fdecode
from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.decode import ImageDecoder, SampleDecoder
from fastdata.errors import DecodeError
from tests.helpers.images import chw, pillow_decoded


def _save(img: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _variants() -> dict[str, tuple[bytes, bool]]:
    """name -> (JPEG bytes, plain: no metadata beyond JFIF)."""
    rng = np.random.default_rng(3)
    out: dict[str, tuple[bytes, bool]] = {}
    for w, h in [(1, 1), (9, 5), (301, 399), (640, 481)]:
        img = synth_image(rng, w, h)
        out[f"rgb-{w}x{h}"] = (_save(img, quality=90), True)
        out[f"prog-{w}x{h}"] = (_save(img, quality=80, progressive=True), True)
        out[f"444-{w}x{h}"] = (_save(img, quality=95, subsampling=0), True)
        out[f"rst-{w}x{h}"] = (_save(img, quality=85, restart_marker_blocks=2), True)
        out[f"grey-{w}x{h}"] = (_save(img.convert("L"), quality=90), True)
        out[f"cmyk-{w}x{h}"] = (_save(img.convert("CMYK"), quality=90), False)  # Adobe APP14
    img = synth_image(rng, 120, 80)
    out["dpi-inch"] = (_save(img, dpi=(300, 300)), True)
    out["dpi-cm"] = (_save(img, dpi=(300, 300)).replace(b"JFIF\x00\x01\x01\x01", b"JFIF\x00\x01\x01\x02", 1), True)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    out["exif"] = (_save(img, exif=exif), False)
    out["icc"] = (_save(img, icc_profile=b"\x00" * 300), False)
    out["comment"] = (_save(img, comment=b"hello"), False)
    plain = _save(img, quality=90)  # no JFIF segment at all
    out["no-jfif"] = (plain[:2] + plain[2 + 2 + struct.unpack(">H", plain[4:6])[0]:], True)
    return out


@pytest.fixture
def opens(monkeypatch):
    """Counts the decoder's trips through ``Image.open``."""
    calls = []
    real = fdecode.open_image

    def counted(data):
        calls.append(1)
        return real(data)

    monkeypatch.setattr(fdecode, "open_image", counted)
    return calls


def test_same_pixels_mode_size_and_info_aspillow_decoded(opens):
    for name, (data, plain) in _variants().items():
        for mode in ("RGB", "L", None):
            for draft in (None, 100, 3):
                ref = pillow_decoded(data, mode, draft)
                dec = ImageDecoder(mode, draft_size=draft)
                del opens[:]
                t = dec(data)
                assert not opens, f"{name}: tensors never need Image.open"
                assert np.array_equal(t.numpy(), chw(ref)), (name, mode, draft)
                img = dec.pil(data)
                assert len(opens) == (0 if plain else 1), (name, "metadata keeps the full open" if not plain else "")
                assert (img.mode, img.size) == (ref.mode, ref.size), (name, mode, draft)
                assert np.array_equal(chw(img), chw(ref)), (name, mode, draft)
                assert img.info == ref.info, (name, mode, draft)
                if img.mode == Image.open(io.BytesIO(data)).mode:  # not converted: still says JPEG
                    assert img.format == "JPEG", name


def test_metadata_kept_for_pil_images():
    data, _ = _variants()["exif"]
    img = ImageDecoder().pil(data)
    assert img.getexif()[0x0112] == 6
    assert ImageDecoder().pil(_variants()["icc"][0]).info["icc_profile"] == b"\x00" * 300
    assert ImageDecoder().pil(_variants()["comment"][0]).info["comment"] == b"hello"


def test_short_way_builds_no_image_file(monkeypatch):
    """The point of the short way: none of ImageFile's Python (plugin search, per-marker handlers)."""
    data = jpeg_bytes(synth_image(np.random.default_rng(1), 200, 150), 90)
    ref = chw(pillow_decoded(data, "RGB", None))

    def refuse(*a, **k):
        raise AssertionError("ImageFile constructed")

    monkeypatch.setattr(ImageFile.ImageFile, "__init__", refuse)
    assert np.array_equal(ImageDecoder()(data).numpy(), ref)
    assert np.array_equal(ImageDecoder()(memoryview(data)).numpy(), ref)
    assert np.array_equal(chw(ImageDecoder().pil(data)), ref)


def _sof_at(data: bytes) -> int:
    i = 2
    while data[i + 1] not in (0xC0, 0xC2):
        i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
    return i


def _text(err: BaseException) -> str:
    # Pillow's "cannot identify image file <_io.BytesIO object at 0x...>" is fastdata's
    # "cannot identify image file: N bytes starting b'...'" (open_image names the bytes, not the stream)
    return re.sub(r"cannot identify image file.*", "cannot identify image file", re.sub(r"0x[0-9a-fA-F]+", "0x?", str(err)))


def _pillow_error(data: bytes) -> tuple[type, str]:
    try:
        Image.open(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - the reference error, whatever it is
        return type(e), _text(e)
    raise AssertionError("Pillow decoded it")


def _broken_headers() -> dict[str, bytes]:
    data = jpeg_bytes(synth_image(np.random.default_rng(2), 64, 48), 90)
    sof = _sof_at(data)
    twelve = bytearray(data)
    twelve[sof + 4] = 12  # 12-bit samples
    two = bytearray(data)
    two[sof + 9] = 2  # two components
    past = bytearray(data)
    past[4:6] = struct.pack(">H", len(data))  # first segment claims to run past the end
    return {
        "12-bit": bytes(twelve),
        "2-components": bytes(two),
        "length-past-end": bytes(past),
        "junk-between-segments": data[:sof] + b"\x00\x11" + data[sof:],
        "header-cut": data[:sof + 5],
        "scan-zeroed": data[: len(data) // 2] + bytes(len(data) - len(data) // 2),
        "cut-in-scan": data[: len(data) * 2 // 3],
        "no-sof": data[:sof] + data[sof + 2 + struct.unpack(">H", data[sof + 2:sof + 4])[0]:],
        "not-jpeg-at-all": b"\xff\xd8\xff" + bytes(100),
    }


@pytest.mark.parametrize("name", list(_broken_headers()))
def test_bad_jpegs_raise_what_pillow_raises(name):
    data = _broken_headers()[name]
    try:
        want = _pillow_error(data)
    except AssertionError:  # Pillow decodes it (libjpeg tolerates some damage): so must we, identically
        ref = chw(pillow_decoded(data, "RGB", None))
        assert np.array_equal(ImageDecoder()(data).numpy(), ref)
        return
    for call in (ImageDecoder(), ImageDecoder().pil):
        with pytest.raises(want[0]) as err:
            call(data)
        assert _text(err.value) == want[1], name
    with pytest.raises(DecodeError, match=r"s\.tar.*'k'.*'jpg'"):
        SampleDecoder()({"__key__": "k", "jpg": data}, shard="s.tar")


def test_header_scan_leaves_unusual_files_topillow_decoded():
    data = jpeg_bytes(synth_image(np.random.default_rng(4), 40, 30), 90)
    assert fdecode._jpeg_header(data) is not None
    for name, bad in _broken_headers().items():
        if name not in ("scan-zeroed", "cut-in-scan"):
            assert fdecode._jpeg_header(bad) is None, name
    mpf = data[:2] + b"\xff\xe2\x00\x08MPF\x00\x00\x00" + data[2:]  # a multi-picture (MPO) marker
    assert fdecode._jpeg_header(mpf) is None
    assert fdecode._jpeg_header(b"\x89PNG\r\n\x1a\n" + bytes(40)) is None


def test_bomb_and_max_pixels_checked_before_decoding(monkeypatch):
    data = jpeg_bytes(synth_image(np.random.default_rng(6), 100, 80), 90)
    decoded = []
    real = Image.core.jpeg_decoder
    monkeypatch.setattr(Image.core, "jpeg_decoder", lambda *a: decoded.append(1) or real(*a))
    with pytest.raises(ValueError, match="max_pixels=7999"):
        ImageDecoder(max_pixels=7999)(data)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)
    with pytest.raises(Image.DecompressionBombError):
        ImageDecoder()(data)
    assert not decoded
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 6000)
    with pytest.warns(Image.DecompressionBombWarning):
        assert ImageDecoder()(data).shape == (3, 80, 100)
    assert decoded
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ImageDecoder()(data).shape == (3, 80, 100)


def test_load_truncated_images_goes_throughpillow_decoded(monkeypatch, opens):
    data = jpeg_bytes(synth_image(np.random.default_rng(8), 320, 240), 90)
    cut = data[: len(data) // 2]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert np.array_equal(ImageDecoder()(cut).numpy(), chw(pillow_decoded(cut, "RGB", None)))
    assert opens


def test_open_image_asks_the_named_plugin_first(monkeypatch):
    """Once every plugin is registered (``Image.init()``), plugins without a prefix check (IM) come
    before JPEG; ``open_image`` goes to the JPEG and PNG plugins first, and still opens anything else."""
    from PIL import ImImagePlugin

    Image.init()
    monkeypatch.setattr(Image, "ID", ["IM", *[f for f in Image.ID if f != "IM"]])
    tried = []
    real = ImImagePlugin.ImImageFile._open

    def counted(self):
        tried.append(1)
        return real(self)

    monkeypatch.setattr(ImImagePlugin.ImImageFile, "_open", counted)
    img = synth_image(np.random.default_rng(9), 20, 10)
    for fmt in ("JPEG", "PNG"):
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        assert fdecode.open_image(buf.getvalue()).format == fmt
        assert not tried, fmt
    buf = io.BytesIO()
    img.save(buf, format="BMP")
    assert fdecode.open_image(buf.getvalue()).format == "BMP"
    with pytest.raises(Image.UnidentifiedImageError):
        fdecode.open_image(b"\xff\xd8\xff" + bytes(30))


def test_device_decode_host_fallback_decodes_the_same_and_refuses_bombs(monkeypatch):
    """image_decode="device" without torchvision decodes on the host with ImageDecoder: same pixels,
    read from the packed buffer's memory, and an image over Pillow's bomb limit is refused there."""
    import torch

    from fastdata.dataset._packed import ImageInfo, sniff
    from fastdata.gpu._codec import decode_host

    img = synth_image(np.random.default_rng(12), 90, 70)
    for data in (_save(img, quality=90), _save(img.convert("CMYK"), quality=90), _save(img.convert("L"))):
        packed = torch.frombuffer(bytearray(b"xx" + data + b"yy"), dtype=torch.uint8)[2:-2]
        out = decode_host(packed, ImageInfo(sniff(data)), "pillow")
        assert out.shape == (3, 70, 90) and out.is_contiguous()
        assert np.array_equal(out.numpy(), chw(pillow_decoded(data, "RGB", None)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 90 * 70 - 1)
    with pytest.raises(ValueError, match="exceeds max_pixels"):
        decode_host(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageInfo(sniff(data)), "pillow")
