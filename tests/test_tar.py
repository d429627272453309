"""Tar shards: deterministic writing, sidecar vs scanned index, random access, bad input."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import tarfile

import numpy as np
import pytest

from fastdata.errors import ShardError
from fastdata.shards._keys import check_key, encode_value, member_name, split_member_name
from fastdata.shards.tar import TarIndex, TarShardReader, iter_tar_stream, write_tar_shard


def payload(i: int, field: str = "jpg") -> bytes:
    """Predictable bytes derived from the sample index (sizes cross 512-byte block edges)."""
    n = (i * 397 + len(field) * 31) % 3000
    return bytes((i * 7 + j + len(field)) % 256 for j in range(n))


def make_samples(n: int, prefix: str = "train/n01.x/s") -> list[dict]:
    return [{"__key__": f"{prefix}{i:05d}", "jpg": payload(i), "cls": i % 10, "seg.png": payload(i, "seg.png")}
            for i in range(n)]


def expected(sample: dict) -> dict:
    return {k: (v if k == "__key__" else encode_value(k, v)) for k, v in sample.items()}


@pytest.fixture()
def shard(tmp_path):
    samples = make_samples(40)
    info = write_tar_shard(tmp_path / "shard-000000.tar", samples)
    return tmp_path / "shard-000000.tar", samples, info


def test_round_trip_byte_exact(shard):
    path, samples, info = shard
    reader = TarShardReader(path)
    assert len(reader) == info.num_samples == 40
    assert list(reader.keys) == [s["__key__"] for s in samples]
    assert list(reader.iter_range()) == [expected(s) for s in samples]
    for i in (17, 0, 39, 5):  # random access
        assert reader.read(i) == expected(samples[i])
    assert info.bytes == os.path.getsize(path) and info.index == "shard-000000.tar.idx"


def test_sidecar_index_equals_header_scan(shard):
    path, _, _ = shard
    assert TarIndex.load(str(path) + ".idx") == TarIndex.build(path)


def test_read_selected_fields_and_ranges(shard):
    path, samples, _ = shard
    reader = TarShardReader(path)
    assert reader.read(3, fields={"cls"}) == {"__key__": samples[3]["__key__"], "cls": b"3"}
    assert reader.read(3, fields="cls") == reader.read(3, fields=["cls"])  # a str is one field name
    got = list(reader.iter_range(10, 13, fields=["jpg"]))
    assert [g["jpg"] for g in got] == [payload(i) for i in range(10, 13)]
    with pytest.raises(IndexError, match="sample index 40 out of range"):
        reader.read(40)
    with pytest.raises(IndexError, match="range 5:41"):
        list(reader.iter_range(5, 41))


def test_deterministic_output(tmp_path):
    a = write_tar_shard(tmp_path / "a.tar", make_samples(25))
    b = write_tar_shard(tmp_path / "b.tar", make_samples(25))
    assert a.sha256 == b.sha256
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert (tmp_path / "a.tar.idx").read_bytes() == (tmp_path / "b.tar.idx").read_bytes()


def test_tar_members_are_standard(shard):
    path, samples, _ = shard
    with tarfile.open(path) as tf:
        members = tf.getmembers()
        assert [m.name for m in members[:3]] == [f"{samples[0]['__key__']}.{f}" for f in ("cls", "jpg", "seg.png")]
        assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" and m.mode == 0o444 for m in members)
        assert tf.extractfile(members[4]).read() == payload(1)


def test_without_sidecar_builds_index(shard):
    path, samples, _ = shard
    os.remove(str(path) + ".idx")
    assert TarShardReader(path).read(7) == expected(samples[7])


def test_stream_reader(shard):
    path, samples, _ = shard
    with open(path, "rb") as f:
        assert list(iter_tar_stream(f, str(path))) == [expected(s) for s in samples]


def test_key_splitting_rules():
    assert split_member_name("train/n0144.x/img001.seg.png") == ("train/n0144.x/img001", "seg.png")
    assert member_name("a.b/c.d/e", "img.npy") == "a.b/c.d/e.img.npy"
    for bad, why in [("img.001", "contains a dot"), ("", "empty"), ("/abs", "starts with '/'"),
                     ("a/../b", "'..'"), ("__meta", "reserved"), ("a\x00b", "NUL"), ("a//b", "empty")]:
        with pytest.raises(ValueError, match=why):
            check_key(bad)


def test_writer_rejects_ambiguous_and_duplicate_keys(tmp_path):
    with pytest.raises(ValueError, match=r"invalid sample key 'dir/img\.001'"):
        write_tar_shard(tmp_path / "x.tar", [{"__key__": "dir/img.001", "jpg": b"x"}])
    with pytest.raises(ValueError, match="duplicate key 'k1'"):
        write_tar_shard(tmp_path / "x.tar", [{"__key__": "k1", "jpg": b"x"}, {"__key__": "k1", "jpg": b"y"}])
    with pytest.raises(TypeError, match="cannot encode field 'jpg' of sample 'k'"):
        write_tar_shard(tmp_path / "x.tar", [{"__key__": "k", "jpg": object()}])
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_encode_values():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    assert np.array_equal(np.load(io.BytesIO(encode_value("x.npy", arr))), arr)
    assert encode_value("meta.json", {"b": 1, "a": [1]}) == b'{"a": [1], "b": 1}'
    assert encode_value("txt", "héllo") == "héllo".encode()
    assert encode_value("cls", 7) == b"7"
    with pytest.raises(TypeError, match="'arr'"):
        encode_value("arr", arr)


def test_truncated_tar_names_shard_and_offset(shard):
    path, _, _ = shard
    data = path.read_bytes()
    cut = tmp = path.with_name("cut.tar")
    tmp.write_bytes(data[:5000])
    with pytest.raises(ShardError, match=r"cut\.tar: truncated tar: member data at byte offset \d+"):
        TarIndex.build(cut)
    with open(cut, "rb") as f, pytest.raises(ShardError, match=r"cut\.tar.*byte offset \d+"):
        list(iter_tar_stream(f, str(cut)))
    tmp.write_bytes(data[:1024])  # cut at a member boundary: looks like a shorter tar to `tar tf`
    with pytest.raises(ShardError, match=r"cut\.tar: truncated tar: ends at byte offset 1024 without"):
        TarIndex.build(cut)
    with open(cut, "rb") as f, pytest.raises(ShardError, match=r"cut\.tar: truncated tar: ends at byte offset 1024"):
        list(iter_tar_stream(f, str(cut)))
    tmp.write_bytes(data[:1100])  # cut inside a header
    with pytest.raises(ShardError, match=r"header at byte offset \d+ is cut off"):
        TarIndex.build(cut)


def test_stale_sidecar_detected(shard):
    path, _, _ = shard
    with open(path, "ab") as f:
        f.write(bytes(512))
    with pytest.raises(ShardError, match="shard-000000.tar.*changed or truncated"):
        len(TarShardReader(path))


def test_corrupt_header_checksum(shard):
    path, _, _ = shard
    data = bytearray(path.read_bytes())
    data[1024 + 5] ^= 0xFF  # inside the second member's header name
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-000000\.tar: bad tar header checksum at byte offset 1024"):
        TarIndex.build(path)


def test_non_consecutive_key_rejected(tmp_path):
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tf:
        for name in ("a.jpg", "b.jpg", "a.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ShardError, match=r"bad\.tar: key 'a' reappears at byte offset 2048"):
        TarIndex.build(path)


def _child_read(reader: TarShardReader, i: int, queue) -> None:
    queue.put(reader.read(i))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_reader_pickles_and_works_in_child(shard, method):
    path, samples, _ = shard
    reader = TarShardReader(path)
    reader.read(0)  # opens the map in the parent first
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.read(9) == expected(samples[9])
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_read, args=(reader, 11, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and got == expected(samples[11])


def test_corrupt_sidecar_index(shard):
    path, _, _ = shard
    idx = path.with_name(path.name + ".idx")
    data = bytearray(idx.read_bytes())
    data[-3] ^= 0x10
    idx.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-000000\.tar\.idx: not a valid fastdata tar index: .*checksum"):
        len(TarShardReader(path))
    idx.write_bytes(b"garbage")
    with pytest.raises(ShardError, match="bad magic"):
        TarIndex.load(idx)
