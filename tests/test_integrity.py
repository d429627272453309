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


# ------------------------------------------------------------- 4: hardlinks and symlinks in tars

def links_tar(tmp_path, name: str = "links.tar", a: bytes = b"AAAA", c: bytes = b"CCCCCC"):
    """GNU-style tar: a.jpg; b.jpg hardlinked to a; c.jpg; d.jpg -> c.jpg; e.jpg and f.jpg leave the archive."""
    import tarfile

    path = tmp_path / name

    def add(tf, info, data=None):
        tf.addfile(info, None if data is None else io.BytesIO(data))

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        info = tarfile.TarInfo("a.jpg")
        info.size = len(a)
        add(tf, info, a)
        info = tarfile.TarInfo("b.jpg")
        info.type, info.linkname = tarfile.LNKTYPE, "a.jpg"
        add(tf, info)
        info = tarfile.TarInfo("c.jpg")
        info.size = len(c)
        add(tf, info, c)
        for n, target in (("d.jpg", "c.jpg"), ("e.jpg", "../../etc/passwd"), ("f.jpg", "/etc/hostname")):
            info = tarfile.TarInfo(n)
            info.type, info.linkname = tarfile.SYMTYPE, target
            add(tf, info)
    return path


LINK_SKIPS = [("e.jpg", "symlink to '../../etc/passwd' points outside the archive (refused)"),
              ("f.jpg", "symlink to '/etc/hostname' points outside the archive (refused)")]


def test_4_tar_links_on_random_access_read(tmp_path):
    from fastdata.shards.tar import TarShardReader

    with pytest.warns(UserWarning, match="skipped 2 member"):
        reader = TarShardReader(links_tar(tmp_path))
        assert reader.keys == ("a", "b", "c", "d")
    assert bytes(reader.read(1)["jpg"]) == b"AAAA"  # hardlink: the target's data
    assert bytes(reader.read(3)["jpg"]) == b"CCCCCC"  # symlink inside the archive: followed
    assert list(reader.index.skipped) == LINK_SKIPS


def test_4_tar_links_in_a_stream(tmp_path):
    from fastdata.shards.tar import iter_tar_stream

    skipped: list = []
    with open(links_tar(tmp_path), "rb") as f, pytest.warns(UserWarning, match="skipped 2 member"):
        samples = list(iter_tar_stream(f, "links.tar", skipped))
    assert [(s["__key__"], bytes(s["jpg"])) for s in samples] == [
        ("a", b"AAAA"), ("b", b"AAAA"), ("c", b"CCCCCC"), ("d", b"CCCCCC")]
    assert skipped == LINK_SKIPS


def test_4_tar_links_in_conversion(tmp_path):
    from fastdata.shards.convert import ConvertOptions, convert
    from fastdata.shards.tar import TarShardReader

    a, c = jpeg(8, 8, 1), jpeg(8, 8, 2)
    with pytest.warns(UserWarning, match="skipped 2 member"):
        result = convert(links_tar(tmp_path, a=a, c=c), tmp_path / "out", ConvertOptions(workers=1, progress=False))
    got = {s["__key__"]: bytes(s["jpg"]) for s in TarShardReader(tmp_path / "out" / "shard-000000.tar")}
    assert got == {"a": a, "b": a, "c": c, "d": c}
    assert [(s["source"], s["reason"]) for s in result.manifest.skipped] == [
        (f"links.tar:{n}", r) for n, r in LINK_SKIPS]
