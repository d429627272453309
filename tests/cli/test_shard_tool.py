"""tools/shard.py end to end: every source kind to tar and HDF5, bad inputs, resume, --verify.

The CLI is called in-process through ``main(argv)`` (fast); two tests run the script itself. The
same command ships as ``fastdata shard`` / ``fastdata verify`` (fastdata.cli._shard_cmd)."""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.cli import main
from fastdata.manifest import Manifest
from fastdata.shards import convert as convert_mod
from fastdata.shards._images import resize_center_crop
from fastdata.shards.hdf5 import write_hdf5_shard
from fastdata.shards.reader import open_shard
from fastdata.shards.tar import write_tar_shard
from tests.helpers.sources import small_tar


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "shard.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("shard_tool", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def run(capsys, *argv) -> tuple[int, str, str]:
    """``main(argv)`` (quiet unless verifying); returns exit status, stdout, stderr."""
    args = [str(a) for a in argv]
    code = tool.main(args if "--verify" in args else [*args, "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("shard.py: error:")]
    assert len(lines) == 1, err
    return lines[0]


def image_bytes(i: int, size: tuple[int, int] = (40, 28), fmt: str = "JPEG") -> bytes:
    """A small image whose pixels derive from ``i``."""
    yy, xx = np.mgrid[0:size[1], 0:size[0]]
    arr = np.stack([(xx * 5 + i * 7) % 256, (yy * 9 + i * 13) % 256, (xx + yy + i * 29) % 256], -1)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def make_images(root: Path, n: int = 24, classes: int = 3) -> dict[str, tuple[bytes, int]]:
    """ImageFolder layout; returns {key: (file bytes, class index)}."""
    expected = {}
    for i in range(n):
        cls = i % classes
        data = image_bytes(i)
        path = root / f"c{cls}" / f"im{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        expected[f"c{cls}/im{i:03d}"] = (data, cls)
    return expected


def read_all(dest: Path) -> dict[str, dict]:
    """Every sample of a shard folder, by key (also checks keys are unique)."""
    manifest = Manifest.load(dest)
    out: dict[str, dict] = {}
    for shard in manifest.shards:
        with open_shard(dest, shard, format=manifest.format) as reader:
            assert len(reader) == shard.num_samples
            for sample in reader.iter_range():
                key = sample.pop("__key__")
                assert key not in out, f"{key} in two shards"
                out[key] = {k: bytes(v) if isinstance(v, (bytes, memoryview)) else v for k, v in sample.items()}
    assert len(out) == manifest.num_samples
    return out


def tree_bytes(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.is_file()}


@pytest.fixture
def images(tmp_path):
    src = tmp_path / "images"
    return src, make_images(src)


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_image_folder_round_trip_is_byte_exact(tmp_path, capsys, images, fmt):
    src, expected = images
    code, _, err = run(capsys, src, tmp_path / "out", "--format", fmt, "--samples-per-shard", 7)
    assert code == 0, err
    manifest = Manifest.load(tmp_path / "out")
    assert [s.num_samples for s in manifest.shards] == [7, 7, 7, 3]
    assert manifest.extra["source"]["classes"] == ["c0", "c1", "c2"]
    assert {f.name: f.kind for f in manifest.fields} == {"cls": "int", "jpg": "bytes"}
    got = read_all(tmp_path / "out")
    assert set(got) == set(expected)
    for key, (data, cls) in expected.items():
        assert got[key]["jpg"] == data
        assert int(got[key]["cls"]) == cls
    assert run(capsys, "--verify", tmp_path / "out")[0] == 0


def write_wds_shards(folder: Path, n: int = 20, per_shard: int = 8) -> dict[str, dict]:
    wds = pytest.importorskip("webdataset")
    folder.mkdir(parents=True)
    expected = {}
    with wds.ShardWriter(str(folder / "wds-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            key = f"set.v1/s{i:04d}"
            sample = {"__key__": key, "jpg": image_bytes(i), "txt": f"caption {i}", "cls": i % 4}
            sink.write(sample)
            expected[key] = {"jpg": sample["jpg"], "txt": sample["txt"].encode(), "cls": str(i % 4).encode()}
    return expected


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_webdataset_written_tar_shards_as_src(tmp_path, capsys, fmt):
    expected = write_wds_shards(tmp_path / "wds")
    code, _, err = run(capsys, tmp_path / "wds", tmp_path / "out", "--format", fmt, "--shard-size", "200KB")
    assert code == 0, err
    assert read_all(tmp_path / "out") == expected


def test_foreign_tar_members_without_a_field_are_listed_as_skipped(tmp_path, capsys):
    import tarfile
    import warnings

    (tmp_path / "src").mkdir()
    with tarfile.open(tmp_path / "src" / "a.tar", "w") as tf:
        for name, data in (("s0.txt", b"zero"), ("README", b"not a sample"), ("s1.txt", b"one")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _, err = run(capsys, tmp_path / "src", tmp_path / "out")
        assert code == 0, err
        assert Manifest.load(tmp_path / "out").skipped == (
            {"source": "a.tar:README", "reason": "tar member name is not '<key>.<field>'"},)
        code, _, err = run(capsys, tmp_path / "src", tmp_path / "out2", "--strict")
    assert code == 1 and "a.tar:README" in error_line(err)


def test_tar_output_is_read_by_webdataset(tmp_path, capsys, images):
    wds = pytest.importorskip("webdataset")
    src, expected = images
    assert run(capsys, src, tmp_path / "out", "--samples-per-shard", 10)[0] == 0
    urls = [str(p) for p in sorted((tmp_path / "out").glob("*.tar"))]
    got = {s["__key__"]: s["jpg"] for s in wds.WebDataset(urls, shardshuffle=False)}
    assert got == {k: v[0] for k, v in expected.items()}


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_fastdata_folders_convert_between_formats(tmp_path, capsys, images, fmt):
    src, expected = images
    other = "hdf5" if fmt == "tar" else "tar"
    assert run(capsys, src, tmp_path / "a", "--format", fmt, "--samples-per-shard", 9)[0] == 0
    code, _, err = run(capsys, tmp_path / "a", tmp_path / "b", "--format", other)
    assert code == 0, err
    a, b = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert {k: s["jpg"] for k, s in b.items()} == {k: v[0] for k, v in expected.items()}
    assert {k: int(s["cls"]) for k, s in a.items()} == {k: int(s["cls"]) for k, s in b.items()}
    # a single shard file works as SRC too
    first = sorted((tmp_path / "a").glob("shard-*[0-9].*"))[0]
    assert run(capsys, first, tmp_path / "c")[0] == 0
    assert Manifest.load(tmp_path / "c").num_samples == 9


def test_hdf5_files_with_arrays_round_trip(tmp_path, capsys):
    src = tmp_path / "h5src"
    src.mkdir()
    rng = np.random.default_rng(0)
    expected = {}
    for part in range(2):
        samples = [{"__key__": f"p{part}/{i:03d}", "x.npy": rng.random((2, 3), dtype=np.float32),
                    "label": i, "txt": f"t{i}", "meta.json": {"i": i, "part": part}} for i in range(5)]
        write_hdf5_shard(src / f"part{part}.h5", samples)
        expected.update({s["__key__"]: s for s in samples})
    for fmt in ("tar", "hdf5"):
        code, _, err = run(capsys, src, tmp_path / fmt, "--format", fmt)
        assert code == 0, err
        got = read_all(tmp_path / fmt)
        assert list(got) == list(expected)
        for key, s in expected.items():
            x = got[key]["x.npy"]
            x = np.load(io.BytesIO(x)) if isinstance(x, bytes) else x
            np.testing.assert_array_equal(x, s["x.npy"])
            assert int(got[key]["label"]) == s["label"]
            assert got[key]["txt"] == s["txt"].encode()
            assert json.loads(got[key]["meta.json"]) == s["meta.json"]
        kinds = {f.name: f.kind for f in Manifest.load(tmp_path / fmt).fields}
        assert kinds == {"label": "int", "meta.json": "json", "txt": "text", "x.npy": "array"}


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
@pytest.mark.parametrize("compressed", [False, True])
def test_npz_round_trip(tmp_path, capsys, fmt, compressed):
    x = np.arange(60, dtype=np.float32).reshape(12, 5)
    y = np.arange(12, dtype=np.int64)[::-1].copy()
    (np.savez_compressed if compressed else np.savez)(tmp_path / "d.npz", x=x, y=y)
    code, _, err = run(capsys, tmp_path / "d.npz", tmp_path / "out", "--format", fmt, "--samples-per-shard", 5)
    assert code == 0, err
    manifest = Manifest.load(tmp_path / "out")
    assert {f.name: (f.dtype, f.shape) for f in manifest.fields} == {"x.npy": ("float32", (5,)), "y.npy": ("int64", ())}
    got = read_all(tmp_path / "out")
    assert list(got) == [f"{i:06d}" for i in range(12)]
    for i, key in enumerate(got):
        xs, ys = got[key]["x.npy"], got[key]["y.npy"]
        if fmt == "tar":
            xs, ys = np.load(io.BytesIO(xs)), np.load(io.BytesIO(ys))
        np.testing.assert_array_equal(xs, x[i])
        assert ys.shape == () and int(ys) == y[i]


def test_npz_keys_and_mismatched_lengths(tmp_path, capsys):
    np.savez(tmp_path / "k.npz", __key__=np.array(["a/x", "a/y"]), v=np.zeros((2, 2)))
    assert run(capsys, tmp_path / "k.npz", tmp_path / "out")[0] == 0
    assert set(read_all(tmp_path / "out")) == {"a/x", "a/y"}
    np.savez(tmp_path / "bad.npz", a=np.zeros(3), b=np.zeros(4))
    code, _, err = run(capsys, tmp_path / "bad.npz", tmp_path / "out2")
    assert code == 1
    assert "arrays must share their first axis, but 'a' has 3 rows and 'b' has 4" in error_line(err)


def test_resize_stores_chw_uint8_arrays(tmp_path, capsys, images):
    src, expected = images
    for fmt in ("tar", "hdf5"):
        code, _, err = run(capsys, src, tmp_path / fmt, "--resize", 16, "--format", fmt)
        assert code == 0, err
        manifest = Manifest.load(tmp_path / fmt)
        assert manifest.field("img.npy").shape == (3, 16, 16)
        assert manifest.extra["resize"] == 16
        got = read_all(tmp_path / fmt)
        for key, (data, cls) in expected.items():
            arr = got[key]["img.npy"]
            arr = np.load(io.BytesIO(arr)) if fmt == "tar" else arr
            assert set(got[key]) == {"img.npy", "cls"}
            np.testing.assert_array_equal(arr, resize_center_crop(data, 16))


def test_shuffle_is_seeded_and_loses_nothing(tmp_path, capsys, images):
    src, expected = images
    orders = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        assert run(capsys, src, tmp_path / name, "--shuffle", "--seed", seed, "--samples-per-shard", 5)[0] == 0
        orders.append(list(read_all(tmp_path / name)))
    assert orders[0] == orders[1] != orders[2]
    assert sorted(orders[0]) == sorted(expected) and orders[0] != sorted(expected)


def test_shard_size_limits_estimated_bytes(tmp_path, capsys, images):
    src, _ = images
    assert run(capsys, src, tmp_path / "out", "--shard-size", "12KB")[0] == 0
    manifest = Manifest.load(tmp_path / "out")
    assert len(manifest.shards) > 3
    # each shard's content (before the end-of-archive record padding) fits the target
    assert all(s.bytes - 10240 <= 12_000 or s.num_samples == 1 for s in manifest.shards)


@pytest.mark.slow
def test_output_is_identical_whatever_workers(tmp_path, capsys, images):
    src, _ = images
    for args in ((), ("--resize", "12", "--shuffle")):
        trees = []
        for workers in (1, 2):
            dest = tmp_path / f"w{workers}{len(args)}"
            code, _, err = run(capsys, src, dest, "--samples-per-shard", 5, "--workers", workers, *args)
            assert code == 0, err
            trees.append(tree_bytes(dest))
        assert trees[0] == trees[1]
        assert len(trees[0]) == 1 + 2 * 5  # manifest + 5 shards with their indexes


def test_resume_after_interruption_matches_uninterrupted_run(tmp_path, capsys, images, monkeypatch):
    src, _ = images
    args = ("--samples-per-shard", 5, "--workers", 1)
    assert run(capsys, src, tmp_path / "ref", *args)[0] == 0
    real = convert_mod._write_job
    calls = []

    def failing(task, tick):
        if len(calls) == 2:
            raise OSError("simulated crash")
        calls.append(task.job.name)
        return real(task, tick)

    monkeypatch.setattr(convert_mod, "_write_job", failing)
    code, _, err = run(capsys, src, tmp_path / "out", *args)
    assert code == 1 and "simulated crash" in error_line(err)
    dest = tmp_path / "out"
    assert not (dest / "manifest.json").exists()
    assert sorted(p.name for p in dest.glob("*.tar")) == calls == ["shard-000000.tar", "shard-000001.tar"]
    monkeypatch.setattr(convert_mod, "_write_job", real)
    # a kept shard that no longer matches its checksum is redone
    kept_mtime = (dest / "shard-000000.tar").stat().st_mtime_ns
    with open(dest / "shard-000001.tar", "r+b") as f:
        f.seek(700)
        f.write(b"X")
    rerun = []
    monkeypatch.setattr(convert_mod, "_write_job", lambda task, tick: rerun.append(task.job.name) or real(task, tick))
    code, _, err = run(capsys, src, dest, *args)
    assert code == 0, err
    assert rerun == ["shard-000001.tar", "shard-000002.tar", "shard-000003.tar", "shard-000004.tar"]
    assert (dest / "shard-000000.tar").stat().st_mtime_ns == kept_mtime
    assert tree_bytes(dest) == tree_bytes(tmp_path / "ref")
    assert not (dest / convert_mod.PROGRESS_DIR).exists()


def test_interrupted_dest_with_other_arguments_is_not_resumed(tmp_path, capsys, images, monkeypatch):
    src, _ = images
    monkeypatch.setattr(convert_mod, "_write_job", lambda task, tick: (_ for _ in ()).throw(OSError("crash")))
    assert run(capsys, src, tmp_path / "out", "--samples-per-shard", 5, "--workers", 1)[0] == 1
    monkeypatch.undo()
    code, _, err = run(capsys, src, tmp_path / "out", "--samples-per-shard", 6)
    assert code == 1
    assert "is not empty (an interrupted conversion with different arguments" in error_line(err)


def test_missing_src(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "nope", tmp_path / "out")
    assert code == 1
    assert error_line(err) == f"shard.py: error: SRC {tmp_path / 'nope'}: no such file or directory"


def test_empty_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, tmp_path / "empty", tmp_path / "out")
    assert code == 1 and f"SRC {tmp_path / 'empty'}: is empty" in error_line(err)
    (tmp_path / "noimg" / "a").mkdir(parents=True)
    (tmp_path / "noimg" / "a" / "notes.txt").write_text("x")
    code, _, err = run(capsys, tmp_path / "noimg", tmp_path / "out")
    assert code == 1 and "holds no image files" in error_line(err)


def test_corrupt_image_is_skipped_and_listed(tmp_path, capsys, images):
    src, expected = images
    (src / "c1" / "broken.jpg").write_bytes(b"this is not a jpeg")
    (src / "c2" / "truncated.png").write_bytes(image_bytes(1, fmt="PNG")[:-30])
    (src / "c0" / "notes.txt").write_text("hello")
    (src / "c2" / "gone.jpg").symlink_to(tmp_path / "missing.jpg")
    code, _, err = run(capsys, src, tmp_path / "out")
    assert code == 0, err
    assert "skipped 4 input(s)" in err
    skipped = {s["source"]: s["reason"] for s in Manifest.load(tmp_path / "out").skipped}
    assert skipped.keys() == {"c1/broken.jpg", "c2/truncated.png", "c0/notes.txt", "c2/gone.jpg"}
    assert skipped["c1/broken.jpg"] == "not a recognised image format"
    assert skipped["c0/notes.txt"] == "not an image file (extension 'txt')"
    assert skipped["c2/gone.jpg"] == "cannot read file: No such file or directory"
    # nothing readable is lost, and only those were dropped
    assert {k: s["jpg"] for k, s in read_all(tmp_path / "out").items()} == {k: v[0] for k, v in expected.items()}


def test_no_readable_input_is_an_error(tmp_path, capsys):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"junk")
    code, _, err = run(capsys, tmp_path / "src", tmp_path / "out")
    assert code == 1
    assert "none of its 1 inputs could be read" in error_line(err) and "a/x.jpg: not a recognised image" in err
    assert Manifest.load(tmp_path / "out").skipped == ({"source": "a/x.jpg", "reason": "not a recognised image format"},)


def test_corrupt_image_with_strict_fails_naming_the_file(tmp_path, capsys, images):
    src, _ = images
    (src / "c1" / "broken.jpg").write_bytes(b"this is not a jpeg")
    code, _, err = run(capsys, src, tmp_path / "out", "--strict", "--workers", 2, "--samples-per-shard", 4)
    assert code == 1
    assert error_line(err) == (f"shard.py: error: {src / 'c1' / 'broken.jpg'}: not a recognised image format "
                               "(--strict)")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_truncated_jpeg_needs_full_check(tmp_path, capsys, images):
    src, _ = images
    whole = image_bytes(3, size=(200, 160))
    (src / "c0" / "cut.jpg").write_bytes(whole[:len(whole) // 2])  # cut inside the scan data
    assert run(capsys, src, tmp_path / "header")[0] == 0
    assert Manifest.load(tmp_path / "header").skipped == ()  # header check: documented blind spot
    assert run(capsys, src, tmp_path / "full", "--check", "full")[0] == 0
    (entry,) = Manifest.load(tmp_path / "full").skipped
    assert entry["source"] == "c0/cut.jpg" and "OSError" in entry["reason"]
    code, _, err = run(capsys, src, tmp_path / "resized", "--resize", 8, "--strict")
    assert code == 1 and f"{src / 'c0' / 'cut.jpg'}: OSError" in error_line(err)


def test_duplicate_keys_are_an_error_naming_the_key(tmp_path, capsys):
    src = tmp_path / "tars"
    src.mkdir()
    write_tar_shard(src / "a.tar", [{"__key__": "x/1", "bin": b"a"}, {"__key__": "x/2", "bin": b"b"}])
    write_tar_shard(src / "b.tar", [{"__key__": "x/3", "bin": b"c"}, {"__key__": "x/2", "bin": b"d"}])
    code, _, err = run(capsys, src, tmp_path / "out")
    assert code == 1
    assert error_line(err) == ("shard.py: error: duplicate key 'x/2': a.tar[1] and b.tar[1] "
                               "(keys must be unique across SRC)")
    assert not (tmp_path / "out").exists()


def test_foreign_tar_keys_fastdata_cannot_write_fail_before_writing(tmp_path, capsys):
    import tarfile

    (tmp_path / "src").mkdir()
    with tarfile.open(tmp_path / "src" / "a.tar", "w") as tf:  # as made by `tar cf a.tar -C dir .`
        for name in ("./s0.txt", "./s1.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
    code, _, err = run(capsys, tmp_path / "src", tmp_path / "out")
    assert code == 1
    assert error_line(err) == (f"shard.py: error: {tmp_path / 'src' / 'a.tar'}: sample 0: invalid sample key "
                               "'./s0': has an empty, '.' or '..' path component '.'")
    assert not (tmp_path / "out").exists()


def test_image_names_with_dots_map_to_distinct_keys_or_fail(tmp_path, capsys):
    src = tmp_path / "dots"
    (src / "a").mkdir(parents=True)
    (src / "a" / "img.1.jpg").write_bytes(image_bytes(1))
    (src / "a" / "img_1.jpg").write_bytes(image_bytes(2))
    code, _, err = run(capsys, src, tmp_path / "out")
    assert code == 1 and "duplicate key 'a/img_1': a/img.1.jpg and a/img_1.jpg" in error_line(err)
    (src / "a" / "img_1.jpg").unlink()
    assert run(capsys, src, tmp_path / "out")[0] == 0
    assert list(read_all(tmp_path / "out")) == ["a/img_1"]


def test_dest_not_empty_needs_overwrite(tmp_path, capsys, images):
    src, _ = images
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    code, _, err = run(capsys, src, dest)
    assert code == 1
    assert error_line(err) == (f"shard.py: error: DEST {dest} is not empty (holds keep.txt); pass --overwrite "
                               "to replace its shards or choose an empty folder")
    assert run(capsys, src, dest, "--samples-per-shard", 5, "--overwrite")[0] == 0
    code, _, err = run(capsys, src, dest, "--samples-per-shard", 6)  # another plan: not this conversion
    assert code == 1 and error_line(err) == (
        f"shard.py: error: DEST {dest} is not empty (a finished conversion with different arguments or inputs: "
        "--samples-per-shard was 5, now 6; holds keep.txt, manifest.json, shard-000000.tar, ...); pass --overwrite to replace its shards or choose "
        "an empty folder")
    code, _, err = run(capsys, src, dest, "--samples-per-shard", 50, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt", "manifest.json", "shard-000000.tar",
                                                     "shard-000000.tar.idx"]


def test_dest_inside_image_src_is_refused(tmp_path, capsys, images):
    src, _ = images
    code, _, err = run(capsys, src, src / "out")
    assert code == 1 and "is inside SRC" in error_line(err)


def test_truncated_tar_shard_names_shard_and_offset(tmp_path, capsys):
    src = tmp_path / "tars"
    src.mkdir()
    write_tar_shard(src / "a.tar", [{"__key__": f"k{i}", "bin": bytes(700)} for i in range(4)], )
    (src / "a.tar.idx").unlink()
    data = (src / "a.tar").read_bytes()
    (src / "a.tar").write_bytes(data[:2000])
    code, _, err = run(capsys, src, tmp_path / "out")
    assert code == 1
    line = error_line(err)
    assert str(src / "a.tar") in line and "byte offset" in line
    garbage = bytearray(data)
    garbage[1536:1536 + 512] = b"\x07" * 512  # second member's header
    (src / "a.tar").write_bytes(bytes(garbage))
    code, _, err = run(capsys, src, tmp_path / "out")
    assert code == 1 and "a.tar" in error_line(err) and "byte offset 1536" in error_line(err)


def test_hdf5_not_in_layout_names_the_dataset(tmp_path, capsys):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f.attrs["fastdata_format"] = "hdf5"
        f.attrs["fastdata_version"] = 1
        f.attrs["num_samples"] = 2
        f["images"] = np.zeros((2, 4))
    code, _, err = run(capsys, path, tmp_path / "out")
    assert code == 1 and "dataset '__key__' is missing" in error_line(err) and str(path) in error_line(err)
    write_hdf5_shard(tmp_path / "ok.h5", [{"__key__": "a", "v": 1}, {"__key__": "b", "v": 2}])
    with h5py.File(tmp_path / "ok.h5", "a") as f:
        f["v"].attrs["kind"] = "text"
    code, _, err = run(capsys, tmp_path / "ok.h5", tmp_path / "out")
    assert code == 1 and "dataset 'v' of kind 'text' has the wrong type" in error_line(err)


def test_verify_names_the_mismatching_shard(tmp_path, capsys, images):
    src, _ = images
    dest = tmp_path / "out"
    assert run(capsys, src, dest, "--samples-per-shard", 10)[0] == 0
    code, out, _ = run(capsys, "--verify", dest)
    assert code == 0 and out.strip() == f"{dest}: ok, 3 shards, 24 samples"
    with open(dest / "shard-000001.tar", "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, _, err = run(capsys, "--verify", dest)
    assert code == 1
    assert error_line(err).startswith(f"shard.py: error: {dest}: shard-000001.tar: sha256 mismatch")
    code, _, err = run(capsys, "--verify", tmp_path / "missing")
    assert code == 1 and "no such folder" in error_line(err)


@pytest.mark.parametrize("argv, message", [
    ([], "expected SRC and DEST, got 0 path(s)"),
    (["a"], "expected SRC and DEST, got 1 path(s)"),
    (["a", "b", "--shard-size", "12XB"], "argument --shard-size: cannot parse size '12XB'"),
    (["a", "b", "--workers", "0"], "argument --workers: expected an integer >= 1, got 0"),
    (["a", "b", "--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (["a", "b", "--resize", "x"], "argument --resize: expected an integer >= 1, got 'x'"),
    (["a", "b", "--format", "zip"], "argument --format: invalid choice: 'zip'"),
    (["--verify", "d", "a", "b"], "--verify DEST takes no SRC DEST arguments"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    code = tool.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in error_line(err) and len(err.splitlines()) == 1


def test_script_runs_from_a_checkout(tmp_path, images):
    src, expected = images
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(src), str(tmp_path / "out"), "--workers", "2",
                           "--samples-per-shard", "8"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{tmp_path / 'out'}: 24 samples in 3 tar shards")
    assert "\r" not in done.stderr  # no progress bar when stderr is not a terminal
    done = subprocess.run([sys.executable, str(SCRIPT), "--verify", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope"), str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"shard.py: error: SRC {tmp_path / 'nope'}: no such file or directory"]
    json.loads((tmp_path / "out" / "manifest.json").read_text())


@pytest.mark.slow
def test_spawned_workers_give_identical_output(tmp_path, capsys, images, monkeypatch):
    """Workers started with spawn (used when the caller has threads) get everything by pickling."""
    import multiprocessing

    src, _ = images
    assert run(capsys, src, tmp_path / "fork", "--samples-per-shard", 9, "--workers", 2, "--resize", 8)[0] == 0
    monkeypatch.setattr(convert_mod, "_mp_context", lambda: multiprocessing.get_context("spawn"))
    code, _, err = run(capsys, src, tmp_path / "spawn", "--samples-per-shard", 9, "--workers", 2, "--resize", 8)
    assert code == 0, err
    assert tree_bytes(tmp_path / "fork") == tree_bytes(tmp_path / "spawn")


def test_strict_names_the_shard_of_a_corrupt_image_in_tar_src(tmp_path, capsys):
    src = tmp_path / "tars"
    src.mkdir()
    write_tar_shard(src / "a.tar", [{"__key__": "k0", "jpg": image_bytes(0)}, {"__key__": "k1", "jpg": b"junk"}])
    code, _, err = run(capsys, src, tmp_path / "out", "--strict")
    assert code == 1
    assert error_line(err) == f"shard.py: error: {src / 'a.tar'}[1]: not a recognised image format (--strict)"
    assert run(capsys, src, tmp_path / "out2")[0] == 0
    skipped = Manifest.load(tmp_path / "out2").skipped
    assert skipped == ({"source": "a.tar[1]", "reason": "not a recognised image format"},)


def test_rerun_of_a_finished_conversion_is_complete(tmp_path, capsys, images, monkeypatch):
    src, _ = images
    dest = tmp_path / "out"
    args = (src, dest, "--samples-per-shard", 10, "--shuffle", "--seed", 3)
    assert run(capsys, *args)[0] == 0
    before = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    monkeypatch.setattr(convert_mod, "_write_job", lambda task, tick: pytest.fail("rerun wrote a shard"))
    code = tool.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip() == (f"{dest}: complete, 24 samples in 3 tar shards, 0 skipped (converted earlier with these "
                           "arguments and inputs; nothing to do)")
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == before
    # a changed input is another plan: refused without --overwrite, redone with it
    monkeypatch.undo()
    os.utime(src / "c0" / "im000.jpg", ns=(1, 1))
    code, _, err = run(capsys, *args)
    assert code == 1 and "a finished conversion with different arguments or inputs" in error_line(err)
    assert run(capsys, *args, "--overwrite")[0] == 0
    # a finished conversion with a missing shard is not complete: the rerun says so
    (dest / "shard-000002.tar").unlink()
    code, _, err = run(capsys, *args)
    assert code == 1 and "is not empty" in error_line(err)


def test_rerun_with_strict_of_a_finished_conversion_with_skips_fails(tmp_path, capsys, images):
    src, _ = images
    (src / "c1" / "broken.jpg").write_bytes(b"junk")
    assert run(capsys, src, tmp_path / "out")[0] == 0
    code, _, err = run(capsys, src, tmp_path / "out", "--strict")
    assert code == 1
    assert error_line(err) == f"shard.py: error: {src / 'c1' / 'broken.jpg'}: not a recognised image format (--strict)"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("workers", [1, 3])
def test_verify_lists_every_problem_in_manifest_order(tmp_path, capsys, images, workers):
    src, _ = images
    dest = tmp_path / "out"
    assert run(capsys, src, dest, "--samples-per-shard", 4)[0] == 0
    _flip(dest / "shard-000001.tar", 1000)
    (dest / "shard-000003.tar").unlink()
    (dest / "shard-000004.tar.idx").unlink()
    with open(dest / "shard-000005.tar", "ab") as f:
        f.write(b"\0" * 512)
    code = tool.main(["--verify", str(dest), "--workers", str(workers), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1
    prefix = f"shard.py: error: {dest}: "
    problems = [line[len(prefix):] for line in err.splitlines() if line.startswith(prefix)]
    assert [p.split(":")[0] for p in problems] == [
        "shard-000001.tar", "shard-000003.tar", "shard-000004.tar", "shard-000005.tar", "shard-000005.tar"]
    assert problems[0].startswith("shard-000001.tar: sha256 mismatch")
    assert problems[1] == "shard-000003.tar: shard file is missing"
    assert problems[2] == "shard-000004.tar: index file shard-000004.tar.idx is missing"
    size = Manifest.load(dest).shards[5].bytes
    assert problems[3] == f"shard-000005.tar: size is {size + 512} bytes, manifest says {size}"
    assert problems[4] == "shard-000005.tar: index file shard-000005.tar.idx does not match the shard's headers"
    assert err.splitlines()[-1] == f"shard.py: {dest}: 5 problems"


def test_verify_of_an_unfinished_conversion_says_so(tmp_path, capsys, images, monkeypatch):
    src, _ = images
    monkeypatch.setattr(convert_mod, "_write_job", lambda task, tick: (_ for _ in ()).throw(OSError("crash")))
    assert run(capsys, src, tmp_path / "out", "--workers", 1)[0] == 1
    code, _, err = run(capsys, "--verify", tmp_path / "out")
    assert code == 1 and "the conversion into it did not finish (rerun it to resume)" in error_line(err)


def test_fastdata_shard_and_verify_subcommands(tmp_path, capsys, images):
    from fastdata.cli import main as fastdata_main

    src, expected = images
    dest = tmp_path / "out"
    assert fastdata_main(["shard", str(src), str(dest), "--samples-per-shard", "10", "--format", "hdf5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{dest}: 24 samples in 3 hdf5 shards")
    assert set(read_all(dest)) == set(expected)
    assert fastdata_main(["shard", str(src), str(dest), "--samples-per-shard", "10", "--format", "hdf5"]) == 0
    assert capsys.readouterr().out.startswith(f"{dest}: complete, 24 samples")
    assert fastdata_main(["verify", str(dest), "--workers", "2"]) == 0
    assert capsys.readouterr().out.strip() == f"{dest}: ok, 3 shards, 24 samples"
    _flip(dest / "shard-000002.h5", 100)
    assert fastdata_main(["verify", str(dest)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"fastdata verify: error: {dest}: shard-000002.h5: sha256 mismatch")
    assert fastdata_main(["shard", str(tmp_path / "nope"), str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == f"fastdata shard: error: SRC {tmp_path / 'nope'}: no such file or directory\n"
    with pytest.raises(SystemExit) as info:  # argparse's usage error: status 2, like shard.py
        fastdata_main(["shard", str(src), str(dest), "--shard-size", "12XB"])
    assert info.value.code == 2
    assert "argument --shard-size: cannot parse size '12XB'" in capsys.readouterr().err


def test_every_option_says_its_default():
    from fastdata.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for parser in (tool.build_tool_parser() if hasattr(tool, "build_tool_parser") else None,
                   sub.choices["shard"], sub.choices["verify"]):
        if parser is None:
            continue
        for action in parser._actions:
            if action.option_strings and action.dest not in ("help", "verify"):
                assert action.help and "default" in action.help, (parser.prog, action.dest)


def _help(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_shard_help_does_not_offer_verify_but_the_tool_does(capsys):
    from fastdata.cli._shard_cmd import build_tool_parser

    text = " ".join(_help(["shard", "--help"], capsys).split())
    assert "--verify" not in text  # `fastdata shard` has no --verify (`fastdata verify` is its own command)
    assert "with --verify, threads checking shards" in " ".join(build_tool_parser().format_help().split())


def test_seed_without_shuffle_is_a_usage_error(tmp_path, capsys):
    """`fastdata shard SRC DEST --seed 3` wrote sorted shards: --seed only seeds --shuffle, and was
    ignored without a word. It is now a bad argument (exit status 2), before anything is read."""
    from fastdata.cli import main
    from fastdata.cli._shard_cmd import tool_main

    src = small_tar(tmp_path / "a.tar", ["a0", "a1"])
    for run, prog in ((tool_main, "shard.py"), (lambda argv: main(["shard", *argv]), "fastdata shard")):
        assert run([str(src), str(tmp_path / "out"), "--seed", "3"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"{prog}: error: --seed") and "--shuffle" in err and len(err.splitlines()) == 1
        assert not (tmp_path / "out").exists()
    assert tool_main([str(src), str(tmp_path / "out"), "--seed", "3", "--shuffle", "--quiet"]) == 0


def test_the_shard_tool_refuses_an_empty_path(tmp_path, monkeypatch, capsys):
    from fastdata.cli._shard_cmd import tool_main

    monkeypatch.chdir(tmp_path)
    assert tool_main([str(tmp_path), ""]) == 2
    assert tool_main(["--verify", ""]) == 2
    assert capsys.readouterr().err.count("expected a non-empty path") == 2


def test_shard_script_takes_options_between_src_and_dest(tmp_path, capsys):
    # `fastdata shard SRC --quiet DEST` worked, `python tools/shard.py SRC --quiet DEST` said
    # "unrecognized arguments: DEST" although the README says both take the same options
    from PIL import Image

    from fastdata.cli._shard_cmd import tool_main

    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "src" / "a" / "x.jpg")
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    assert tool_main([src, "--samples-per-shard", "1", "--workers", "1", out, "--quiet"]) == 0
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert tool_main(["--workers", "1", "--verify", out]) == 0
    assert tool_main([src, "--workers", "1"]) == 2  # still one path short
    assert "expected SRC and DEST, got 1 path(s)" in capsys.readouterr().err
