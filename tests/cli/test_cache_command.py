"""``fastdata cache`` build, list and rm: sizes checked before any worker starts, errors in one line."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata import ShardWriter
from fastdata.cache import Cache
from fastdata.cli import main
from fastdata.errors import CacheError
from tests.helpers.stores import cached_samples, expected, photo_shards, same_samples


def _npz_shards(root):
    """A shard folder whose samples hold arrays, no image field."""
    with fastdata.ShardWriter(root / "arrays") as w:
        for i in range(6):
            w.write({"__key__": f"s{i:03d}", "x.npy": np.full((3,), i, dtype=np.float32), "cls": i % 2})
    return root / "arrays"


def test_cache_build_without_image_field_says_why(tmp_path, capsys):
    shards = _npz_shards(tmp_path)
    code = main(["cache", "build", str(shards), "--cache", str(tmp_path / "c"), "--size", "32", "-q"])
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and str(shards) in lines[0] and "image field" in lines[0], err


def test_error_raised_in_a_dataloader_worker_is_one_line(tmp_path, capsys, monkeypatch):
    # torch wraps a worker's exception as "Caught CacheError in DataLoader worker process 0.\nOriginal
    # Traceback (most recent call last): ..." and the command printed all of it
    import io

    import fastdata.cli._cache_cmd as cache_cmd

    # `cache build` refuses a store over --max-bytes up front; this test is about the worker's error
    monkeypatch.setattr(cache_cmd, "_check_store_fits", lambda *a: None)

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="JPEG")
    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "jpg": buf.getvalue()})
    code = main(["cache", "build", str(tmp_path / "s"), "--cache", str(tmp_path / "c"), "--size", "8",
                 "--max-bytes", "10", "--workers", "1", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("fastdata cache: error: cache directory") and "max_bytes=10" in err[0], err
    assert "worker process 0" in err[0]
    # and the worker is gone now, not at some later garbage collection after torch's 5 s join timeout
    import multiprocessing
    assert multiprocessing.active_children() == []


def test_cache_without_a_subcommand_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["cache"])
    err = capsys.readouterr().err
    assert "{list,rm,build}" in err.splitlines()[-1] and "cache_command" not in err  # argparse's dest leaked


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


def test_cli_build_list_rm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("fastdata.dataset")
    from fastdata.cli import main

    src = photo_shards(tmp_path / "shards")
    cache_dir = str(tmp_path / "cache")
    assert main(["cache", "build", str(src), "--cache", cache_dir, "--size", "32", "--workers", "2", "-q"]) == 0
    assert "24/24 samples (100.0%)" in capsys.readouterr().out
    assert same_samples(cached_samples(src, cache=cache_dir), cached_samples(src))
    assert main(["cache", "list", "--cache", cache_dir]) == 0
    out = capsys.readouterr().out
    (info,) = Cache(cache_dir).list()
    assert info.fingerprint[:24] in out and "100.0%" in out and "3.1 kB" in out and "1 store(s)" in out
    assert main(["cache", "list", "-l", "--cache", cache_dir]) == 0
    out = capsys.readouterr().out
    assert info.fingerprint in out and "ResizeCenterCrop(size=(32,32)" in out and "jpg uint8 (3, 32, 32)" in out
    assert main(["cache", "rm", info.fingerprint[:12], "--cache", cache_dir]) == 0
    assert f"removed {info.key}" in capsys.readouterr().out and Cache(cache_dir).list() == []
    assert main(["cache", "rm", "nothing", "--cache", cache_dir]) == 1
    assert "no store matches 'nothing'" in capsys.readouterr().err


def test_cli_list_marks_a_damaged_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A store whose meta.json layout was damaged is listed as such, with the reason, not as an empty store."""
    import json as _json

    from fastdata.cli import main

    store = Cache(tmp_path).open_store(fingerprint="damaged", num_samples=4)
    store.put(0, expected(0))
    path = store.path
    store.close()
    meta = _json.loads((path / "meta.json").read_text())
    meta["fields"][0]["dtype"] = "object"
    (path / "meta.json").write_text(_json.dumps(meta))
    assert main(["cache", "list", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "DAMAGED" in out and "malformed 'fields'" in out and "1 damaged" in out
    assert main(["cache", "list", "--json", "--cache", str(tmp_path)]) == 0
    (row,) = _json.loads(capsys.readouterr().out)
    assert row["fingerprint"] == "damaged" and row["num_samples"] == 4 and "malformed" in row["problem"]
    (info,) = Cache(tmp_path).list()
    assert info.problem is not None and info.fields is None


def _filled_store(directory: Path, n: int = 4) -> Path:
    from fastdata.cache import Cache

    store = Cache(directory).open_store(fingerprint="fp", num_samples=n)
    for i in range(n):
        store.put(i, {"img": np.full((3, 4, 4), i, np.uint8)})
    store.close()
    return store.path


@pytest.mark.parametrize("damage", ["truncated field file", "missing field file", "missing valid.bin",
                                    "long valid.bin", "garbage in valid.bin"])
def test_cache_list_marks_a_store_whose_files_do_not_match_its_layout(tmp_path: Path, damage: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`cache list` (and Cache.info, which build_cache returns) trusted meta.json alone: a store whose
    field file was truncated showed 100% filled and no problem, while every open of it failed."""
    from fastdata.cache import Cache
    from fastdata.cli import main

    path = _filled_store(tmp_path / "c")
    if damage == "truncated field file":
        os.truncate(path / "field-000.bin", 10)
    elif damage == "missing field file":
        (path / "field-000.bin").unlink()
    elif damage == "missing valid.bin":
        (path / "valid.bin").unlink()
    elif damage == "long valid.bin":
        (path / "valid.bin").write_bytes(b"\x01" * 9)
    else:
        (path / "valid.bin").write_bytes(b"\x01\x07\x01\x01")
    with pytest.raises(CacheError) as opened:  # what every open of the store says
        Cache(tmp_path / "c").open_store(fingerprint="fp", num_samples=4).get(0)
    info = Cache(tmp_path / "c").list()[0]
    assert info.problem is not None and str(path) in info.problem, (info, opened.value)
    assert main(["cache", "list", "--cache", str(tmp_path / "c")]) == 0
    assert "DAMAGED" in capsys.readouterr().out
    Cache(tmp_path / "c").remove(info.key)
    assert Cache(tmp_path / "c").list() == []


def test_cache_list_of_a_directory_that_does_not_exist_says_so(tmp_path, capsys):
    # a mistyped --cache said "no stores in DIR", as for an empty cache
    from fastdata.cli._main import main

    assert main(["cache", "list", "--cache", str(tmp_path / "typo")]) == 0
    assert capsys.readouterr().out.strip() == f"no stores in {tmp_path / 'typo'} (no such directory)"
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    assert main(["cache", "list", "--cache", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.strip() == f"no stores in {tmp_path / 'empty'}"
