"""ShardWriter (rolling, atomic shards, manifest last), open_shard and verify; the values and arguments
it refuses, naming the field, key or argument."""
from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from fastdata import ShardedDataset
from fastdata.errors import FastdataError
from fastdata.manifest import FieldInfo, Manifest
from fastdata.shards.reader import ShardReader, open_shard, verify
from fastdata.shards.writer import ShardWriter


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(1000 + (i * 97) % 900))


def sample(i: int) -> dict:
    return {"__key__": f"c{i % 3}/k.{i % 2}/s{i:04d}", "jpg": payload(i), "cls": i % 3,
            "img.npy": np.full((2, 3), i, np.int16)}


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_rolls_and_round_trips(tmp_path, fmt):
    with ShardWriter(tmp_path / "out", format=fmt, max_samples=7, extra={"source": "test"}) as w:
        for i in range(30):
            w.write(sample(i))
        w.skip("bad.jpg", "truncated")
    m = Manifest.load(tmp_path / "out")
    assert m == w.manifest and m.format == fmt and m.num_samples == 30
    assert [s.num_samples for s in m.shards] == [7, 7, 7, 7, 2]
    assert m.shards[0].name == ("shard-000000.tar" if fmt == "tar" else "shard-000000.h5")
    assert m.fields == (FieldInfo("cls", "int"), FieldInfo("img.npy", "array", "int16", (2, 3)),
                        FieldInfo("jpg", "bytes"))
    assert m.skipped == ({"source": "bad.jpg", "reason": "truncated"},) and m.extra == {"source": "test"}
    got = []
    for info in m.shards:
        reader = open_shard(tmp_path / "out", info, format=fmt)
        assert isinstance(reader, ShardReader) and len(reader) == info.num_samples
        got.extend(reader.iter_range(fields={"jpg"}))
    assert [g["jpg"] for g in got] == [payload(i) for i in range(30)]
    assert [g["__key__"] for g in got] == [sample(i)["__key__"] for i in range(30)]
    assert verify(tmp_path / "out") == []
    assert not [p for p in os.listdir(tmp_path / "out") if p.endswith(".tmp")]


def test_rolls_by_bytes(tmp_path):
    limit = 12 * 1024
    with ShardWriter(tmp_path, max_bytes=limit) as w:
        for i in range(40):
            w.write(sample(i))
    sizes = [s.bytes for s in w.manifest.shards]
    assert len(sizes) > 3 and all(s <= limit for s in sizes)
    with ShardWriter(tmp_path / "big", max_bytes=1024) as w:  # a sample bigger than the limit
        w.write(sample(0))
        w.write(sample(1))
    assert [s.num_samples for s in w.manifest.shards] == [1, 1]


def test_duplicate_keys_and_bad_input(tmp_path):
    w = ShardWriter(tmp_path / "a", max_samples=2)
    for i in range(3):
        w.write(sample(i))
    with pytest.raises(ValueError, match=r"duplicate key 'c0/k.0/s0000'"):
        w.write(sample(0))  # already in an earlier shard
    with pytest.raises(ValueError, match=r"invalid sample key 'x/a.b'"):
        w.write({"__key__": "x/a.b", "jpg": b""})
    with pytest.raises(ValueError, match="'__key__'"):
        w.write({"jpg": b""})
    with pytest.raises(TypeError, match="cannot encode field 'arr' of sample 'x/y'"):
        w.write({"__key__": "x/y", "jpg": b"", "arr": np.zeros(2)})  # arrays go in '.npy' fields
    with pytest.raises(ValueError, match="field 'jpg' of sample 'x/z' is 'int' but earlier samples had 'bytes'"):
        w.write({"__key__": "x/z", "new": b"", "jpg": 1})
    w.write({"__key__": "x/y", "jpg": b""})  # the rejected samples left no key and no field behind
    w.close()
    assert Manifest.load(tmp_path / "a").num_samples == 4
    assert [f.name for f in Manifest.load(tmp_path / "a").fields] == ["cls", "img.npy", "jpg"]
    with pytest.raises(ValueError, match="format must be 'tar' or 'hdf5', got 'zip'"):
        ShardWriter(tmp_path / "b", format="zip")
    with pytest.raises(ValueError, match="max_samples must be None or an int >= 1, got 0"):
        ShardWriter(tmp_path / "b", max_samples=0)


def test_existing_destination(tmp_path):
    with ShardWriter(tmp_path / "d") as w:
        w.write(sample(1))
    with pytest.raises(FileExistsError, match="is not empty"):
        ShardWriter(tmp_path / "d")
    (tmp_path / "d" / "keep.txt").write_text("x")
    with ShardWriter(tmp_path / "d", overwrite=True) as w:
        w.write(sample(2))
    assert sorted(os.listdir(tmp_path / "d")) == ["keep.txt", "manifest.json", "shard-000000.tar",
                                                  "shard-000000.tar.idx"]


def test_no_manifest_after_exception(tmp_path):
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, max_samples=2) as w:
        for i in range(3):
            w.write(sample(i))
        raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["shard-000000.tar", "shard-000000.tar.idx"]


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_verify_detects_problems(tmp_path, fmt):
    with ShardWriter(tmp_path, format=fmt, max_samples=4) as w:
        for i in range(10):
            w.write(sample(i))
    name = w.manifest.shards[1].name
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    problems = verify(tmp_path)  # every problem is listed (a flipped bit may also break a header), all of shard 1
    assert problems and problems[0].startswith(f"{name}: sha256 mismatch")
    assert all(name in p for p in problems)
    os.remove(tmp_path / w.manifest.shards[2].name)
    assert verify(tmp_path)[len(problems)] == f"{w.manifest.shards[2].name}: shard file is missing"


def test_verify_tar_index_mismatch_and_bad_manifest(tmp_path):
    with ShardWriter(tmp_path, max_samples=4) as w:
        for i in range(8):
            w.write(sample(i))
    (tmp_path / "shard-000001.tar.idx").write_bytes((tmp_path / "shard-000000.tar.idx").read_bytes())
    assert verify(tmp_path) == ["shard-000001.tar: index file shard-000001.tar.idx does not match the shard's headers"]
    (tmp_path / "manifest.json").write_text("[]")
    assert "top level must be a JSON object" in verify(tmp_path)[0]


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_write_copies_the_sample(tmp_path, fmt):
    """A caller may reuse its buffers after write(): what was written is what write() was given."""
    arr, buf = np.zeros(4, np.uint8), bytearray(3)
    with ShardWriter(tmp_path, format=fmt) as w:
        for i in range(3):
            arr[:] = i
            buf[:] = bytes([i]) * 3
            sample = {"__key__": f"k{i}", "x.npy": arr, "bin": buf}
            w.write(sample)
            sample["__key__"] = "changed"
    reader = open_shard(tmp_path, w.manifest.shards[0], format=fmt)
    got = [reader.read(i) for i in range(3)]
    assert [g["__key__"] for g in got] == ["k0", "k1", "k2"]
    assert [bytes(g["bin"]) for g in got] == [bytes([i]) * 3 for i in range(3)]
    if fmt == "tar":
        assert [np.load(io.BytesIO(g["x.npy"])).tolist() for g in got] == [[i] * 4 for i in range(3)]
    else:
        assert [g["x.npy"].tolist() for g in got] == [[i] * 4 for i in range(3)]


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


def test_file_urls_are_local_paths_for_shard_writer_and_shard_sources(tmp_path, monkeypatch):
    from fastdata.shards._sources import list_source

    monkeypatch.chdir(tmp_path)
    m = _write(f"file://{tmp_path}/ds", 2)  # was a folder literally named 'file:' in the current folder
    assert m.num_samples == 2 and (tmp_path / "ds" / "manifest.json").is_file() and not (tmp_path / "file:").exists()
    assert len(list_source(f"file://{tmp_path}/ds").keys) == 2  # was "SRC file://...: no such file or directory"
    with pytest.raises(ValueError, match="is a URL; ShardWriter writes a local folder"):
        ShardWriter("s3://bucket/ds")
    assert not (tmp_path / "s3:").exists()


def test_shard_writer_hdf5_refuses_a_sample_with_other_fields_when_written(tmp_path):
    """Before: a later HDF5 shard with one more field gave a manifest listing it for every shard;
    reading then failed with 'the shard was replaced or changed after the manifest was written'."""
    from fastdata import ShardWriter

    with ShardWriter(tmp_path / "out", format="hdf5", max_samples=2) as writer:
        writer.write({"__key__": "a", "x.npy": np.zeros(3)})
        writer.write({"__key__": "b", "x.npy": np.zeros(3)})
        with pytest.raises(ValueError, match=r"sample 'c'.*lacks \[\] and adds \['cls'\]"):
            writer.write({"__key__": "c", "x.npy": np.zeros(3), "cls": 1})
        with pytest.raises(ValueError, match=r"sample 'd'.*lacks \['x.npy'\]"):
            writer.write({"__key__": "d", "cls": 1})
        writer.write({"__key__": "e", "x.npy": np.ones(3)})
    manifest = Manifest.load(tmp_path / "out")
    assert [f.name for f in manifest.fields] == ["x.npy"] and manifest.num_samples == 3
    assert verify(tmp_path / "out") == []


def test_shard_writer_destination_errors_are_fastdata_errors(tmp_path):
    """A non-empty or non-folder destination raised plain FileExistsError/NotADirectoryError."""
    from fastdata import ShardWriter

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FastdataError, match=r"full is not empty") as info:
        ShardWriter(tmp_path / "full")
    assert isinstance(info.value, FileExistsError)
    with pytest.raises(FastdataError, match=r"file exists and is not a folder") as info:
        ShardWriter(tmp_path / "file")
    assert isinstance(info.value, NotADirectoryError)


def test_shard_writer_extra_must_be_json_when_given(tmp_path):
    """Before: a datetime in extra= failed close() after every shard was written, with "Object of
    type datetime is not JSON serializable"; a second close() then returned a manifest never saved."""
    import datetime

    from fastdata import ShardWriter

    with pytest.raises(TypeError, match=r"extra= must hold JSON values.*datetime"):
        ShardWriter(tmp_path / "out", extra={"made": datetime.datetime(2026, 1, 1)})
    writer = ShardWriter(tmp_path / "ok", extra={"n": 3})
    writer.write({"__key__": "a", "txt": "x"})
    writer.extra["late"] = {1, 2}  # a set, added after construction
    with pytest.raises(TypeError):
        writer.close()
    with pytest.raises(TypeError):
        writer.close()  # still not written: it says so again
    assert not (tmp_path / "ok" / "manifest.json").exists()


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_shard_writer_refuses_values_the_field_suffix_cannot_read_back(tmp_path, fmt):
    # A float label (a pandas column with a NaN somewhere is float64) was written to a tar as "3.0", which the
    # `cls` decoding cannot read: every sample of the set failed at read time (HDF5 gave the float back); a
    # list in an `.npy` field was accepted by the HDF5 writer and failed at read time.
    import numpy as np

    import fastdata

    writer = fastdata.ShardWriter(tmp_path / "out", format=fmt)
    for field, value in (("cls", 3.0), ("cls", np.float64(2.0)), ("x.index", 1.5), ("v.npy", [1, 2]),
                         ("v.npy", 0.5), ("v.npy", "abc")):
        with pytest.raises(TypeError, match=rf"field {field!r} of sample 'a'.*{type(value).__name__}"):
            writer.write({"__key__": "a", field: value})
    writer.write({"__key__": "a", "cls": np.int64(3), "v.npy": np.zeros(2)})
    writer.close()
    assert [(s["cls"], s["v.npy"].tolist()) for s in ShardedDataset(tmp_path / "out")] == [(3, [0.0, 0.0])]


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_shard_writer_refuses_text_the_field_suffix_cannot_parse(tmp_path, fmt):
    # Text a field's suffix cannot parse was written and failed at every read: a class name in `cls`, plain text in
    # a `.json` field. Bytes stay stored as given (the raw form: other tests write undecodable samples with it).
    import json

    import numpy as np

    import fastdata
    from fastdata.shards.tar import encode_value

    writer = fastdata.ShardWriter(tmp_path / "out", format=fmt)
    for field, value, what in (("cls", "cat", "not an int"), ("x.cls", "3.0", "not an int"),
                               ("meta.json", "hello", "not JSON"), ("meta.json", "{'a': 1}", "not JSON")):
        with pytest.raises(ValueError, match=rf"field {field!r} of sample 'a'.*{what}"):
            writer.write({"__key__": "a", field: value})
    writer.write({"__key__": "a", "cls": " 3\n", "meta.json": json.dumps({"x": 1}), "t.json": b"[1]",
                  "v.npy": encode_value("v.npy", np.arange(2))})
    writer.close()
    (s,) = ShardedDataset(tmp_path / "out")
    assert (s["cls"], s["meta.json"], s["t.json"], s["v.npy"].tolist()) == (3, {"x": 1}, [1], [0, 1])


def test_bool_values_are_stored_as_the_ints_the_manifest_records(tmp_path):
    """A bool is recorded as kind 'int' (HDF5 stores 1/0), but tar members held 'True'/'False':
    a bool label in 'cls' then failed every read with a DecodeError (webdataset's too)."""
    import fastdata

    with fastdata.ShardWriter(tmp_path / "t") as w:
        w.write({"__key__": "a", "cls": True, "flag.cls": np.bool_(False)})
    assert fastdata.Manifest.load(tmp_path / "t").field("cls").kind == "int"
    assert list(fastdata.ShardedDataset(tmp_path / "t")) == [{"__key__": "a", "cls": 1, "flag.cls": 0}]
