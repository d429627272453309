"""Session 8 "leftovers": defects another helper noticed outside its area (contract.md), each fixed here."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fastdata import ShardedDataset, ShardWriter


def _write(dest, n=3, **kw):
    with ShardWriter(dest, **kw) as w:
        for i in range(n):
            w.write({"__key__": f"k{i}", "cls": i})
    return w.manifest


def test_shard_writer_overwrite_must_be_a_bool_not_a_truthy_string(tmp_path):
    dest = tmp_path / "ds"
    _write(dest, 3)
    for value in ("no", "false", 0.0, None, 1):
        with pytest.raises(ValueError, match="overwrite must be True or False"):
            ShardWriter(dest, overwrite=value)
    assert json.loads((dest / "manifest.json").read_text())["shards"][0]["num_samples"] == 3


@pytest.mark.parametrize("kw", [{"max_bytes": True}, {"max_samples": True}, {"max_samples": False},
                                {"extra": ""}, {"extra": 0}, {"extra": []}, {"extra": "x"}, {"extra": [("a", 1)]},
                                {"format": ["tar"]}])
def test_shard_writer_refuses_bools_for_sizes_and_non_mappings_for_extra(tmp_path, kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        ShardWriter(tmp_path / "ds", **kw)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("dest", ["", b"ds", None])
def test_shard_writer_refuses_an_empty_or_non_path_dest(tmp_path, monkeypatch, dest):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="dest must be a non-empty path"):
        ShardWriter(dest, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


_ODD = {"u.npy": np.array(["ab", "cde"]), "b.npy": np.array([b"x", b"yz"]),
        "s.npy": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
        "t.npy": np.array(["2020-01-01"], dtype="M8[D]"), "i.npy": np.arange(3, dtype=">i4")}


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_unicode_bytes_structured_and_datetime_arrays_get_parsable_dtypes_and_read_back(tmp_path, fmt):
    with ShardWriter(tmp_path / "ds", format=fmt) as w:
        for k in range(2):
            w.write({"__key__": f"k{k}", **_ODD})
    fields = {f.name: f for f in w.manifest.fields}
    for name, value in _ODD.items():
        dtype = fields[name].dtype
        assert dtype is None or np.dtype(dtype) == value.dtype, (name, dtype)
    assert fields["u.npy"].dtype == "<U3" and fields["i.npy"].dtype == ">i4"
    samples = list(ShardedDataset(tmp_path / "ds"))
    assert len(samples) == 2
    for s in samples:
        for name, value in _ODD.items():
            assert s[name].dtype == value.dtype and (s[name] == value).all(), name


def test_a_manifest_with_the_old_unparsable_dtype_names_still_reads(tmp_path):
    dest = tmp_path / "ds"
    with ShardWriter(dest) as w:
        w.write({"__key__": "a", "u.npy": np.array(["ab"]), "s.npy": np.zeros(1, dtype="i4,f8")})
    m = json.loads((dest / "manifest.json").read_text())
    for f in m["fields"]:
        f["dtype"] = {"u.npy": "str64", "s.npy": "void96"}[f["name"]]
    (dest / "manifest.json").write_text(json.dumps(m))
    (s,) = list(ShardedDataset(dest))
    assert s["u.npy"].tolist() == ["ab"]


def _jpeg_shards(dest, n=3):
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    with ShardWriter(dest) as w:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buf, "JPEG")
            w.write({"__key__": f"k{i}", "jpg": buf.getvalue(), "cls": i})
    return dest


def test_a_store_refused_for_its_size_is_not_left_listed(tmp_path):
    from fastdata.cache import Cache
    from fastdata.errors import CacheError

    cache = Cache(tmp_path / "c", max_bytes=10)
    store = cache.open_store(fingerprint="big", num_samples=4)
    with pytest.raises(CacheError, match="does not fit in max_bytes=10"):
        store.put(0, {"img": np.zeros((3, 4, 4), np.uint8)})
    assert [i.fingerprint for i in cache.list()] == ["big"]  # still open here: it stays
    store.close()
    assert cache.list() == [] and not store.path.exists()
    ok = Cache(tmp_path / "c").open_store(fingerprint="big", num_samples=4)  # with room, it is made anew and fills
    ok.put(0, {"img": np.ones((3, 4, 4), np.uint8)})
    ok.close()
    (info,) = Cache(tmp_path / "c").list()
    assert info.num_valid == 1 and "refused" not in (info.path / "meta.json").read_text()


def _no_preprocessing(monkeypatch):
    from fastdata.transforms import ResizeCenterCrop

    def refuse(self, *a, **k):  # a test that fails must not allocate the 30 GB crop it is about
        raise AssertionError("preprocessing ran: the store size was not checked first")
    monkeypatch.setattr(ResizeCenterCrop, "__call__", refuse)


def test_cache_build_refuses_a_store_over_max_bytes_before_any_worker_and_leaves_nothing(tmp_path, capsys,
                                                                                          monkeypatch):
    from fastdata.cli import main

    shards = _jpeg_shards(tmp_path / "s")
    _no_preprocessing(monkeypatch)
    code = main(["cache", "build", str(shards), "--cache", str(tmp_path / "c"), "--max-bytes", "10", "--workers", "0",
                 "-q"])
    err = capsys.readouterr().err
    assert code == 1 and "3 samples" in err and "does not fit in --max-bytes 10" in err, err
    assert not (tmp_path / "c").exists()


def test_cache_build_with_an_absurd_size_says_why_before_any_worker(tmp_path, capsys, monkeypatch):
    from fastdata.cli import main

    shards = _jpeg_shards(tmp_path / "s")
    _no_preprocessing(monkeypatch)
    code = main(["cache", "build", str(shards), "--cache", str(tmp_path / "c"), "--size", "100000", "--workers", "0",
                 "-q"])
    err = capsys.readouterr().err
    assert code == 1 and "--size 100000: one image is 3x100000x100000 uint8 = 30.0 GB" in err, err
    assert not (tmp_path / "c").exists()


def test_cache_build_refuses_a_store_larger_than_the_free_disk(tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    from fastdata.cli import main

    shards = _jpeg_shards(tmp_path / "s")
    _no_preprocessing(monkeypatch)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    code = main(["cache", "build", str(shards), "--cache", str(tmp_path / "c"), "--size", "64", "--workers", "0", "-q"])
    err = capsys.readouterr().err
    assert code == 1 and "does not fit on its disk (1.0 kB free)" in err, err
    assert not (tmp_path / "c").exists()


def test_file_urls_are_local_paths_for_shard_writer_and_shard_sources(tmp_path, monkeypatch):
    from fastdata.shards._sources import list_source

    monkeypatch.chdir(tmp_path)
    m = _write(f"file://{tmp_path}/ds", 2)  # was a folder literally named 'file:' in the current folder
    assert m.num_samples == 2 and (tmp_path / "ds" / "manifest.json").is_file() and not (tmp_path / "file:").exists()
    assert len(list_source(f"file://{tmp_path}/ds").keys) == 2  # was "SRC file://...: no such file or directory"
    with pytest.raises(ValueError, match="is a URL; ShardWriter writes a local folder"):
        ShardWriter("s3://bucket/ds")
    assert not (tmp_path / "s3:").exists()
