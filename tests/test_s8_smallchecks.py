"""Session 8 "smallchecks": small argument defects other helpers noticed (contract.md 8, 9, 10, 12; decode.md)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fastdata import Cache, RemoteShards, ShardedDataset, ShardWriter
from fastdata.decode import ImageDecoder
from fastdata.gpu import Normalize
from fastdata.transforms import Deterministic


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((4, 5), 7, np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()


def _write(dest, n=2):
    with ShardWriter(dest) as w:
        for i in range(n):
            w.write({"__key__": f"k{i}", "cls": i, "seg.png": _png()})
    return w.manifest


# ----- Deterministic: name= and accepts_pil= typed (contract.md item 8) ----------------------------
@pytest.mark.parametrize("kw", [{"name": 5}, {"name": ""}, {"name": b"f"}, {"accepts_pil": "no"},
                                {"accepts_pil": 1}, {"accepts_pil": None}])
def test_deterministic_refuses_a_non_string_name_and_a_non_bool_accepts_pil(kw):
    # accepts_pil="no" is truthy: PIL images were passed, and the cache key said ",accepts_pil"
    with pytest.raises(ValueError, match=next(iter(kw))):
        Deterministic(lambda x: x, version="1", **kw)
    d = Deterministic(lambda x: x, version="1", name="f", accepts_pil=True)
    assert d.fingerprint == "Deterministic(name=f,version=1,accepts_pil)"


# ----- RemoteShards / Cache sizes and folders (item 9) ------------------------------------------------
@pytest.mark.parametrize("value", [1.5, 0.5, 1e9 + 0.5, float("nan"), True])
def test_remote_shards_refuses_a_fractional_or_bool_max_bytes(value):
    # max_bytes=1.5 (meant as 1.5 GB) became a limit of 1 byte
    with pytest.raises(ValueError, match="max_bytes"):
        RemoteShards("https://example.invalid/ds", max_bytes=value)
    assert RemoteShards("https://example.invalid/ds", max_bytes=2e9).max_bytes == 2_000_000_000
    assert RemoteShards("https://example.invalid/ds", max_bytes="1.5GB").max_bytes == 1_500_000_000


def test_remote_shards_refuses_an_empty_cache_dir():
    # '' was the current folder
    with pytest.raises(ValueError, match="cache_dir"):
        RemoteShards("https://example.invalid/ds", cache_dir="")


def test_cache_takes_size_strings_as_remote_shards_does(tmp_path):
    assert Cache(tmp_path, max_bytes="500GB").max_bytes == 500_000_000_000
    assert Cache(tmp_path, max_bytes="1GiB").max_bytes == 1 << 30
    assert Cache(tmp_path, max_bytes=2e9).max_bytes == 2_000_000_000
    for bad in ("lots", 1.5, True, 0, "0", -1):
        with pytest.raises(ValueError, match="max_bytes"):
            Cache(tmp_path, max_bytes=bad)


# ----- gpu.Normalize: strings and bytes are not sequences of numbers (item 10) ---------------------
@pytest.mark.parametrize("kw", [{"mean": b"x", "std": b"x"}, {"mean": "5", "std": "5"},
                                {"mean": (0.5,), "std": bytearray(b"\x01")}, {"mean": (True,), "std": (1.0,)}])
def test_normalize_refuses_strings_bytes_and_bools(kw):
    with pytest.raises(ValueError, match="Normalize: (mean|std)"):
        Normalize(**kw)
    assert Normalize(mean=np.array([0.5]), std=[0.25]).mean == (0.5,)


# ----- "~" expanded in local path arguments, as Cache does (item 12) --------------------------------
def test_shard_writer_and_sharded_dataset_expand_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    _write("~/out")
    assert not (work / "~").exists()  # a folder literally named "~" was made in the current folder
    assert (tmp_path / "home" / "out" / "manifest.json").is_file()
    assert len(ShardedDataset("~/out")) == 2
    tar = min((tmp_path / "home" / "out").glob("*.tar")).name
    assert len(ShardedDataset(f"~/out/{tar}")) == 2
    assert len(ShardedDataset([f"~/out/{tar}"])) == 2


# ----- decode= keys that match no field (decode.md) ----------------------------------------------------
@pytest.mark.parametrize("key", [".png", "PNG", "mask.png", "seg"])
def test_decode_key_matching_no_field_is_refused_naming_it_and_the_fields(tmp_path, key):
    # {".png": ImageDecoder(None)} matched nothing: the mask came out as RGB (3, H, W), with no error
    _write(tmp_path / "ds")
    with pytest.raises(ValueError, match=rf"decode=.*'{key}'.*(?s:seg\.png)"):
        ShardedDataset(tmp_path / "ds", decode={key: ImageDecoder(None)})


def test_decode_keys_naming_a_field_or_its_suffix_still_work(tmp_path):
    _write(tmp_path / "ds")
    for key in ("png", "seg.png"):
        ds = ShardedDataset(tmp_path / "ds", decode={key: ImageDecoder(None)})
        assert tuple(next(iter(ds))["seg.png"].shape) == (1, 4, 5)  # as stored, not RGB
    assert next(iter(ShardedDataset(tmp_path / "ds", decode={"cls": None})))["cls"] == b"0"
    # a mapping shared with datasets of other formats names suffixes this one lacks: not a typo
    shared = {"jpg": ImageDecoder(None), "webp": ImageDecoder(None), "png": ImageDecoder(None), "npy": None}
    assert tuple(next(iter(ShardedDataset(tmp_path / "ds", decode=shared)))["seg.png"].shape) == (1, 4, 5)
