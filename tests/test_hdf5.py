"""HDF5 shards: documented layout, byte-exact round trips, block reads, bad layouts, pickling."""
from __future__ import annotations

import multiprocessing as mp
import pickle

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from fastdata.errors import ShardError  # noqa: E402
from fastdata.manifest import FieldInfo  # noqa: E402
from fastdata.shards.hdf5 import HDF5ShardReader, write_hdf5_shard  # noqa: E402


def payload(i: int) -> bytes:
    return bytes((i * 13 + j) % 256 for j in range((i * 211) % 1500))


def make_samples(n: int) -> list[dict]:
    return [{
        "__key__": f"val/n02.y/s{i:04d}",
        "jpg": payload(i),
        "cls": i % 7,
        "txt": f"caption {i} é",
        "img.npy": np.full((3, 5, 4), i % 256, np.uint8) + np.arange(4, dtype=np.uint8),
        "var.npy": np.arange(i % 5, dtype=np.float32),
        "meta.json": {"i": i},
        "score": i / 4,
    } for i in range(n)]


def expected(s: dict) -> dict:
    return {"__key__": s["__key__"], "jpg": s["jpg"], "cls": s["cls"], "txt": s["txt"].encode(),
            "img.npy": s["img.npy"], "var.npy": s["var.npy"], "meta.json": b'{"i": %d}' % s["meta.json"]["i"],
            "score": s["score"]}


def same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert isinstance(got[k], np.ndarray) and got[k].dtype == v.dtype and np.array_equal(got[k], v), k
        else:
            assert type(got[k]) is type(v) and got[k] == v, k


@pytest.fixture()
def shard(tmp_path):
    samples = make_samples(300)
    info = write_hdf5_shard(tmp_path / "shard-000000.h5", samples)
    return tmp_path / "shard-000000.h5", samples, info


def test_round_trip_and_random_access(shard):
    path, samples, info = shard
    reader = HDF5ShardReader(path)
    assert len(reader) == info.num_samples == 300 and info.index is None
    assert list(reader.keys) == [s["__key__"] for s in samples]
    got = list(reader.iter_range())
    assert len(got) == 300
    for g, s in zip(got, samples):
        same(g, expected(s))
    for i in (299, 0, 150, 7):
        same(reader.read(i), expected(samples[i]))
    assert reader.read(4, fields={"cls"}) == {"__key__": samples[4]["__key__"], "cls": 4}
    part = list(reader.iter_range(250, 260, fields=["img.npy"]))
    assert [p["__key__"] for p in part] == [s["__key__"] for s in samples[250:260]]
    assert all(np.array_equal(p["img.npy"], s["img.npy"]) for p, s in zip(part, samples[250:260]))


def test_documented_layout_with_plain_h5py(shard):
    path, samples, _ = shard
    with h5py.File(path, "r") as f:
        assert f.attrs["fastdata_format"] == "hdf5" and f.attrs["fastdata_version"] == 1
        assert f.attrs["num_samples"] == 300
        assert f["__key__"].asstr()[3] == samples[3]["__key__"]
        assert f["img.npy"].shape == (300, 3, 5, 4) and f["img.npy"].chunks[0] >= 1
        assert f["jpg"][5].tobytes() == samples[5]["jpg"]
        assert f["cls"].dtype == np.int64 and f["score"].dtype == np.float64
        assert {k: f[k].attrs["kind"] for k in f if k != "__key__"} == {
            "cls": "int", "img.npy": "array", "jpg": "bytes", "meta.json": "json", "score": "float",
            "txt": "text", "var.npy": "array"}
        assert f["var.npy"].attrs["encoding"] == "npy"


def test_deterministic_output(tmp_path):
    # same samples, same shard name -> same bytes (the name is recorded: a swapped shard is caught on open)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_hdf5_shard(tmp_path / "a" / "shard-000000.h5", make_samples(20))
    b = write_hdf5_shard(tmp_path / "b" / "shard-000000.h5", make_samples(20))
    assert a.sha256 == b.sha256


def test_given_fields_are_enforced(tmp_path):
    samples = make_samples(3)
    fields = [FieldInfo("cls", "int"), FieldInfo("img.npy", "array", "uint8", (3, 5, 5))]
    with pytest.raises(ValueError, match=r"sample 'val/n02.y/s0000'.*unexpected \['jpg'"):
        write_hdf5_shard(tmp_path / "x.h5", samples, fields=fields)
    slim = [{"__key__": s["__key__"], "cls": s["cls"], "img.npy": s["img.npy"]} for s in samples]
    with pytest.raises(ValueError, match=r"field 'img.npy' of sample 'val/n02.y/s0000' has shape \(3, 5, 4\)"):
        write_hdf5_shard(tmp_path / "x.h5", slim, fields=fields)
    with pytest.raises(ValueError, match="duplicate key 'val/n02.y/s0000'"):
        write_hdf5_shard(tmp_path / "x.h5", slim + slim[:1])
    assert not list(tmp_path.iterdir())


def _rewrite(path, edit) -> None:
    with h5py.File(path, "a") as f:
        edit(f)


@pytest.mark.parametrize("edit, match", [
    (lambda f: f.__delitem__("__key__"), "dataset '__key__' is missing"),
    (lambda f: f.attrs.__setitem__("fastdata_format", "tar"), "root attribute 'fastdata_format' is 'tar'"),
    (lambda f: f.attrs.__setitem__("num_samples", 5),
     "root attribute 'num_samples' is 5 but dataset '__key__' has 300 rows"),
    (lambda f: f["jpg"].attrs.__setitem__("kind", "blob"), "dataset 'jpg' has attribute 'kind' 'blob'"),
    (lambda f: (f.__delitem__("cls"), f.create_dataset("cls", data=np.zeros(300, np.float32)),
                f["cls"].attrs.__setitem__("kind", "int")), "dataset 'cls' of kind 'int' has the wrong type"),
    (lambda f: (f.__delitem__("txt"), f.create_dataset("txt", data=np.zeros(10, np.uint8)),
                f["txt"].attrs.__setitem__("kind", "text")), r"dataset 'txt' has shape \(10,\), expected 300 rows"),
    (lambda f: f.create_group("extra"), "'extra' must be a dataset"),
])
def test_bad_layout_names_dataset(shard, edit, match):
    path, _, _ = shard
    _rewrite(path, edit)
    with pytest.raises(ShardError, match=f"shard-000000.h5: not a fastdata HDF5 shard: {match}"):
        len(HDF5ShardReader(path))


def test_not_hdf5(tmp_path):
    path = tmp_path / "x.h5"
    path.write_bytes(b"not hdf5 at all")
    with pytest.raises(ShardError, match=r"x\.h5: cannot open as HDF5"):
        HDF5ShardReader(path).read(0)


def _child_read(reader: HDF5ShardReader, i: int, queue) -> None:
    out = reader.read(i)
    queue.put({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in out.items()})


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_reader_pickles_and_works_in_child(shard, method):
    path, samples, _ = shard
    reader = HDF5ShardReader(path, rdcc_nbytes=1 << 20, rdcc_nslots=101)
    reader.read(0)  # parent holds an open handle before forking
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.rdcc_nbytes == 1 << 20
    same(clone.read(9), expected(samples[9]))
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_read, args=(reader, 11, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert got["__key__"] == samples[11]["__key__"] and got["img.npy"] == samples[11]["img.npy"].tolist()
    same(reader.read(12), expected(samples[12]))  # the parent's handle still works


def test_vlen_fields_whose_values_all_have_the_same_length(tmp_path):
    from fastdata.shards.hdf5 import HDF5ShardReader, write_hdf5_shard

    samples = [{"__key__": f"k{i}", "txt": f"t{i}", "bin": bytes([i, i])} for i in range(5)]
    write_hdf5_shard(tmp_path / "s.h5", samples)
    reader = HDF5ShardReader(tmp_path / "s.h5")
    assert [reader.read(i)["txt"] for i in range(5)] == [f"t{i}".encode() for i in range(5)]
    assert reader.read(3)["bin"] == bytes([3, 3])
