"""Session-7 bug hunt of the shard formats, the manifest and the converter: each test failed before its fix."""
from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest

from fastdata.errors import FastdataError, ShardError, SourceError
from fastdata.shards.convert import ConversionError, ConvertOptions, convert


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


def opts(**kw):
    return ConvertOptions(workers=1, progress=False, **kw)


def small_tar(path, keys, fields=("cls", "txt")):
    """A tar written by Python's tarfile (GNU format), one member per field, samples in order."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i, key in enumerate(keys):
            for field in fields:
                data = str(i).encode()
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


# --------------------------------------------------------------------- concatenated tar archives

def test_concatenated_tars_are_refused_not_read_as_the_first(tmp_path):
    """`cat a.tar b.tar > ab.tar` leaves a.tar's end-of-archive blocks in the middle: readers
    stopped there and served a.tar's samples only, silently losing b.tar's (tar and webdataset
    stop there too). It is now a ShardError naming the tar and the offset."""
    from fastdata.shards.tar import TarIndex, iter_tar_stream

    a = small_tar(tmp_path / "a.tar", ["a0", "a1"])
    b = small_tar(tmp_path / "b.tar", ["b0", "b1"])
    ab = tmp_path / "ab.tar"
    ab.write_bytes(a.read_bytes() + b.read_bytes())
    with pytest.raises(ShardError, match=r"ab\.tar: .*byte offset \d+.*concatenated"):
        TarIndex.build(ab)
    with pytest.raises(ShardError, match=r"ab\.tar: .*concatenated"):
        list(iter_tar_stream(io.BytesIO(ab.read_bytes()), "ab.tar"))
    with pytest.raises(FastdataError, match=r"ab\.tar"):
        convert(ab, tmp_path / "out", opts())
    # a plain tar (zero padding to a whole record after its end) still reads in full
    assert TarIndex.build(a).keys == ("a0", "a1")
    assert [s["__key__"] for s in iter_tar_stream(io.BytesIO(a.read_bytes()), "a.tar")] == ["a0", "a1"]


def test_bytes_after_the_end_of_a_tar_that_are_not_a_header_are_ignored(tmp_path):
    """Trailing garbage that is no tar header is ignored, as tar ignores it."""
    from fastdata.shards.tar import TarIndex

    a = small_tar(tmp_path / "a.tar", ["a0"])
    t = tmp_path / "t.tar"
    t.write_bytes(a.read_bytes() + b"not a tar header".ljust(512, b"x"))
    assert TarIndex.build(t).keys == ("a0",)


# ------------------------------------------------------------------------------- value encoding

def test_bool_values_are_stored_as_the_ints_the_manifest_records(tmp_path):
    """A bool is recorded as kind 'int' (HDF5 stores 1/0), but tar members held 'True'/'False':
    a bool label in 'cls' then failed every read with a DecodeError (webdataset's too)."""
    import fastdata

    with fastdata.ShardWriter(tmp_path / "t") as w:
        w.write({"__key__": "a", "cls": True, "flag.cls": np.bool_(False)})
    assert fastdata.Manifest.load(tmp_path / "t").field("cls").kind == "int"
    assert list(fastdata.ShardedDataset(tmp_path / "t")) == [{"__key__": "a", "cls": 1, "flag.cls": 0}]


# ------------------------------------------------------------------------------------ npz source

def test_npz_keys_that_are_not_utf8_are_a_source_error_naming_the_row(tmp_path):
    """A bytes `__key__` array with a non-UTF-8 entry failed with a bare UnicodeDecodeError."""
    src = tmp_path / "k.npz"
    np.savez(src, x=np.zeros((2, 3)), __key__=np.array([b"a", b"\xff"], dtype="S2"))
    with pytest.raises(SourceError, match=r"k\.npz: __key__\[1\] .*not UTF-8"):
        convert(src, tmp_path / "out", opts())


# ------------------------------------------------------------------------- --shard-size for HDF5

def test_hdf5_shard_size_is_estimated_without_tar_headers(tmp_path):
    """--format hdf5 --shard-size counted every value as a tar member (512-byte header, padding to
    512 bytes): rows of 256 bytes gave shards 6x smaller than asked, and 6x as many of them."""
    from fastdata import Manifest

    src = tmp_path / "v.npz"
    np.savez(src, x=np.ones((2000, 64), np.float32), y=np.arange(2000))  # 264 data bytes per row
    target = 128 << 10
    convert(src, tmp_path / "h5", opts(format="hdf5", shard_size=target))
    shards = Manifest.load(tmp_path / "h5").shards
    assert all(s.bytes <= target for s in shards)
    assert len(shards) <= 6  # 2000 rows * ~330 bytes stored = 660 KB: 6 shards at most, 32 before
    assert min(s.bytes for s in shards[:-1]) >= target // 2


def test_hdf5_shard_size_of_a_tar_source(tmp_path):
    from fastdata import Manifest

    src = small_tar(tmp_path / "s.tar", [f"k{i:04d}" for i in range(400)])
    target = 16 << 10
    convert(src, tmp_path / "h5", opts(format="hdf5", shard_size=target))
    shards = Manifest.load(tmp_path / "h5").shards
    assert all(s.bytes <= target for s in shards) and len(shards) <= 12  # 58 before


# ---------------------------------------------------------------- tar SRC mixing image types

def test_hdf5_from_a_tar_mixing_image_types_is_refused_at_planning(tmp_path):
    """Tar samples holding a 'jpg' or a 'png' (either satisfies the sample's image) passed planning
    for --format hdf5, whose every sample needs every field; the first shard job then failed with
    a ValueError naming a DEST shard. Now refused before anything is written, naming SRC and the
    fields, as for an image folder. Tar output and samples holding both still convert."""
    from fastdata.shards.convert import plan_conversion

    def tar(path, members):
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
            for name in members:
                info = tarfile.TarInfo(name)
                info.size = 1
                t.addfile(info, io.BytesIO(b"1"))
        return path

    mixed = tar(tmp_path / "mixed.tar", ["a.cls", "a.jpg", "b.cls", "b.png"])
    with pytest.raises(ConversionError, match=r"mixed\.tar.*\['jpg', 'png'\].*--format tar or --resize"):
        convert(mixed, tmp_path / "h5", opts(format="hdf5", check="header"))
    assert not (tmp_path / "h5").exists()
    both = tar(tmp_path / "both.tar", ["a.jpg", "a.png", "b.jpg", "b.png"])
    assert [f.name for f in plan_conversion(both, opts(format="hdf5")).fields] == ["jpg", "png"]
    # a second image field of its own (not an alternative) may be absent: those samples are skipped, listed
    seg = tar(tmp_path / "seg.tar", ["a.jpg", "a.seg.png", "b.jpg"])
    assert [f.name for f in plan_conversion(seg, opts(format="hdf5")).fields] == ["jpg", "seg.png"]


# -------------------------------------------------------------------------------- image folders

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_a_fifo_named_like_an_image_is_skipped_not_opened(tmp_path):
    """A FIFO (or device) named `x.jpg` in an image folder was planned as an image, and reading it
    blocked the conversion forever. It is now skipped and listed at planning."""
    from fastdata.shards.convert import plan_conversion

    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.png").write_bytes(PNG)
    os.mkfifo(tmp_path / "src" / "cat" / "b.jpg")
    plan = plan_conversion(tmp_path / "src", opts())
    assert plan.listing.keys == ["cat/a"]
    assert plan.listing.skipped == [{"source": "cat/b.jpg", "reason": "not a regular file (a fifo)"}]


def test_tar_folder_lists_a_broken_symlink_and_a_fifo_it_does_not_read(tmp_path):
    """A folder of tar shards (here symlinks to them, one broken: its disk is not mounted) converted
    without the broken one and the fifo, and listed neither: samples lost without a word."""
    from fastdata.shards.convert import plan_conversion

    src = tmp_path / "src"
    src.mkdir()
    small_tar(tmp_path / "a.tar", ["a0", "a1"])
    (src / "a.tar").symlink_to(tmp_path / "a.tar")
    (src / "b.tar").symlink_to(tmp_path / "gone" / "b.tar")
    if hasattr(os, "mkfifo"):
        os.mkfifo(src / "c.tar")
    plan = plan_conversion(src, opts())
    assert plan.listing.keys == ["a0", "a1"]
    skipped = {s["source"]: s["reason"] for s in plan.listing.skipped}
    assert "b.tar" in skipped and "broken symlink" in skipped["b.tar"]
    assert not hasattr(os, "mkfifo") or "fifo" in skipped["c.tar"]
    with pytest.raises(ConversionError, match=r"b\.tar: .*broken symlink.*--strict"):
        convert(src, tmp_path / "out", opts(strict=True))


def test_a_broken_class_folder_symlink_is_an_error_not_a_label_shift(tmp_path):
    """`src/b -> /mnt/other/b` with that disk not mounted: class b was dropped without a word and
    class c took its label 1. Whether it is a class cannot be told: a SourceError naming it."""
    from fastdata.shards.convert import plan_conversion

    src = tmp_path / "src"
    for cls in ("a", "c"):
        (src / cls).mkdir(parents=True)
        (src / cls / "x.png").write_bytes(PNG)
    (src / "b").symlink_to(tmp_path / "unmounted" / "b")
    with pytest.raises(SourceError, match=r"src/b: .*broken symlink.*labels"):
        plan_conversion(src, opts())


def test_bytes_after_a_gzip_stream_holding_a_tar_are_still_ignored(tmp_path):
    """The concatenation check reads on after the end-of-archive blocks: what a decompressor then
    raises (trailing garbage after the gzip stream) must not fail a tar whose members were all read."""
    import gzip

    from fastdata.shards.tar import iter_tar_stream

    raw = small_tar(tmp_path / "a.tar", ["a0", "a1"]).read_bytes()
    stream = gzip.open(io.BytesIO(gzip.compress(raw) + b"garbage!"))
    assert [s["__key__"] for s in iter_tar_stream(stream, "a.tar.gz")] == ["a0", "a1"]


@pytest.mark.parametrize("kind", ["bz2", "lzma"])
def test_a_compressed_tar_named_tar_says_so(tmp_path, kind):
    """`tar --xz -cf x.tar` (or bzip2, zstd): 'truncated tar: header at byte offset 0 is cut off'."""
    import importlib

    from fastdata.shards.tar import TarIndex

    raw = small_tar(tmp_path / "a.tar", ["a0"]).read_bytes()
    packed = tmp_path / "x.tar"
    packed.write_bytes(importlib.import_module(kind).compress(raw))
    with pytest.raises(ShardError, match=r"x\.tar: is (bzip2|xz)-compressed"):
        TarIndex.build(packed)


# --------------------------------------------------------------------------------- HDF5 reading

@pytest.mark.parametrize("stored", [b"", b"\x93NUMPY\x01\x00\x10\x00{'descr': '<u1'  \n"])
def test_hdf5_npy_row_that_does_not_parse_is_a_shard_error(tmp_path, stored):
    """A damaged row of an array field stored as .npy bytes (varying shapes) raised NumPy's bare
    EOFError or tokenize.TokenError, which named nothing and escaped on_error='skip'."""
    import h5py

    import fastdata
    from fastdata.shards.hdf5 import HDF5ShardReader

    with fastdata.ShardWriter(tmp_path / "h", format="hdf5") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "v.npy": np.zeros(i + 1, np.uint8)})
    path = tmp_path / "h" / "shard-000000.h5"
    with h5py.File(path, "r+") as f:
        f["v.npy"][2] = np.frombuffer(stored, np.uint8)
    reader = HDF5ShardReader(path)
    with pytest.raises(ShardError, match=r"shard-000000\.h5: reading field 'v\.npy' of sample 2 \('k2'\)"):
        reader.read(2)
    with pytest.raises(ShardError, match=r"shard-000000\.h5: reading field 'v\.npy' of sample 2 \('k2'\)"):
        list(reader.iter_range())


def test_verify_does_not_open_an_hdf5_shard_whose_checksum_is_wrong(tmp_path, monkeypatch):
    """A damaged HDF5 file can make the HDF5 library spin forever (h5py 3.16 / HDF5 2.0: one flipped
    byte in an attribute) or crash: verify opened a shard after finding its sha256 wrong, so
    `fastdata verify` hung instead of listing it. A shard known to be damaged is no longer opened."""
    import fastdata
    from fastdata.shards import hdf5
    from fastdata.shards.reader import verify

    with fastdata.ShardWriter(tmp_path / "h", format="hdf5") as w:
        w.write({"__key__": "k0", "cls": 1})
    path = tmp_path / "h" / "shard-000000.h5"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))

    def hang(self):
        raise AssertionError("opened a shard known to be damaged")

    monkeypatch.setattr(hdf5.HDF5ShardReader, "_open", hang)
    problems = verify(tmp_path / "h")
    assert len(problems) == 1 and problems[0].startswith("shard-000000.h5: sha256 mismatch")


def test_hdf5_stores_arrays_with_a_zero_length_axis(tmp_path):
    """Fixed-shape arrays with a 0-length axis (no detections: (0, 4) boxes in every sample) failed
    the HDF5 writer with h5py's 'All chunk dimensions must be positive', naming no field or shard."""
    import fastdata

    with fastdata.ShardWriter(tmp_path / "h", format="hdf5") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "boxes.npy": np.zeros((0, 4), np.float32), "cls": i})
    got = list(fastdata.ShardedDataset(tmp_path / "h"))
    assert [s["cls"] for s in got] == [0, 1, 2]
    assert all(s["boxes.npy"].shape == (0, 4) and s["boxes.npy"].dtype == np.float32 for s in got)
    src = tmp_path / "z.npz"
    np.savez(src, e=np.zeros((3, 0)), y=np.arange(3))
    convert(src, tmp_path / "out", opts(format="hdf5"))
    assert [s["e.npy"].shape for s in fastdata.ShardedDataset(tmp_path / "out")] == [(0,)] * 3


def test_hdf5_int_beyond_int64_is_refused_at_write_naming_field_and_key(tmp_path):
    """An int field value beyond int64 was accepted by ShardWriter.write and failed the shard
    later (at close) with a bare 'OverflowError: Python int too large to convert to C long'."""
    import fastdata
    from fastdata.shards.hdf5 import write_hdf5_shard

    w = fastdata.ShardWriter(tmp_path / "h", format="hdf5")
    w.write({"__key__": "k0", "n": 1})
    with pytest.raises(ValueError, match=r"field 'n' of sample 'k1'.*int64"):
        w.write({"__key__": "k1", "n": 2**70})
    w.write({"__key__": "k2", "n": -(2**63)})
    w.close()
    assert [s["n"] for s in fastdata.ShardedDataset(tmp_path / "h")] == [1, -(2**63)]
    with pytest.raises(ValueError, match=r"field 'n' of sample 'b'.*int64"):
        write_hdf5_shard(tmp_path / "x.h5", [{"__key__": "a", "n": 1}, {"__key__": "b", "n": 2**64}])


def test_hdf5_json_value_that_is_not_json_is_refused_at_write(tmp_path):
    """ShardWriter(format='hdf5') accepted {'m.json': {'x': {1, 2}}} and failed at close, after the
    shard's other samples were buffered, saying 'HDF5 cannot store json values ...; tar shards can'
    (tar refuses it too, at write, naming the sample)."""
    import fastdata
    from fastdata.shards.hdf5 import write_hdf5_shard

    w = fastdata.ShardWriter(tmp_path / "h", format="hdf5")
    w.write({"__key__": "k0", "m.json": {"x": [1]}})
    with pytest.raises(TypeError, match=r"field 'm\.json' of sample 'k1' is not JSON-serialisable"):
        w.write({"__key__": "k1", "m.json": {"x": {1, 2}}})
    w.close()
    assert [s["m.json"] for s in fastdata.ShardedDataset(tmp_path / "h")] == [{"x": [1]}]
    with pytest.raises(TypeError, match=r"field 'm' of sample 'b' is not JSON-serialisable"):
        write_hdf5_shard(tmp_path / "x.h5", [{"__key__": "a", "m": [1]}, {"__key__": "b", "m": [object()]}])


# ----------------------------------------------------------------------------------------- CLI

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


# ------------------------------------------------------------------ a fastdata folder as SRC

def test_resharding_a_fastdata_folder_keeps_its_class_names(tmp_path):
    """The 'cls' labels' names live in manifest.json under extra.source.classes; converting the
    folder again (tar -> HDF5, other shard sizes) wrote a manifest without them."""
    from fastdata import Manifest

    src = tmp_path / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        (src / cls / "x.png").write_bytes(PNG)
    convert(src, tmp_path / "a", opts())
    convert(tmp_path / "a", tmp_path / "b", opts(format="hdf5"))
    assert Manifest.load(tmp_path / "b").extra["source"]["classes"] == ["cat", "dog"]


# -------------------------------------------------------------------------------------- verify

def test_verify_lists_a_manifest_field_that_no_tar_shard_holds(tmp_path, capsys):
    """A manifest listing a field no shard holds passed `verify` ("ok"), and every read then failed
    with MissingFieldError. An image field with an alternative some shard holds (jpg|png) is fine."""
    import json

    import fastdata
    from fastdata.cli._shard_cmd import verify_folder
    from fastdata.shards.reader import verify

    with fastdata.ShardWriter(tmp_path / "t", max_samples=1) as w:
        w.write({"__key__": "a", "cls": 0, "jpg": b"x"})
        w.write({"__key__": "b", "cls": 1, "jpg": b"y"})
    path = tmp_path / "t" / "manifest.json"
    data = json.loads(path.read_text())
    data["fields"] += [{"name": "png", "kind": "bytes"}, {"name": "txt", "kind": "text"}]
    path.write_text(json.dumps(data))
    expected = ["manifest.json lists field(s) ['txt'] that no shard holds: every read of a sample "
                "fails (MissingFieldError)"]
    assert verify(tmp_path / "t") == expected
    assert verify_folder(tmp_path / "t", workers=2, progress=False) == expected
    data["fields"] = [f for f in data["fields"] if f["name"] != "txt"]
    path.write_text(json.dumps(data))
    assert verify(tmp_path / "t") == [] and verify_folder(tmp_path / "t", progress=False) == []
