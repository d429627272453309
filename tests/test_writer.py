"""ShardWriter (rolling, atomic shards, manifest last), open_shard and verify."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest

from fastdata.manifest import FieldInfo, Manifest
from fastdata.shards.reader import ShardReader, open_shard, verify
from fastdata.shards.writer import ShardWriter


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
