"""HDF5 shards: documented layout, byte-exact round trips, block reads, bad layouts, pickling, and the
values HDF5 cannot store as they are (npy rows, 0-d and 0-length arrays, big ints, non-JSON)."""
from __future__ import annotations

import multiprocessing as mp
import pickle

import numpy as np
import pytest

from fastdata.errors import FastdataError
from fastdata.manifest import Manifest
from fastdata.shards.convert import convert
from fastdata.shards.reader import open_shard, verify
from tests.helpers.images import flat_png
from tests.helpers.sources import H5_METADATA, flip_bytes, h5_folder, opts


h5py = pytest.importorskip("h5py")

from fastdata.errors import ShardError  # noqa: E402
from fastdata.manifest import FieldInfo  # noqa: E402
from fastdata.shards.hdf5 import HDF5ShardReader, write_hdf5_shard  # noqa: E402


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


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


def test_corrupt_hdf5_shard_is_a_shard_error_naming_it(tmp_path):
    """Before: KeyError/RuntimeError/OSError/UnicodeDecodeError straight from h5py, without the shard,
    which also escaped ``on_error="skip"`` (it catches FastdataError and OSError)."""
    out, manifest = h5_folder(tmp_path)
    shard = manifest.shards[0]
    orig = (out / shard.name).read_bytes()
    for off in H5_METADATA:  # until h5py raised something other than an OSError (a few offsets in)
        flip_bytes(out / shard.name, off)
        try:
            reader = open_shard(out, shard, format="hdf5", fields=manifest.fields)
            for i in range(len(reader)):
                reader.read(i)
            list(reader.iter_range())
            reader.close()
        except FastdataError as e:
            assert shard.name in str(e)
            if e.__cause__ is not None and not isinstance(e.__cause__, OSError):
                break
        (out / shard.name).write_bytes(orig)
    else:
        pytest.skip("no corruption tried here makes this h5py raise anything but OSError")


def test_hdf5_reader_names_a_manifest_dtype_numpy_does_not_know(tmp_path):
    """Before: "TypeError: data type 'garbage' not understood", naming neither manifest nor shard."""
    import json

    from fastdata import ShardWriter

    with ShardWriter(tmp_path / "h5", format="hdf5") as writer:
        writer.write({"__key__": "k", "x.npy": np.zeros((2, 2), np.float32)})
    data = json.loads((tmp_path / "h5" / "manifest.json").read_text())
    data["fields"][0]["dtype"] = "garbage"
    (tmp_path / "h5" / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.load(tmp_path / "h5")
    with pytest.raises(ShardError, match=r"shard-000000\.h5: the manifest gives field 'x.npy' dtype 'garbage'"):
        len(open_shard(tmp_path / "h5", manifest.shards[0], format="hdf5", fields=manifest.fields))


def test_hdf5_shard_with_a_key_twice_is_refused(tmp_path):
    """The documented layout can be written with plain h5py; a repeated key was served twice."""
    import h5py

    out, manifest = h5_folder(tmp_path)
    with h5py.File(out / manifest.shards[0].name, "r+") as f:
        keys = f["__key__"].asstr()[:].tolist()
        f["__key__"][3] = keys[1]
    with pytest.raises(ShardError, match=rf"shard-000000\.h5: .*key '{keys[1]}' twice \(rows 1 and 3\)"):
        len(HDF5ShardReader(out / manifest.shards[0].name))


def test_hdf5_zero_dimensional_arrays_read_back_as_arrays(tmp_path):
    """A 0-d array field came back as a NumPy scalar (np.float64), unlike from a tar shard."""
    from fastdata.shards.hdf5 import write_hdf5_shard

    write_hdf5_shard(tmp_path / "z.h5", [{"__key__": k, "x.npy": np.array(float(i))} for i, k in enumerate("ab")])
    reader = HDF5ShardReader(tmp_path / "z.h5")
    for value in (reader.read(1)["x.npy"], list(reader.iter_range())[1]["x.npy"]):
        assert isinstance(value, np.ndarray) and value.shape == () and value == 1.0


def test_arrays_hdf5_has_no_number_type_for_are_stored_as_npy_rows(tmp_path):
    """Before: "TypeError: data type 'str64' not understood" from inside h5py/NumPy, naming nothing; then
    a TypeError naming the field. Now the manifest spells the dtype so that np.dtype() parses it
    ('<U2'), and HDF5 shards keep such arrays as .npy rows. Tar shards store them, and their manifest loads."""
    from fastdata import ShardWriter
    from fastdata.shards.hdf5 import write_hdf5_shard

    for value in (np.array(["ab", "c"]), np.array([1, 2], dtype="datetime64[s]")):
        write_hdf5_shard(tmp_path / "z.h5", [{"__key__": "a", "x.npy": value}])
        got = HDF5ShardReader(tmp_path / "z.h5").read(0)["x.npy"]
        assert got.dtype == value.dtype and (got == value).all()
    with ShardWriter(tmp_path / "tar") as writer:
        writer.write({"__key__": "a", "x.npy": np.array(["ab", "c"])})
    assert Manifest.load(tmp_path / "tar").num_samples == 1 and verify(tmp_path / "tar") == []


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


def test_hdf5_fixed_shape_one_dimensional_uint8_arrays_come_back_as_arrays(tmp_path):
    # the decoder took every 1-D uint8 array for encoded bytes: an HDF5 "emb.npy" field of shape (8,) failed
    # every sample ("the magic string is not correct"), and a "tokens" field came back as bytes
    pytest.importorskip("h5py")
    from fastdata.dataset import ShardedDataset
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "h5", format="hdf5") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "emb.npy": np.arange(8, dtype=np.uint8) + i, "tokens": np.full(5, i, np.uint8),
                     "txt": f"caption {i}", "jpg": flat_png(), "cls": i})
    samples = list(ShardedDataset(tmp_path / "h5"))
    assert [s["emb.npy"].tolist() for s in samples] == [list(range(i, i + 8)) for i in range(3)]
    assert all(isinstance(s["tokens"], np.ndarray) and s["tokens"].tolist() == [i] * 5 for i, s in enumerate(samples))
    assert samples[2]["txt"] == "caption 2" and samples[2]["jpg"].shape == (3, 3, 4) and samples[2]["cls"] == 2


def test_an_hdf5_npy_row_holding_a_zip_or_junk_is_a_shard_error_without_pickle_advice(tmp_path):
    # The rows of an HDF5 array field of varying shape are .npy bytes read with np.load, which takes zip bytes
    # for an .npz (a damaged row came back as a NpzFile, silently) and other bytes for a pickle ("load it
    # unsafely using allow_pickle=").
    import io

    import h5py
    import numpy as np

    import fastdata
    from fastdata.errors import ShardError
    from fastdata.shards.hdf5 import HDF5ShardReader

    with fastdata.ShardWriter(tmp_path / "h", format="hdf5") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "v.npy": np.zeros(i + 1, np.uint8)})
    npz = io.BytesIO()
    np.savez(npz, a=np.arange(2))
    path = tmp_path / "h" / "shard-000000.h5"
    with h5py.File(path, "r+") as f:
        f["v.npy"][1] = np.frombuffer(npz.getvalue(), np.uint8)
        f["v.npy"][2] = np.frombuffer(b"junk" * 4, np.uint8)
    reader = HDF5ShardReader(path)
    for i in (1, 2):
        with pytest.raises(ShardError, match=rf"reading field 'v\.npy' of sample {i}") as err:
            reader.read(i)
        assert "pickle" not in str(err.value)
    assert reader.read(0)["v.npy"].tolist() == [0]
