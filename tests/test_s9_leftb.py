"""Session 9, helper left-b: streaming skip reports, decode= keys, skips under a custom collate, len() after
a resume, and what a demanding user's bug hunt over the dataset, shards and decode found."""
from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.loopback_server import LoopbackServer, make_shard_set

from fastdata.dataset import ShardedDataset

pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def test_a_streamed_shard_cut_off_says_the_rest_of_it_is_lost(tmp_path, monkeypatch):
    # One skip record with the bare network error stood for every sample behind the cut: the reason did not
    # say that the rest of the shard was lost, nor that their number is unknown (no manifest).
    make_shard_set(tmp_path / "www" / "ds", 16, 4, payload=2000, seed=1)
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "1")
    fault = {"/ds/shard-000001.tar": "drop", "/ds/shard-000002.tar": 404}
    with LoopbackServer(tmp_path / "www", fault=lambda p, n: fault.get(p), max_requests=50, lifetime=60) as srv:
        urls = [f"{srv.url}/ds/shard-{s:06d}.tar" for s in range(4)]
        ds = ShardedDataset(urls, decode=False, on_error="skip")
        got = [s["__key__"] for s in ds]
    assert got[:4] == ["k00000", "k00001", "k00002", "k00003"] and got[-4:] == [f"k{i:05d}" for i in range(12, 16)]
    cut, missing = ds.skipped
    assert cut["shard"].endswith("shard-000001.tar") and missing["shard"].endswith("shard-000002.tar")
    read = len(got) - 8  # samples of shard 1 delivered before the cut
    assert f"the rest of the shard is lost after its first {read} samples" in cut["reason"]
    assert "count unknown" in cut["reason"] and "byte" in cut["reason"]  # the network error is kept
    assert "no sample of the shard could be read (count unknown" in missing["reason"] and "404" in missing["reason"]


def test_a_leading_dot_decode_key_is_refused_where_the_fields_are_unknown(tmp_path):
    # With a manifest (or tar indexes) a decode= key matching no field is refused (ed1b7b2, d501266); a streamed
    # tar URL has no field list, so decode={".png": f} matched nothing, silently: the mask came out RGB.
    make_shard_set(tmp_path / "www" / "ds", 4, 4, payload=10, seed=1)
    with LoopbackServer(tmp_path / "www", max_requests=10, lifetime=60) as srv:
        url = f"{srv.url}/ds/shard-000000.tar"
        with pytest.raises(ValueError, match=r"'\.bin'.*without the dot: 'bin'"):
            ShardedDataset(url, decode={".bin": len})
        ds = ShardedDataset(url, decode={"bin": len, "png": len})  # a key without the dot may match nothing
        assert [s["bin"] for s in ds] == [10] * 4


@pytest.mark.parametrize("path", ["workers", "threads"])
def test_len_after_a_resume_is_the_whole_epoch_on_the_loader_and_its_iterator(seven, path):
    # len(loader) stays the whole epoch's count after a resume, as torch's DataLoader and torchdata's
    # StatefulDataLoader report it (an LR schedule sized epochs * len(loader) stays right); the iterator of the
    # worker path had no len() at all (TypeError from torch's infinite sampler) where the threads' had one.
    from fastdata import DataLoader

    def loader() -> DataLoader:
        return DataLoader(ShardedDataset(seven, shuffle=True, seed=3), batch_size=2, num_workers=2,
                          decode_threads=1 if path == "threads" else 0)

    first = loader()
    whole = len(first)
    it = iter(first)
    done = [next(it) for _ in range(2)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    rest = iter(again)
    assert len(again) == len(rest) == whole == 4
    assert len(done) + len(list(rest)) == whole


def _images_of_two_sizes(dest) -> str:
    import io

    from PIL import Image

    from fastdata import ShardWriter

    with ShardWriter(dest) as w:
        for i in range(4):
            buf = io.BytesIO()
            Image.new("RGB", (8 + (i == 2), 8), (i, i, i)).save(buf, "PNG")
            w.write({"__key__": f"k{i}", "png": buf.getvalue(), "cls": i})
    return str(dest)


@pytest.mark.parametrize("path", ["in-process", "workers", "threads"])
def test_a_batch_of_images_of_other_sizes_names_the_field_and_samples(tmp_path, path):
    # Images of different sizes without preprocess= (the most common first mistake): the collate failed with
    # torch's bare "stack expects each tensor to be equal size, but got [3, 8, 8] at entry 0 and [3, 8, 9] at
    # entry 2": no field, no sample, no remedy.
    from fastdata import DataLoader

    ds = ShardedDataset(_images_of_two_sizes(tmp_path / "ds"))
    loader = DataLoader(ds, batch_size=4, num_workers=0 if path == "in-process" else 1,
                        decode_threads=1 if path == "threads" else 0)
    with pytest.raises(RuntimeError, match=r"field 'png'.*'k0': \(3, 8, 8\).*'k2': \(3, 8, 9\).*preprocess="):
        list(loader)


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_an_npz_field_that_is_no_zip_archive_says_so(allow_pickle):
    # np.load takes bytes that are neither a zip nor an .npy for a pickle: junk in an `npz` field was "pickled
    # (object) data ... load it unsafely using allow_pickle=" (advice to run a shard's bytes as code), and with
    # allow_pickle=True it was unpickled; an .npy in an `npz` field was a TypeError about context managers.
    import io
    import pickle

    import numpy as np

    from fastdata.decode import SampleDecoder
    from fastdata.errors import DecodeError

    npy = io.BytesIO()
    np.save(npy, np.arange(3))
    decoder = SampleDecoder(allow_pickle=allow_pickle)
    for data in (b"junk", npy.getvalue(), pickle.dumps({"a": 1})):
        with pytest.raises(DecodeError, match=r"'x\.npz'.*not an \.npz \(zip\) archive") as err:
            decoder.field("x.npz", data, shard="s.tar", key="k")
        assert "allow_pickle" not in str(err.value)
    z = io.BytesIO()
    np.savez(z, a=np.arange(3))
    assert decoder.field("x.npz", z.getvalue(), shard="s.tar", key="k")["a"].tolist() == [0, 1, 2]


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


def test_a_palette_mask_decoded_as_pil_keeps_its_class_ids_through_resize_center_crop(tmp_path):
    # The README's way to keep a label mask's ids through preprocess= (which resamples every image field).
    import io

    import numpy as np
    from PIL import Image

    import fastdata
    from fastdata.decode import ImageDecoder

    ids = np.zeros((16, 16), np.uint8)
    ids[:, 8:] = 5
    mask = Image.fromarray(ids, "L").convert("P")
    mask.putpalette([0, 0, 0] * 5 + [255, 0, 0] + [0, 0, 0] * 250)
    seg, photo = io.BytesIO(), io.BytesIO()
    mask.save(seg, "PNG")
    Image.new("RGB", (16, 16), (9, 9, 9)).save(photo, "PNG")
    with fastdata.ShardWriter(tmp_path / "ds") as w:
        w.write({"__key__": "k0", "png": photo.getvalue(), "seg.png": seg.getvalue()})
    resize = fastdata.ResizeCenterCrop(5)
    sample = next(iter(ShardedDataset(tmp_path / "ds", decode={"seg.png": ImageDecoder(None).pil}, preprocess=resize)))
    assert sample["seg.png"].shape == (1, 5, 5) and sorted(sample["seg.png"].unique().tolist()) == [0, 5]
    assert sample["png"].shape == (3, 5, 5)
    plain = next(iter(ShardedDataset(tmp_path / "ds", preprocess=resize)))
    assert plain["seg.png"].shape == (3, 5, 5)  # the default: RGB, resampled like a photo


def test_on_error_warn_warns_in_the_main_process_with_worker_processes(tmp_path):
    # A worker process emitted the SkippedSampleWarning itself: the training process never saw it (no
    # warnings filter, -W error or logging.captureWarnings of the job applies there); the record still came.
    import warnings

    import fastdata
    from fastdata.dataset import SkippedSampleWarning

    with fastdata.ShardWriter(tmp_path / "ds") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "bin": b"bad" if i == 1 else b"ok", "cls": i})

    def strict(b: bytes) -> bytes:
        if b == b"bad":
            raise ValueError("bad bytes")
        return b

    ds = ShardedDataset(tmp_path / "ds", on_error="warn", decode={"bin": strict})
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        keys = [k for b in fastdata.DataLoader(ds, batch_size=2, num_workers=1) for k in b["__key__"]]
    assert keys == ["k0", "k2", "k3"] and [r["key"] for r in ds.skipped] == ["k1"]
    shown = [str(w.message) for w in got if issubclass(w.category, SkippedSampleWarning)]
    assert len(shown) == 1 and "'k1'" in shown[0] and "bad bytes" in shown[0]


def test_a_corrupt_gzip_stream_is_a_shard_error_naming_the_shard(tmp_path):
    # zlib.error (a corrupt deflate stream inside a .tar.gz) is neither an OSError nor an EOFError: it escaped
    # as a bare "Error -3 while decompressing data: invalid stored block lengths", naming no shard, and ended a
    # streaming epoch even under on_error="skip".
    import gzip
    import io

    import numpy as np

    from fastdata.errors import ShardError
    from fastdata.shards.tar import iter_tar_stream

    raw = bytearray(gzip.compress(np.random.default_rng(0).bytes(3000)))  # any payload: the stream is bad
    raw[12:] = np.random.default_rng(1).bytes(len(raw) - 12)
    with pytest.raises(ShardError, match=r"https://h/x\.tar\.gz: cannot read tar header at byte offset 0"):
        list(iter_tar_stream(gzip.GzipFile(fileobj=io.BytesIO(bytes(raw)), mode="rb"), "https://h/x.tar.gz"))


def test_an_hdf5_shard_url_is_refused_naming_the_folder_url_to_pass():
    # A list of .h5 URLs was streamed as tar: "bad tar header checksum at byte offset 0 ...; the shard is
    # corrupt" (it is not: it is HDF5); one .h5 URL was taken for a folder (".../shard-000000.h5/manifest.json:
    # HTTP 404"). Refused before any request (the host does not exist).
    from fastdata.errors import SourceError

    url = "https://data.invalid/ds/shard-000000.h5?sig=SECRET"
    for source in (url, [url, url.replace("000000", "000001")]):
        with pytest.raises(SourceError, match=r"shard-000000\.h5.*HDF5.*'https://data\.invalid/ds/'") as err:
            ShardedDataset(source)
        assert "SECRET" not in str(err.value)


def test_a_local_hdf5_shard_path_names_its_folder(tmp_path):
    # "only uncompressed .tar shards can be read without a manifest (use a URL for streaming, ...)": an HDF5
    # shard cannot be streamed either; its folder (with manifest.json) is what to pass.
    import fastdata
    from fastdata.errors import SourceError

    with fastdata.ShardWriter(tmp_path / "h", format="hdf5") as w:
        w.write({"__key__": "k0", "cls": 0})
    with pytest.raises(SourceError, match=r"shard-000000\.h5: an HDF5 shard is read through its folder's "
                                          r"manifest\.json.*pass the folder"):
        ShardedDataset([str(tmp_path / "h" / "shard-000000.h5")])
    assert [s["cls"] for s in ShardedDataset(tmp_path / "h")] == [0]


def test_a_folder_inside_a_source_list_says_lists_hold_tar_files(tmp_path):
    # [folder] or [folder_a, folder_b] said "only uncompressed .tar shards can be read without a manifest":
    # the folder has one; a list names tar files, and folders are not combined.
    import fastdata
    from fastdata.errors import SourceError

    with fastdata.ShardWriter(tmp_path / "a") as w:
        w.write({"__key__": "k0", "cls": 0})
    with pytest.raises(SourceError, match=r"a\b.*is a folder: a list of sources names tar files.*pass the folder "
                                          r"itself"):
        ShardedDataset([str(tmp_path / "a"), str(tmp_path / "a")])


def test_fields_selects_the_fields_of_a_streamed_tar_as_of_a_folder(tmp_path):
    # fields=["cls"] over tar URLs still gave (and decoded) every field of each sample; a folder gives only cls.
    make_shard_set(tmp_path / "www" / "ds", 4, 2, payload=10, seed=1)
    with LoopbackServer(tmp_path / "www", max_requests=20, lifetime=60) as srv:
        urls = [f"{srv.url}/ds/shard-{s:06d}.tar" for s in range(2)]
        streamed = list(ShardedDataset(urls, fields=["cls"]))
    indexed = list(ShardedDataset(tmp_path / "www" / "ds", fields=["cls"]))
    assert [sorted(s) for s in streamed] == [sorted(s) for s in indexed] == [["__key__", "cls"]] * 4


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


def test_tar_urls_with_upper_case_suffixes_stream_and_a_gzip_named_tar_says_so(tmp_path):
    # "https://h/ds/B.TAR" was taken for a folder URL (its manifest.json: HTTP 404); "A.TAR.GZ" was read as a plain
    # tar; a gzip file named .tar said "truncated tar: header at byte offset 0 is cut off after 330 of 512 bytes".
    import gzip
    import io

    from fastdata.errors import ShardError
    from fastdata.shards.tar import iter_tar_stream

    assert ShardedDataset("https://data.invalid/ds/B.TAR").streaming  # no request made
    make_shard_set(tmp_path / "www" / "ds", 4, 4, payload=30, seed=1)
    raw = (tmp_path / "www" / "ds" / "shard-000000.tar").read_bytes()
    (tmp_path / "www" / "ds" / "A.TAR.GZ").write_bytes(gzip.compress(raw))
    with LoopbackServer(tmp_path / "www", max_requests=10, lifetime=60) as srv:
        assert [s["__key__"] for s in ShardedDataset([f"{srv.url}/ds/A.TAR.GZ"], decode=False)] == \
            [f"k{i:05d}" for i in range(4)]
    with pytest.raises(ShardError, match=r"https://h/c\.tar: is gzip-compressed"):
        list(iter_tar_stream(io.BytesIO(gzip.compress(raw)), "https://h/c.tar"))
    (tmp_path / "B.TAR").write_bytes(raw)  # a local one too ("only uncompressed .tar shards can be read ...")
    assert len(list(ShardedDataset([str(tmp_path / "B.TAR")], decode=False))) == 4


def test_relative_source_paths_survive_a_chdir(tmp_path, monkeypatch):
    # A dataset built from a relative folder or tar path read it relative to the current directory at each read:
    # a chdir after building it (Hydra's per-run directory, a script's os.chdir) failed every sample.
    import fastdata

    monkeypatch.chdir(tmp_path)
    with fastdata.ShardWriter("rel") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "cls": i})
    folder, tars = ShardedDataset("rel"), ShardedDataset(["rel/shard-000000.tar"])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert [s["cls"] for s in folder] == [s["cls"] for s in tars] == [0, 1, 2]


def test_shard_writer_to_a_relative_folder_survives_a_chdir(tmp_path, monkeypatch):
    # The shards after a chdir were written into another folder of the same relative name, and the manifest too.
    import fastdata

    monkeypatch.chdir(tmp_path)
    with fastdata.ShardWriter("out", max_samples=2) as w:
        for i in range(4):
            if i == 2:
                (tmp_path / "elsewhere").mkdir()
                monkeypatch.chdir(tmp_path / "elsewhere")
            w.write({"__key__": f"k{i}", "cls": i})
    assert [s["cls"] for s in ShardedDataset(tmp_path / "out")] == [0, 1, 2, 3]
    assert not (tmp_path / "elsewhere" / "out").exists()


def test_a_batch_of_tuples_with_images_of_other_sizes_names_the_position(tmp_path):
    # sample_transform=lambda s: (s["png"], s["cls"]), the usual tuple form: the bare torch message again.
    from fastdata import DataLoader

    ds = ShardedDataset(_images_of_two_sizes(tmp_path / "ds"), sample_transform=lambda s: (s["png"], s["cls"]))
    with pytest.raises(RuntimeError, match=r"element 0 of each sample in different shapes \(sample 0 of the batch: "
                                           r"\(3, 8, 8\); sample 2 of the batch: \(3, 8, 9\)\)"):
        list(DataLoader(ds, batch_size=4))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_members_a_streamed_tar_leaves_out_are_listed_in_skipped(tmp_path, num_workers):
    # The README: each tar member left out (a symlink out of the archive, a name that is no '<key>.<field>') is
    # listed in ShardedDataset.skipped for manifest-less tars. A streamed tar only warned, in the process that
    # read it (a DataLoader worker's warning never reaches the training process), and listed nothing.
    import io
    import tarfile
    import warnings

    import fastdata

    (tmp_path / "www").mkdir()
    with tarfile.open(tmp_path / "www" / "a.tar", "w") as t:
        for name, data in (("k0.cls", b"0"), ("k1.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("k1.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(link)
    with LoopbackServer(tmp_path / "www", max_requests=10, lifetime=60) as srv:
        ds = ShardedDataset([f"{srv.url}/a.tar"], max_skips=0)  # a member left out is no skipped sample
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keys = [k for b in fastdata.DataLoader(ds, batch_size=2, num_workers=num_workers) for k in b["__key__"]]
    assert keys == ["k0", "k1"]
    (record,) = ds.skipped
    assert (record["shard"], record["key"], record["member"], record["epoch"]) == (f"{srv.url}/a.tar", "k1", "k1.txt", 0)
    assert "points outside the archive" in record["reason"]
