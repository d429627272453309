"""Issue 13: nothing lost silently. One test (or more) per item of the issue, on generated data.

Trust no metadata (manifest counts, shard identity, HDF5 shapes), report every skip, name every failure.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from PIL import Image

from fastdata.errors import DecodeError


def jpeg(w: int, h: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


# ----------------------------------------------------------------------- 12: decompression bombs

def test_12_pillow_bomb_warning_is_visible(monkeypatch):
    from fastdata.decode import SampleDecoder

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 40x40 = 1600: over the limit, under 2x
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = SampleDecoder()({"__key__": "k", "jpg": jpeg(40, 40)}, shard="s.tar")
    assert out["jpg"].shape == (3, 40, 40)
    assert any(issubclass(w.category, Image.DecompressionBombWarning) for w in caught)


def test_12_max_pixels_refuses_before_decoding():
    from fastdata.decode import ImageDecoder, SampleDecoder

    data = jpeg(64, 48)
    with pytest.raises(DecodeError, match=r"shard-3.tar: sample 'big' field 'jpg'.*64x48 = 3072 pixels exceeds "
                                          r"max_pixels=3000"):
        SampleDecoder(max_pixels=3000)({"__key__": "big", "jpg": data}, shard="shard-3.tar")
    assert SampleDecoder(max_pixels=3072)({"__key__": "ok", "jpg": data}, shard="s")["jpg"].shape == (3, 48, 64)
    assert ImageDecoder(max_pixels=None).pil(data).size == (64, 48)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_pixels must be an int >= 1 or None"):
            ImageDecoder(max_pixels=bad)
