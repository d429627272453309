"""``fastdata inspect``: a shard folder summarised; unfinished, running and remote conversions named."""
from __future__ import annotations

import fcntl
import os

import fastdata
from fastdata.cli._main import main
from fastdata.shards.convert import PROGRESS_DIR, convert
from tests.helpers.sources import opts, synth_folder


def test_inspect_names_an_unfinished_conversion(tmp_path, capsys):
    dest = tmp_path / "out"
    convert(synth_folder(tmp_path / "src", 4), dest, opts(samples_per_shard=2))
    (dest / "manifest.json").unlink()
    (dest / PROGRESS_DIR).mkdir()
    for given in (dest, dest / "manifest.json"):
        assert main(["inspect", str(given)]) == 1
        assert capsys.readouterr().err.strip() == (
            f"fastdata inspect: error: {given}: no manifest.json: the conversion into it did not finish "
            "(rerun it to resume)")
    (dest / PROGRESS_DIR).rmdir()  # an ordinary folder without a manifest: as before
    assert main(["inspect", str(dest)]) == 1
    assert "no manifest found" in capsys.readouterr().err


def test_inspect_reads_a_folder_url_as_verify_does(tmp_path, capsys):
    """`fastdata verify URL` and `fastdata shard SRC URL` work; `fastdata inspect URL` said "a URL;
    Manifest.load reads a local folder" (an API the user did not call)."""
    from tests.helpers.loopback_server import LoopbackServer

    convert(synth_folder(tmp_path / "src", 4), tmp_path / "www" / "ds", opts(samples_per_shard=2))
    with LoopbackServer(tmp_path / "www", max_requests=20, lifetime=30) as srv:
        assert main(["inspect", f"{srv.url}/ds", "--shards"]) == 0
        out = capsys.readouterr().out
        assert "samples     4" in out and "shard-000001.tar" in out
        assert main(["inspect", f"{srv.url}/nothing"]) == 1
        assert "nothing/manifest.json" in capsys.readouterr().err


def test_verify_and_inspect_tell_a_running_conversion_from_an_interrupted_one(tmp_path, capsys):
    """While a conversion runs, verify and inspect said it "did not finish (rerun it to resume)"; a
    rerun then only failed on the lock."""
    dest = tmp_path / "out"
    convert(synth_folder(tmp_path / "src", 4), dest, opts(samples_per_shard=2))
    (dest / "manifest.json").unlink()
    (dest / PROGRESS_DIR).mkdir()
    fd = os.open(dest, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the running conversion holds it
        running = f"no manifest.json yet: a conversion into it is running (pid {os.getpid()}); try again once it finishes"
        assert main(["verify", str(dest)]) == 1
        assert capsys.readouterr().err.strip() == f"fastdata verify: error: {dest}: {running}"
        assert main(["inspect", str(dest)]) == 1
        assert capsys.readouterr().err.strip() == f"fastdata inspect: error: {dest}: {running}"
    finally:
        os.close(fd)
    assert main(["verify", str(dest)]) == 1
    assert "did not finish (rerun it to resume)" in capsys.readouterr().err


def test_inspect_summarises_a_shard_folder(tmp_path, capsys):
    with fastdata.ShardWriter(tmp_path / "s", max_samples=3) as w:
        for i in range(7):
            w.write({"__key__": f"k{i:03d}", "txt": f"sample {i}", "cls": i % 2})
    assert main(["inspect", str(tmp_path / "s"), "--shards"]) == 0
    out = capsys.readouterr().out
    assert "samples     7" in out and "shards      3" in out
    assert "shard-000002.tar" in out


def test_inspect_bad_folder_is_one_line_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fastdata inspect: error:") and "missing" in err
