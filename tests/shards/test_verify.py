"""verify: every shard re-read against the manifest, every problem listed, over local folders and URLs."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastdata.cli import main
from fastdata.dataset import ShardedDataset
from fastdata.errors import ShardError
from fastdata.manifest import Manifest
from fastdata.shards.convert import convert
from fastdata.shards.hdf5 import HDF5ShardReader
from fastdata.shards.reader import verify
from tests.helpers.sources import H5_METADATA, flip_bytes, h5_folder, image_folder, opts


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


def test_verify_lists_a_corrupt_hdf5_shard_and_goes_on(tmp_path):
    """Before: ``verify`` stopped at a KeyError from h5py, naming no shard and listing nothing else."""
    out, manifest = h5_folder(tmp_path)
    shard = manifest.shards[0]
    orig = (out / shard.name).read_bytes()
    for off in H5_METADATA:
        flip_bytes(out / shard.name, off)
        if not isinstance(_h5py_failure(out / shard.name), (OSError, type(None))):
            break
        (out / shard.name).write_bytes(orig)
    else:
        pytest.skip("no corruption tried here makes this h5py raise anything but OSError")
    problems = verify(out)
    assert problems and all(p.startswith(shard.name + ": ") for p in problems)


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


@pytest.mark.parametrize("command", ["verify", "shard"])
def test_a_file_given_as_dest_is_not_called_missing(tmp_path, capsys, command):
    f = tmp_path / "afile"
    f.write_text("x")
    if command == "verify":
        rc = main(["verify", str(f)])
        err = capsys.readouterr().err
        assert rc != 0 and "not a folder" in err and "no such folder" not in err and str(f) in err
    else:
        from fastdata.errors import ConversionError
        from fastdata.shards.convert import verify_dest

        with pytest.raises(ConversionError, match="not a folder"):
            verify_dest(f)


def test_verify_of_a_url_calls_a_404_a_missing_shard_and_a_compressed_tar_is_a_source_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify over HTTP recognised a missing shard by the text 'not found' in the error: a server's
    'HTTP 404 Not Found' (or any other reason text) was reported as a raw fetch failure. And a
    manifest-less '.tar.gz' shard was a bare ValueError, not a FastdataError."""
    import gzip

    from fastdata.errors import SourceError
    from fastdata.shards.reader import verify

    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "1")
    from tests.helpers.loopback_server import LoopbackServer, make_shard_set

    make_shard_set(tmp_path / "www" / "ds", 8, 4, payload=64, seed=1)
    gone = "/ds/shard-000001.tar"
    with LoopbackServer(tmp_path / "www", fault=lambda p, n: 404 if p == gone else None) as srv:
        problems = verify(f"{srv.url}/ds")
    assert len(problems) == 1 and "shard-000001.tar: shard file is missing" in problems[0], problems
    with gzip.open(tmp_path / "a.tar.gz", "wb") as g:
        g.write((tmp_path / "www" / "ds" / "shard-000000.tar").read_bytes())
    with pytest.raises(SourceError, match="a.tar.gz: only uncompressed .tar shards"):
        ShardedDataset([str(tmp_path / "a.tar.gz")])


def test_verify_reads_a_file_url_of_a_folder(tmp_path) -> None:
    """``fastdata verify file:///folder`` said "no such folder"."""
    from fastdata.cli._main import main
    from tests.helpers.shards import make_shards

    folder = make_shards(tmp_path / "ds", 5, 2, key="k/{i:05d}", txt=True)
    assert main(["verify", f"file://{folder}"]) == 0
