"""image_to_tensor's GIL-free path: the same values as np.asarray for every mode, and no Pillow
tobytes (which holds the GIL) for 8-bit modes."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.decode import ImageDecoder, SampleDecoder, image_to_tensor
from fastdata.transforms import ResizeCenterCrop
from tests.helpers.images import chw, pillow_decoded


SIZES = [(1, 1), (2, 1), (1, 3), (3, 5), (7, 2), (16, 16), (223, 224), (224, 223), (333, 127), (640, 481)]
MODES = ["RGB", "L", "P", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "HSV", "LAB", "1", "I", "F", "LA", "La", "PA",
         "I;16", "I;16B"]


def _check(img: Image.Image) -> None:
    t = image_to_tensor(img)
    ref = chw(img)
    assert t.dtype == torch.uint8 and t.is_contiguous()
    assert tuple(t.shape) == ref.shape, (img.mode, img.size)
    assert np.array_equal(t.numpy(), ref), (img.mode, img.size)
    assert t.numpy().flags.writeable


@pytest.mark.parametrize("mode", MODES)
def test_bit_identical_to_asarray_every_mode_and_size(mode):
    rng = np.random.default_rng(len(mode))
    for w, h in SIZES:
        base = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
        if mode == "F":  # float pixels must be integers in 0..255 (np.asarray(dtype=uint8) truncates, wraps)
            with pytest.raises(ValueError, match="a float image"):
                image_to_tensor(Image.fromarray(np.full((h, w), 0.5, dtype=np.float32), "F"))
            base = base.convert("L")
        _check(base.convert(mode))


def test_bit_identical_zero_sized_images():
    for mode in ("RGB", "L", "RGBA", "I"):
        for size in ((0, 4), (5, 0), (0, 0)):
            _check(Image.new(mode, size))


def test_bit_identical_on_decoded_files(tmp_path):
    """Images as the dataset decodes them: JPEG (RGB, greyscale, CMYK), PNG (palette, 16-bit, RGBA),
    each through ImageDecoder with every mode argument, with and without draft."""
    rng = np.random.default_rng(7)
    files = {}
    for i, (w, h) in enumerate([(31, 17), (224, 224), (300, 401), (513, 640)]):
        img = synth_image(rng, w, h)
        files[f"{i}.jpg"] = jpeg_bytes(img, 90)
        files[f"{i}g.jpg"] = jpeg_bytes(img.convert("L"), 85)
        buf = io.BytesIO()
        img.convert("CMYK").save(buf, format="JPEG", quality=90)
        files[f"{i}cmyk.jpg"] = buf.getvalue()
        for mode, kw in (("P", {}), ("RGBA", {}), ("I;16", {}), ("LA", {})):
            buf = io.BytesIO()
            (img.convert("L").convert(mode) if mode in ("I;16", "LA") else img.convert(mode)).save(buf, format="PNG", **kw)
            files[f"{i}{mode.replace(';', '')}.png"] = buf.getvalue()
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    for name in files:
        data = (tmp_path / name).read_bytes()
        for mode in ("RGB", "L", None):
            for draft in (None, 100):
                dec = ImageDecoder(mode, draft_size=draft)
                img = dec.pil(data)
                _check(img)
                assert torch.equal(dec(data), torch.from_numpy(np.array(chw(img), order="C"))), (name, mode)


def test_sample_decoder_and_transform_values_unchanged(tmp_path):
    img = synth_image(np.random.default_rng(3), 333, 250)
    data = jpeg_bytes(img, 90)
    out = SampleDecoder()({"__key__": "k", "jpg": data}, shard="s.tar")["jpg"]
    ref = np.array(ImageDecoder().pil(data))
    assert torch.equal(out, torch.from_numpy(ref).permute(2, 0, 1))
    tf = ResizeCenterCrop(64)
    pil = ImageDecoder().pil(data)
    resized = pil.resize((64, 64), Image.Resampling.BILINEAR, box=tf.crop_box(*pil.size))
    assert torch.equal(tf(pil), torch.from_numpy(np.array(resized)).permute(2, 0, 1))


def test_plain_modes_never_call_tobytes(monkeypatch):
    """np.asarray(img) runs Pillow's tobytes with the GIL held; the 8-bit modes must not use it."""
    def refuse(*a, **k):
        raise AssertionError("tobytes called")

    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, (37, 53, 4), dtype=np.uint8), "RGBA")
    images = {m: base.convert(m) for m in ("RGB", "L", "P", "RGBA", "RGBX", "CMYK", "YCbCr", "HSV")}
    monkeypatch.setattr(Image.Image, "tobytes", refuse)
    for mode, img in images.items():
        assert image_to_tensor(img).shape[1:] == (37, 53), mode


def test_large_conversion_takes_the_gil_free_path(monkeypatch):
    """A big RGB image is converted by Pillow's ``paste`` into NumPy-owned memory (``paste`` releases the
    GIL) and a NumPy band copy, never by ``tobytes`` (GIL held throughout; what ``np.asarray(img)`` runs).
    How long another thread waits for the GIL behind each way: ``benchmarks/decode_gil.py``, recorded in
    docs/design/decode_gil.md (it was a wall-clock threshold here, which failed on a busy machine)."""
    import fastdata.decode as fdecode

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1500, 2000, 3), dtype=np.uint8))
    want = chw(img)
    mapped = []
    real = fdecode._map_array

    def spy(arr, mode):
        mapped.append((arr.shape, arr.dtype, mode))
        return real(arr, mode)

    def refuse(*a, **k):
        raise AssertionError("tobytes called")

    monkeypatch.setattr(fdecode, "_map_array", spy)
    monkeypatch.setattr(Image.Image, "tobytes", refuse)
    t = image_to_tensor(img)
    assert mapped == [((1500, 2000, 4), np.uint8, "RGBX")]  # one paste into a 4-byte-per-pixel NumPy array
    assert np.array_equal(t.numpy(), want) and t.is_contiguous()


def _jpeg_variants(rng: np.random.Generator) -> dict[str, bytes]:
    """JPEGs of odd and even sizes: baseline, progressive, 4:4:4 / 4:2:0, restart markers, grey, CMYK."""
    out = {}
    for w, h in [(1, 1), (7, 3), (16, 16), (33, 17), (224, 224), (301, 399), (640, 481)]:
        img = synth_image(rng, w, h)
        for name, im, kw in [
            ("rgb", img, {"quality": 90}),
            ("prog", img, {"quality": 80, "progressive": True}),
            ("444", img, {"quality": 95, "subsampling": 0}),
            ("rst", img, {"quality": 85, "restart_marker_blocks": 2}),
            ("grey", img.convert("L"), {"quality": 90}),
            ("cmyk", img.convert("CMYK"), {"quality": 90}),
        ]:
            buf = io.BytesIO()
            im.save(buf, format="JPEG", **kw)
            out[f"{name}-{w}x{h}"] = buf.getvalue()
    return out


def _pillowchw(data: bytes, mode: str | None, draft: int | None) -> np.ndarray:
    """What ImageDecoder returned before: Pillow's own load, then np.asarray."""
    return chw(pillow_decoded(data, mode, draft))


def test_jpeg_decoded_into_numpy_is_bit_identical(tmp_path):
    """ImageDecoder decodes JPEGs into NumPy-owned memory: tensors and PIL images equal Pillow's own."""
    files = _jpeg_variants(np.random.default_rng(11))
    for name, data in files.items():
        (tmp_path / f"{name}.jpg").write_bytes(data)
    for name in files:
        data = (tmp_path / f"{name}.jpg").read_bytes()
        for mode in ("RGB", "L", None):
            for draft in (None, 100, 7):
                ref = _pillowchw(data, mode, draft)
                dec = ImageDecoder(mode, draft_size=draft)
                t = dec(data)
                assert t.dtype == torch.uint8 and t.is_contiguous() and t.numpy().flags.writeable
                assert np.array_equal(t.numpy(), ref), (name, mode, draft)
                img = dec.pil(data)
                assert np.array_equal(chw(img), ref), (name, mode, draft)
                # the image is an ordinary PIL image: further operations see the same pixels
                flipped = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
                assert np.array_equal(chw(flipped), ref[:, :, ::-1]), (name, mode, draft)


def test_jpeg_decoded_into_numpy_after_other_images_left_garbage():
    """Uninitialised NumPy memory: every pixel must be written by the decoder, whatever was there."""
    rng = np.random.default_rng(5)
    data = jpeg_bytes(synth_image(rng, 300, 200), 90)
    ref = _pillowchw(data, "RGB", None)
    dec = ImageDecoder()
    for _ in range(20):
        junk = [np.full((200, 300, 4), 255, dtype=np.uint8) for _ in range(4)]
        del junk
        assert np.array_equal(dec(data).numpy(), ref)


def test_truncated_jpeg_still_raises_and_load_truncated_images_matches_pillow(monkeypatch):
    from PIL import ImageFile

    data = jpeg_bytes(synth_image(np.random.default_rng(2), 320, 240), 90)
    cut = data[: len(data) // 2]
    with pytest.raises(OSError):
        ImageDecoder()(cut)
    with pytest.raises(Exception, match="truncated|broken|cannot"):
        SampleDecoder()({"__key__": "k", "jpg": cut}, shard="s.tar")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert np.array_equal(ImageDecoder()(cut).numpy(), _pillowchw(cut, "RGB", None))


def test_sample_decoder_error_names_field_for_corrupt_jpeg():
    from fastdata.errors import DecodeError

    data = jpeg_bytes(synth_image(np.random.default_rng(4), 64, 48), 90)
    bad = data[:200] + bytes(len(data) - 200)
    with pytest.raises(DecodeError, match=r"s\.tar.*'k'.*'jpg'"):
        SampleDecoder()({"__key__": "k", "jpg": bad}, shard="s.tar")


def test_max_pixels_and_bomb_limit_still_checked_before_decoding():
    from fastdata.errors import DecodeError

    data = jpeg_bytes(synth_image(np.random.default_rng(6), 100, 80), 90)
    with pytest.raises(ValueError, match="max_pixels=7999"):
        ImageDecoder(max_pixels=7999)(data)
    with pytest.raises(DecodeError, match="'jpg'.*max_pixels"):
        SampleDecoder(max_pixels=100)({"__key__": "k", "jpg": data}, shard="s.tar")
    assert ImageDecoder(max_pixels=8000)(data).shape == (3, 80, 100)


def test_large_jpeg_in_one_read_bytes_and_memoryview():
    """A JPEG far above Pillow's 64 kB read block is read and decoded in one call: same pixels,
    from bytes and from a memoryview (what tar shards hand over), and truncation still raises."""
    from PIL import ImageFile

    img = synth_image(np.random.default_rng(9), 1600, 1203)
    data = jpeg_bytes(img, 95)
    assert len(data) > 4 * ImageFile.MAXBLOCK
    ref = _pillowchw(data, "RGB", None)
    for src in (data, memoryview(data), memoryview(bytearray(data))):
        assert np.array_equal(ImageDecoder()(src).numpy(), ref)
        out = SampleDecoder()({"__key__": "k", "jpg": src}, shard="s.tar")["jpg"]
        assert np.array_equal(out.numpy(), ref)
    cut = data[: len(data) - 3 * ImageFile.MAXBLOCK]
    with pytest.raises(OSError, match="truncated"):
        ImageDecoder()(cut)
    with pytest.raises(OSError, match="truncated"):
        ImageDecoder()(memoryview(cut))


def test_large_truncated_jpeg_with_load_truncated_images_matches_pillow(monkeypatch):
    from PIL import ImageFile

    data = jpeg_bytes(synth_image(np.random.default_rng(10), 1200, 900), 95)
    cut = data[: len(data) * 2 // 3]
    assert len(cut) > 2 * ImageFile.MAXBLOCK
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    ref = _pillowchw(cut, "RGB", None)
    assert np.array_equal(ImageDecoder()(cut).numpy(), ref)
    assert np.array_equal(ImageDecoder()(memoryview(cut)).numpy(), ref)


def test_threads_decode_and_convert_the_same_as_one_thread():
    """Decoders and conversions running in several threads at once (as the thread decoder runs
    them) give the one-thread results: no memory is shared between calls."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(12)
    datas = [jpeg_bytes(synth_image(rng, int(rng.integers(40, 200)), int(rng.integers(40, 200))), 90)
             for _ in range(24)]
    dec = ImageDecoder()
    tf = ResizeCenterCrop(32)
    ref = [(dec(d), tf(dec.pil(d))) for d in datas]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda d: (dec(d), tf(dec.pil(d))), datas))
            for (a, b), (x, y) in zip(ref, got):
                assert torch.equal(a, x) and torch.equal(b, y)
