"""Session-5 bug hunt of the shard formats and the converter: each test failed before its fix."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from fastdata.errors import FastdataError, ShardError, SourceError
from fastdata.manifest import Manifest
from fastdata.shards.convert import ConversionError, ConvertOptions, convert
from fastdata.shards.hdf5 import HDF5ShardReader
from fastdata.shards.reader import open_shard, verify


def png(i: int) -> bytes:
    arr = (np.arange(8 * 6 * 3).reshape(6, 8, 3) * (i + 1)) % 256
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_folder(root, n=6):
    for i in range(n):
        path = root / ("a" if i % 2 == 0 else "b") / f"{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png(i))
    return root


def opts(**kw):
    return ConvertOptions(workers=1, progress=False, **kw)


def interrupted_convert(monkeypatch, src, dest, options, after):
    """``convert`` stopped by a KeyboardInterrupt once ``after`` shard jobs have been written."""
    import fastdata.shards.convert as convert_mod

    real, done = convert_mod._write_job, []

    def crash_after(task, tick):
        if len(done) == after:
            raise KeyboardInterrupt
        done.append(task.job.name)
        return real(task, tick)

    monkeypatch.setattr(convert_mod, "_write_job", crash_after)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dest, options)
    monkeypatch.setattr(convert_mod, "_write_job", real)


# --------------------------------------------------------------- an unfinished conversion as SRC

def test_unfinished_conversion_is_not_a_source(tmp_path):
    """A DEST whose conversion was interrupted (no manifest yet, progress records left) is not
    read as a complete folder of tar shards: converting it would silently lose the missing shards."""
    out = tmp_path / "out"
    convert(image_folder(tmp_path / "src"), out, opts(samples_per_shard=2))
    (out / "manifest.json").unlink()
    (out / ".fastdata-progress").mkdir()  # what an interrupted run leaves (its records inside)
    (out / "shard-000002.tar").unlink()  # the shard it did not get to
    (out / "shard-000002.tar.idx").unlink()
    with pytest.raises(SourceError, match=r"out.*did not finish"):
        convert(out, tmp_path / "again", opts())
    assert not (tmp_path / "again" / "manifest.json").exists()


# --------------------------------------------------------------- DEST is SRC under another name

def test_overwrite_into_a_symlink_to_src_is_refused(tmp_path):
    """``--overwrite`` into a symlink to SRC removed SRC's shards before reading them."""
    src = tmp_path / "src"
    convert(image_folder(tmp_path / "imgs"), src, opts(samples_per_shard=2))
    before = sorted(os.listdir(src))
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    with pytest.raises(ConversionError, match="SRC"):
        convert(src, link, opts(overwrite=True))
    assert sorted(os.listdir(src)) == before


def test_overwrite_into_the_folder_of_a_src_file_is_refused(tmp_path):
    """SRC a shard file inside DEST: ``--overwrite`` would delete it (it is named like an output)."""
    src = tmp_path / "src"
    convert(image_folder(tmp_path / "imgs"), src, opts())
    with pytest.raises(ConversionError, match="SRC"):
        convert(src / "shard-000000.tar", src, opts(overwrite=True))
    assert (src / "shard-000000.tar").is_file()
    assert verify(src) == []


def test_dest_inside_image_src_through_a_symlink_is_refused(tmp_path):
    src = image_folder(tmp_path / "src")
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    with pytest.raises(ConversionError, match="inside SRC"):
        convert(src, tmp_path / "link" / "out", opts())


# ------------------------------------------------------------------- corrupt HDF5 shards

def _h5_shard(tmp_path):
    out = tmp_path / "h5"
    convert(image_folder(tmp_path / "src"), out, opts(format="hdf5"))
    return out, Manifest.load(out)


def _corrupt(path, start, n=8):
    data = bytearray(path.read_bytes())
    for k in range(start, min(start + n, len(data))):
        data[k] ^= 0xA5
    path.write_bytes(bytes(data))


_METADATA = range(0, 2560, 48)  # where a small shard keeps its superblock, object headers and heaps


def _h5py_failure(path):
    """What h5py raised reading ``path`` (through a ShardError wrapping it, if any; None: nothing)."""
    try:
        reader = HDF5ShardReader(path)
        for i in range(len(reader)):
            reader.read(i)
        reader.close()
    except ShardError as e:
        return e.__cause__
    except Exception as e:  # noqa: BLE001 - what the test is about
        return e
    return None


def test_corrupt_hdf5_shard_is_a_shard_error_naming_it(tmp_path):
    """Before: KeyError/RuntimeError/OSError/UnicodeDecodeError straight from h5py, without the shard,
    which also escaped ``on_error="skip"`` (it catches FastdataError and OSError)."""
    out, manifest = _h5_shard(tmp_path)
    shard = manifest.shards[0]
    orig = (out / shard.name).read_bytes()
    for off in _METADATA:  # until h5py raised something other than an OSError (a few offsets in)
        _corrupt(out / shard.name, off)
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


def test_verify_lists_a_corrupt_hdf5_shard_and_goes_on(tmp_path):
    """Before: ``verify`` stopped at a KeyError from h5py, naming no shard and listing nothing else."""
    out, manifest = _h5_shard(tmp_path)
    shard = manifest.shards[0]
    orig = (out / shard.name).read_bytes()
    for off in _METADATA:
        _corrupt(out / shard.name, off)
        if not isinstance(_h5py_failure(out / shard.name), (OSError, type(None))):
            break
        (out / shard.name).write_bytes(orig)
    else:
        pytest.skip("no corruption tried here makes this h5py raise anything but OSError")
    problems = verify(out)
    assert problems and all(p.startswith(shard.name + ": ") for p in problems)


# ------------------------------------------------------------------- --shard-size estimates

def test_shard_size_counts_the_pax_headers_of_non_ascii_names(tmp_path):
    """Non-ASCII names get a PAX header (1 KiB more per member): the estimate left it out, so
    ``--shard-size 32KiB`` gave 60 KiB shards for a folder with umlauts in its file names."""
    src = tmp_path / "src"
    for i in range(40):
        path = src / "klasse_ä" / f"bild_{i:03d}_ü.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png(i))
    limit = 32 << 10
    manifest = convert(src, tmp_path / "out", opts(shard_size=limit)).manifest
    assert manifest.num_samples == 40 and len(manifest.shards) > 1
    # each shard's content (before the end-of-archive record padding) fits the target
    assert all(s.bytes - 10240 <= limit for s in manifest.shards), [s.bytes for s in manifest.shards]


@pytest.mark.parametrize("name", ["a.jpg", "ünï/a.jpg", "a" * 100, "a" * 101, "a" * 495, "ü" * 300,
                                  "a\udcff.jpg", "x/" * 300 + "é.png"], ids=lambda n: f"{len(n)}chars")
def test_member_bytes_is_what_the_writer_writes(name):
    from fastdata.shards import _tarfmt
    from fastdata.shards._tarfmt import member_bytes

    for size in (0, 1, 512, 513):
        assert member_bytes(name, size) == len(_tarfmt.member_header(name, size)) + size + _tarfmt.pad(size)


# ------------------------------------------------------------------------------ manifest

@pytest.mark.parametrize("alias", ["./shard-000000.tar", ".//shard-000000.tar", "shard-000000.tar/"])
def test_manifest_listing_one_shard_under_two_names_is_refused(tmp_path, alias):
    """'shard-000000.tar' and './shard-000000.tar' are one file: every sample of it was served twice
    and ``verify`` said ok."""
    import json

    from fastdata.errors import ManifestError

    out = tmp_path / "out"
    convert(image_folder(tmp_path / "src"), out, opts(samples_per_shard=2))
    data = json.loads((out / "manifest.json").read_text())
    twin = dict(data["shards"][0], name=alias)
    data["shards"].append(twin)
    data["num_samples"] += twin["num_samples"]
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"lists shard .* more than once \(as 'shard-000000.tar' and "):
        Manifest.load(out)
    assert verify(out) != []


# ---------------------------------------------------------------------------- ShardWriter

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


# ---------------------------------------------------------------------- tar sidecar indexes

def _tarfile_shard(path, samples):
    """``samples`` written by Python's tarfile (another tool: no sidecar index)."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for sample in samples:
            for fld in sorted(k for k in sample if k != "__key__"):
                data = str(sample[fld]).encode()
                info = tarfile.TarInfo(f"{sample['__key__']}.{fld}")
                info.size, info.mtime, info.mode = len(data), 0, 0o444
                tar.addfile(info, io.BytesIO(data))


def test_stale_sidecar_beside_a_rewritten_tar_is_refused(tmp_path):
    """Read without a manifest, a sidecar left beside a same-size tar rewritten by another tool
    paired every key with another sample's data, silently."""
    import fastdata
    from fastdata.shards.tar import TarShardReader, write_tar_shard

    samples = [{"__key__": f"k{i}", "txt": f"value-{i}", "cls": i} for i in range(4)]
    shard = tmp_path / "x.tar"
    write_tar_shard(shard, samples)
    size = shard.stat().st_size
    _tarfile_shard(shard, samples[::-1])  # same members, other order; x.tar.idx stays
    assert shard.stat().st_size == size
    with pytest.raises(ShardError, match=r"x\.tar: the tar header .*delete it"):
        len(TarShardReader(shard))
    with pytest.raises(ShardError, match=r"x\.tar"):
        fastdata.ShardedDataset([str(shard)])
    (tmp_path / "x.tar.idx").unlink()  # as the message says: a header scan reads it right
    got = {s["__key__"]: s["txt"] for s in fastdata.ShardedDataset([str(shard)])}
    assert got == {f"k{i}": f"value-{i}" for i in range(4)}


def test_sidecar_of_a_tar_with_links_is_accepted(tmp_path):
    """A scanned index of a foreign tar whose sample starts with a hardlink points at the link
    target's data (after the target's header): the header check defers to a full scan."""
    import tarfile

    from fastdata.shards.tar import TarIndex, TarShardReader

    shard = tmp_path / "links.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("a.cls", b"1"), ("a.txt", b"AAAA")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name in ("b.cls", "c.cls", "d.cls"):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.LNKTYPE, "a.cls"
            tar.addfile(link)
    index = TarIndex.build(shard)
    index.save(str(shard) + ".idx")
    reader = TarShardReader(shard)
    assert reader.keys == ("a", "b", "c", "d")
    assert [bytes(reader.read(i)["cls"]) for i in range(4)] == [b"1"] * 4


# ------------------------------------------------------------- a fastdata folder as SRC

@pytest.mark.parametrize("fmt, files", [("tar", (".tar", ".tar.idx")), ("hdf5", (".h5",))])
def test_converting_a_folder_with_swapped_shards_is_refused(tmp_path, fmt, files):
    """A dataset refuses a folder whose shards were swapped; converting it went through silently
    and wrote their samples under a new manifest with fresh checksums."""
    src = tmp_path / "src"
    convert(image_folder(tmp_path / "imgs"), src, opts(format=fmt, samples_per_shard=2))
    for suffix in files:
        one, two = src / f"shard-000001{suffix}", src / f"shard-000002{suffix}"
        one.rename(tmp_path / "tmp")
        two.rename(one)
        (tmp_path / "tmp").rename(two)
    with pytest.raises(ShardError, match=r"shard-000001\.(tar|h5): .*replaced or changed"):
        convert(src, tmp_path / "out", opts())
    assert not (tmp_path / "out" / "manifest.json").exists()


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


# ------------------------------------------------------- file names that are not UTF-8

def _latin1_folder(tmp_path):
    src = image_folder(tmp_path / "src", n=2)
    try:
        (src / "a" / os.fsdecode(b"caf\xe9.png")).write_bytes(png(7))  # a Latin-1 file name
        (src / "a" / os.fsdecode(b"notes-\xe9.txt")).write_text("not an image")
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses file names that are not UTF-8")
    return src


def test_file_names_that_are_not_utf8_convert_to_tar(tmp_path):
    """Before: every shard written, then manifest.json failed with "'utf-8' codec can't encode
    character '\\udce9'", naming nothing; each rerun failed the same way."""
    import fastdata

    src = _latin1_folder(tmp_path)
    result = convert(src, tmp_path / "out", opts())
    assert result.manifest.num_samples == 3
    assert [s["source"] for s in Manifest.load(tmp_path / "out").skipped] == [os.fsdecode(b"a/notes-\xe9.txt")]
    assert verify(tmp_path / "out") == []
    keys = {s["__key__"] for s in fastdata.ShardedDataset(str(tmp_path / "out"))}
    assert os.fsdecode(b"a/caf\xe9") in keys
    assert convert(src, tmp_path / "out", opts()).complete  # the rerun recognises it


def test_file_names_that_are_not_utf8_are_refused_for_hdf5_naming_the_file(tmp_path):
    from fastdata.shards.hdf5 import write_hdf5_shard

    src = _latin1_folder(tmp_path)
    with pytest.raises(ConversionError, match=r"caf.*\.png: key .* is not valid UTF-8"):
        convert(src, tmp_path / "out", opts(format="hdf5"))
    key = os.fsdecode(b"caf\xe9")
    with pytest.raises(ValueError, match=r"key 'caf\\udce9' in shard .*x\.h5 is not valid UTF-8"):
        write_hdf5_shard(tmp_path / "x.h5", [{"__key__": key, "cls": 1}])
    assert not (tmp_path / "x.h5").exists() and not (tmp_path / "x.h5.tmp").exists()


# ------------------------------------------------------------------- a folder of tar shards

def test_tar_folder_lists_what_it_does_not_read(tmp_path):
    """Subfolders (more shards?) and other files of a tar folder SRC were passed over silently."""
    wds = tmp_path / "wds"
    convert(image_folder(tmp_path / "imgs"), wds, opts(samples_per_shard=3))
    (wds / "manifest.json").unlink()  # a plain folder of tar shards (+ sidecars)
    (wds / "more").mkdir()
    (wds / "shard-000001.tar").rename(wds / "more" / "shard-000001.tar")
    (wds / "README.txt").write_text("about")
    manifest = convert(wds, tmp_path / "out", opts()).manifest
    assert manifest.num_samples == 3
    assert sorted(s["source"] for s in manifest.skipped) == ["README.txt", "more/", "shard-000001.tar.idx"]
    with pytest.raises(ConversionError, match=r"README\.txt.*--strict"):
        convert(wds, tmp_path / "strict", opts(strict=True))


def test_tar_folder_with_compressed_shards_beside_plain_ones_is_refused(tmp_path):
    """Only the plain .tar files were converted; the .tar.gz ones were left out silently."""
    import gzip

    wds = tmp_path / "wds"
    convert(image_folder(tmp_path / "imgs"), wds, opts(samples_per_shard=3))
    (wds / "manifest.json").unlink()
    (wds / "shard-000001.tar.gz").write_bytes(gzip.compress((wds / "shard-000001.tar").read_bytes()))
    (wds / "shard-000001.tar").unlink()
    with pytest.raises(SourceError, match=r"shard-000001\.tar\.gz.*decompress"):
        convert(wds, tmp_path / "out", opts())


# ------------------------------------------------------------------------------ resuming

def test_resume_redoes_a_kept_shard_whose_index_is_garbled(tmp_path, monkeypatch):
    """A kept shard's sidecar only had to exist: a garbled one (a crash before the unsynced index
    reached the disk) was kept, and the finished folder failed ``verify`` and every read."""
    src = image_folder(tmp_path / "src")
    interrupted_convert(monkeypatch, src, tmp_path / "out", opts(samples_per_shard=2), after=2)
    index = tmp_path / "out" / "shard-000000.tar.idx"
    index.write_bytes(index.read_bytes()[:-5])
    result = convert(src, tmp_path / "out", opts(samples_per_shard=2))
    assert (result.written, result.kept) == (2, 1)
    assert verify(tmp_path / "out") == []


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


def test_overwrite_of_a_url_dest_removes_its_old_manifest_first(tmp_path, monkeypatch):
    """Before: an interrupted ``--overwrite`` into a URL left the old manifest above shards partly
    replaced by the new run, and the rerun without --overwrite refused to resume ("holds a
    finished conversion with different arguments")."""
    pytest.importorskip("fsspec")
    from fastdata.io import remote_size

    url = f"memory://fastdata-s5/{tmp_path.name}/ds"
    src = image_folder(tmp_path / "src")
    convert(src, url, opts(samples_per_shard=3, staging=str(tmp_path / "stage")))
    interrupted_convert(monkeypatch, src, url, opts(samples_per_shard=2, overwrite=True, staging=str(tmp_path / "stage")),
                        after=1)
    assert remote_size(url + "/manifest.json") is None  # no reader takes the mix for a dataset
    result = convert(src, url, opts(samples_per_shard=2, staging=str(tmp_path / "stage")))
    assert (result.kept, result.written) == (1, 2)
    assert verify(url) == []


def test_overwrite_removes_the_old_manifest_before_the_shards(tmp_path, monkeypatch):
    """Removed in directory order, an overwrite interrupted half way could leave the old manifest
    above some of its shards."""
    import fastdata.shards._progress as progress

    out = tmp_path / "out"
    convert(image_folder(tmp_path / "src"), out, opts(samples_per_shard=1))
    real, removed = os.unlink, []

    def unlink_one_then_fail(path, *a, **kw):
        if removed:
            raise KeyboardInterrupt
        removed.append(os.path.basename(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(progress.os, "unlink", unlink_one_then_fail)
    with pytest.raises(KeyboardInterrupt):
        progress.remove_outputs(out)
    monkeypatch.setattr(progress.os, "unlink", real)
    assert not (out / "manifest.json").exists()


def test_hdf5_shard_with_a_key_twice_is_refused(tmp_path):
    """The documented layout can be written with plain h5py; a repeated key was served twice."""
    import h5py

    out, manifest = _h5_shard(tmp_path)
    with h5py.File(out / manifest.shards[0].name, "r+") as f:
        keys = f["__key__"].asstr()[:].tolist()
        f["__key__"][3] = keys[1]
    with pytest.raises(ShardError, match=rf"shard-000000\.h5: .*key '{keys[1]}' twice \(rows 1 and 3\)"):
        len(HDF5ShardReader(out / manifest.shards[0].name))


# ------------------------------------------------------------------ class folders

def test_class_folder_without_images_is_listed_and_part_of_the_plan(tmp_path, monkeypatch):
    """An empty class folder (a macOS '__MACOSX' of hidden files, say) shifts every label after it.
    It was neither listed nor part of the plan: a resume kept shards labelled the old way beside
    new ones labelled the new way, and a finished conversion was reported complete."""
    from fastdata.shards.tar import TarShardReader

    src = image_folder(tmp_path / "src")
    interrupted_convert(monkeypatch, src, tmp_path / "out", opts(samples_per_shard=2), after=1)
    (src / "0-new").mkdir()  # sorts first: every class index moves up by one
    (src / "0-new" / ".hidden.png").write_bytes(png(9))
    with pytest.raises(ConversionError, match="different arguments or inputs"):
        convert(src, tmp_path / "out", opts(samples_per_shard=2))
    manifest = convert(src, tmp_path / "out", opts(samples_per_shard=2, overwrite=True)).manifest
    assert manifest.extra["source"]["classes"] == ["0-new", "a", "b"]
    assert {"source": "0-new/", "reason": "class folder without image files (its class index 0 is kept: "
            "classes are the sorted subfolders)"} in manifest.skipped
    labels = {int(bytes(s["cls"])) for shard in manifest.shards
              for s in TarShardReader(tmp_path / "out" / shard.name)}
    assert labels == {1, 2}
    (src / "0-new").rename(src / "z-new")  # a finished conversion: the same, not "complete"
    with pytest.raises(ConversionError, match="different arguments or inputs"):
        convert(src, tmp_path / "out", opts(samples_per_shard=2))


def test_verify_checks_hdf5_shards_against_the_manifest_fields(tmp_path):
    """verify said ok to a folder whose manifest lists a field one HDF5 shard lacks; every read of
    that shard then failed (ShardWriter wrote such folders)."""
    from fastdata.manifest import FieldInfo
    from fastdata.shards.hdf5 import write_hdf5_shard

    one = write_hdf5_shard(tmp_path / "shard-000000.h5", [{"__key__": "a", "x.npy": np.zeros(3)}])
    two = write_hdf5_shard(tmp_path / "shard-000001.h5", [{"__key__": "b", "x.npy": np.zeros(3), "cls": 1}])
    Manifest(format="hdf5", shards=(one, two),
             fields=(FieldInfo("cls", "int"), FieldInfo("x.npy", "array", "float64", (3,)))).save(tmp_path)
    problems = verify(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("shard-000000.h5: ") and "'cls'" in problems[0]


def test_hdf5_zero_dimensional_arrays_read_back_as_arrays(tmp_path):
    """A 0-d array field came back as a NumPy scalar (np.float64), unlike from a tar shard."""
    from fastdata.shards.hdf5 import write_hdf5_shard

    write_hdf5_shard(tmp_path / "z.h5", [{"__key__": k, "x.npy": np.array(float(i))} for i, k in enumerate("ab")])
    reader = HDF5ShardReader(tmp_path / "z.h5")
    for value in (reader.read(1)["x.npy"], list(reader.iter_range())[1]["x.npy"]):
        assert isinstance(value, np.ndarray) and value.shape == () and value == 1.0


def test_arrays_hdf5_has_no_number_type_for_are_stored_as_npy_rows(tmp_path):
    """Before: "TypeError: data type 'str64' not understood" from inside h5py/NumPy, naming nothing; then
    (s5) a TypeError naming the field. Session 8: the manifest spells the dtype so that np.dtype() parses it
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


def test_dest_holding_a_src_file_of_another_name_is_allowed_with_overwrite(tmp_path):
    """Only SRC files the conversion would replace or remove make DEST unusable."""
    from fastdata.shards.tar import write_tar_shard

    write_tar_shard(tmp_path / "data.tar", [{"__key__": f"k{i}", "txt": f"v{i}"} for i in range(3)])
    result = convert(tmp_path / "data.tar", tmp_path, opts(overwrite=True))
    assert result.manifest.num_samples == 3 and (tmp_path / "data.tar").is_file()


def test_pax_sparse_member_is_refused_not_read_as_its_sparse_map(tmp_path):
    """GNU tar --format=posix -S stores a sparse file as a regular member named
    './GNUSparseFile.N/<name>' holding a sparse map: it was read as sample './GNUSparseFile.N/a'
    with that map as its data."""
    import tarfile

    from fastdata.shards.tar import TarIndex, iter_tar_stream

    shard = tmp_path / "sparse.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        data = b"1\n0\n512\n" + bytes(503) + b"hello"
        info = tarfile.TarInfo("./GNUSparseFile.7/a.bin")
        info.size = len(data)
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "a.bin",
                            "GNU.sparse.realsize": "2097152"}
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardError, match=r"sparse\.tar: GNU sparse member 'a\.bin' at byte offset \d+ is not"):
        TarIndex.build(shard)
    with pytest.raises(ShardError, match="sparse member 'a.bin'"):
        list(iter_tar_stream(io.BytesIO(shard.read_bytes()), "sparse.tar"))


def _die_on_shard_one(task, tick):
    import fastdata.shards.convert as convert_mod

    if task.job.number == 1:
        os._exit(9)  # as the OOM killer would
    return convert_mod._s5_real_write_job(task, tick)


def test_a_worker_that_dies_is_a_conversion_error_naming_its_shard(tmp_path, monkeypatch):
    """Before: "BrokenProcessPool: A process in the process pool was terminated abruptly while the
    future was running or pending", naming no shard and no DEST."""
    import fastdata.shards.convert as convert_mod

    if convert_mod._mp_context().get_start_method() != "fork":
        pytest.skip("the patched job reaches the workers only when they are forked")
    monkeypatch.setattr(convert_mod, "_s5_real_write_job", convert_mod._write_job, raising=False)
    monkeypatch.setattr(convert_mod, "_write_job", _die_on_shard_one)
    with pytest.raises(ConversionError, match=r"worker process died .*shard-000001\.tar.* into DEST .*out.*rerun"):
        convert(image_folder(tmp_path / "src"), tmp_path / "out",
                ConvertOptions(samples_per_shard=2, workers=2, progress=False))


# --------------------------------------------------------------------------------- verify

_SLOW_VERIFY = """
import os, sys, time
import fastdata.shards.reader as reader
from fastdata.cli._shard_cmd import tool_main

def slow(folder, manifest, shard, **kw):
    open(sys.argv[2], "a").close()
    time.sleep(60)  # hashing a very large shard
    return []

reader.verify_shard = slow
sys.exit(tool_main(["--verify", sys.argv[1], "--workers", "2", "--quiet"]))
"""


def test_ctrl_c_stops_verify_at_once(tmp_path):
    """Ctrl-C printed "interrupted", then the process waited for every shard being hashed (non-daemon
    threads joined at exit: minutes for large shards); it also said "rerun ... to resume"."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    convert(image_folder(tmp_path / "src"), out, opts(samples_per_shard=2))
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_VERIFY, str(out), str(started)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert started.exists(), proc.stderr.read() if proc.poll() is not None else "never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # the fix exits at once; the hang lasted the full 60 s
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "shard.py: error: interrupted" in err and "resume" not in err


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


def test_hdf5_source_with_a_json_value_that_is_not_json_skips_that_sample_naming_it(tmp_path):
    """Before: the conversion failed with "'utf-8' codec can't decode byte 0xff in position 0",
    naming no file, sample or field."""
    import h5py

    from fastdata.shards.hdf5 import write_hdf5_shard

    src = tmp_path / "src"
    src.mkdir()
    write_hdf5_shard(src / "a.h5", [{"__key__": f"k{i}", "meta.json": {"i": i}} for i in range(3)])
    with h5py.File(src / "a.h5", "r+") as f:
        f["meta.json"][1] = np.frombuffer(b"\xff{not json", np.uint8)
    manifest = convert(src, tmp_path / "out", opts()).manifest
    assert manifest.num_samples == 2
    assert [s["source"] for s in manifest.skipped] == ["a.h5[1]"]
    assert "field 'meta.json' of sample 'k1' is not valid json" in manifest.skipped[0]["reason"]
    with pytest.raises(ConversionError, match=r"a\.h5\[1\]: field 'meta.json' of sample 'k1'.*--strict"):
        convert(src, tmp_path / "strict", opts(strict=True))
