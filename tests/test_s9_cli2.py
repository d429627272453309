"""Session 9, helper cli2: demo/bench image folders, broken pipes, `inspect` on an unfinished conversion,
concurrent conversions into one DEST, and naming what differs when a rerun is refused."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastdata.cli._main import main
from fastdata.cli._shard_cmd import tool_main
from fastdata.cli._synth import make_image_folder
from fastdata.errors import ConversionError, FastdataError
from fastdata.manifest import Manifest
from fastdata.shards.convert import PROGRESS_DIR, ConvertOptions, convert


def _images(root: Path, n: int = 6, **kw) -> Path:
    return make_image_folder(root, n, num_classes=2, min_side=16, max_side=20, **kw)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _opts(**kw) -> ConvertOptions:
    return ConvertOptions(progress=False, workers=1, **kw)


# ----- 1. demo/bench --dir: a folder from a larger earlier run -------------------------------------------

def test_image_folder_holds_exactly_the_images_asked_for(tmp_path):
    """`fastdata demo --dir D --images 64` then `--images 32` trained on 64 images (the table said 32):
    the generator kept every file of the earlier, larger run."""
    root = tmp_path / "images"
    _images(root, 8)
    kept = (root / "class_00" / "img_000000.jpg").stat().st_mtime_ns
    _images(root, 4)
    assert _files(root) == ["class_00/img_000000.jpg", "class_00/img_000002.jpg", "class_01/img_000001.jpg",
                            "class_01/img_000003.jpg"]
    assert (root / "class_00" / "img_000000.jpg").stat().st_mtime_ns == kept  # the same image: not redone
    first = (root / "class_00" / "img_000000.jpg").read_bytes()
    _images(root, 4, seed=5)  # other arguments: other images
    assert len(_files(root)) == 4 and (root / "class_00" / "img_000000.jpg").read_bytes() != first
    (root / ".DS_Store").write_bytes(b"x")  # hidden files are nobody's class or image
    (root / "class_00" / ".DS_Store").write_bytes(b"x")
    _images(root, 4)
    (root / "class_01" / "notes.txt").write_text("mine")
    with pytest.raises(FastdataError, match=r"holds class_01/notes.txt, which were not generated here"):
        _images(root, 4)
    assert (root / "class_01" / "notes.txt").read_text() == "mine"
    many = tmp_path / "many"  # 3-digit class folders and 7-digit image numbers are the generator's own too
    make_image_folder(many, 105, num_classes=101, min_side=8, max_side=9)
    make_image_folder(many, 102, num_classes=101, min_side=8, max_side=9)
    assert len(_files(many)) == 102


def test_demo_shards_describe_the_images_asked_for(tmp_path, capsys):
    from fastdata.cli._demo import ImageFolderRecipe, _make_shards

    _make_shards(tmp_path, 6, 1)
    shards, m = _make_shards(tmp_path, 3, 1)
    assert m.num_samples == 3 and Manifest.load(shards).num_samples == 3
    (tmp_path / "images" / "class_00" / ".DS_Store").write_bytes(b"x")
    assert len(ImageFolderRecipe(tmp_path / "images")) == 3  # the tuned-DataLoader row reads the same 3
    assert "[2/4] 3 samples" in capsys.readouterr().out


# ----- 2. a reader that goes away: `fastdata inspect DEST --shards | head -1` -----------------------------

def test_broken_pipe_ends_quietly(tmp_path, capsys, monkeypatch):
    dest = tmp_path / "out"
    convert(_images(tmp_path / "src", 6), dest, _opts(samples_per_shard=1))
    for command, argv in ((main, ["inspect", str(dest), "--shards"]), (main, ["verify", str(dest), "--workers", "1"]),
                          (tool_main, ["--verify", str(dest), "--workers", "1"])):
        r, w = os.pipe()
        os.close(r)  # the reader went away, as after `| head -1`
        with open(w, "w", buffering=1 << 16) as out:
            monkeypatch.setattr(sys, "stdout", out)  # here: pytest's capture swaps sys.stdout between phases
            assert command(argv) == 1
            monkeypatch.undo()  # (the closing flush goes to os.devnull, which now stands where the pipe was)
        assert capsys.readouterr().err == ""  # not "error: [Errno 32] Broken pipe"


def test_broken_pipe_elsewhere_stays_an_error(tmp_path, capsys, monkeypatch):
    """Only stdout's broken pipe is quiet: another one (a socket to a store) is still reported."""
    import fastdata.cli._main as cli_main

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    parser = cli_main.build_parser()
    monkeypatch.setattr(cli_main, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["inspect"].set_defaults(func=broken)
    assert main(["inspect", str(tmp_path)]) == 1
    assert "fastdata inspect: error: [Errno 32] Broken pipe" in capsys.readouterr().err


# ----- 3. inspect on an interrupted conversion --------------------------------------------------------------

def test_inspect_names_an_unfinished_conversion(tmp_path, capsys):
    dest = tmp_path / "out"
    convert(_images(tmp_path / "src", 4), dest, _opts(samples_per_shard=2))
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


# ----- 4. two conversions into one DEST at once ---------------------------------------------------------------

def test_a_second_conversion_into_a_busy_dest_fails_at_once(tmp_path):
    src, dest = _images(tmp_path / "src", 4), tmp_path / "out"
    dest.mkdir()
    fd = os.open(dest, os.O_RDONLY)  # the running conversion's lock (another open file: conflicts in-process too)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConversionError, match=rf"another conversion is writing DEST {dest} \(pid {os.getpid()}\)"):
            convert(src, dest, _opts(samples_per_shard=2))
        assert os.listdir(dest) == []  # nothing touched
    finally:
        os.close(fd)
    assert convert(src, dest, _opts(samples_per_shard=2)).manifest.num_samples == 4


def test_a_dead_holders_lock_is_gone(tmp_path):
    """A conversion killed (SIGKILL) while holding the lock: the rerun resumes."""
    src, dest = _images(tmp_path / "src", 4), tmp_path / "out"
    dest.mkdir()
    code = (f"import fcntl, os, time\nfd = os.open({str(dest)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConversionError, match=rf"\(pid {holder.pid}\)"):
            convert(src, dest, _opts(samples_per_shard=2))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert convert(src, dest, _opts(samples_per_shard=2)).manifest.num_samples == 4


def test_the_lock_is_released_by_an_interrupted_run(tmp_path, monkeypatch):
    import fastdata.shards.convert as convert_mod

    src, dest = _images(tmp_path / "src", 4), tmp_path / "out"
    real = convert_mod._write_job

    def interrupt(task, tick):
        if task.job.number == 1:
            raise KeyboardInterrupt
        return real(task, tick)

    monkeypatch.setattr(convert_mod, "_write_job", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dest, _opts(samples_per_shard=2))
    monkeypatch.setattr(convert_mod, "_write_job", real)
    result = convert(src, dest, _opts(samples_per_shard=2))
    assert result.kept == 1 and result.manifest.num_samples == 4 and not convert_mod._held_locks


# ----- 5. a refused rerun names what differs --------------------------------------------------------------------

def test_refused_rerun_names_the_argument_and_the_inputs(tmp_path):
    src, dest = _images(tmp_path / "src", 6), tmp_path / "out"
    convert(src, dest, _opts(samples_per_shard=2))
    with pytest.raises(ConversionError, match=r"different arguments or inputs: --samples-per-shard was 2, now 3; holds"):
        convert(src, dest, _opts(samples_per_shard=3))
    with pytest.raises(ConversionError, match=r"inputs: --format was tar, now hdf5, --check was header, now full;"):
        convert(src, dest, _opts(samples_per_shard=2, format="hdf5", check="full"))
    touched = src / "class_01" / "img_000003.jpg"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # `touch`, as `cp -r` does to every input
    with pytest.raises(ConversionError, match=r"inputs: input files modified or added since: class_01/img_000003.jpg;"):
        convert(src, dest, _opts(samples_per_shard=2))
    os.utime(touched, ns=(1, 1))
    with pytest.raises(ConversionError, match=r"inputs: input files' modification times changed;"):
        convert(src, dest, _opts(samples_per_shard=2))
    (src / "class_00" / "img_000000.jpg").unlink()
    with pytest.raises(ConversionError, match=r"inputs: SRC has 5 input files, was 6;"):
        convert(src, dest, _opts(samples_per_shard=2))


def test_refused_resume_names_what_differs(tmp_path, monkeypatch):
    import fastdata.shards.convert as convert_mod

    src, dest = _images(tmp_path / "src", 4), tmp_path / "out"
    monkeypatch.setattr(convert_mod, "_write_job", lambda task, tick: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        convert(src, dest, _opts(samples_per_shard=2, shuffle=True, seed=1))
    monkeypatch.undo()
    with pytest.raises(ConversionError, match=r"an interrupted conversion with different arguments or inputs: "
                                              r"--seed was 1, now 2; holds"):
        convert(src, dest, _opts(samples_per_shard=2, shuffle=True, seed=2))


# ----- hunt: demo/bench --dir pointed at a folder holding the user's own shards or cache -------------------

def test_demo_and_bench_dir_refuse_a_folder_they_did_not_make(tmp_path, capsys):
    """`fastdata demo --dir D` replaced D/shards (overwrite=True) and deleted D/cache (rmtree): a user's
    own dataset and cache, under those natural names, were lost."""
    mine = tmp_path / "data"
    (mine / "cache").mkdir(parents=True)
    (mine / "cache" / "entry.bin").write_bytes(b"precious")
    argv = ["--images", "8", "--epochs", "1", "--batch-size", "8", "--workers", "0"]
    assert main(["demo", "--dir", str(mine), *argv]) == 1
    assert f"--dir {mine}: holds cache, which fastdata demo did not write" in capsys.readouterr().err
    assert main(["bench", "--dir", str(mine), "--images", "8", "--workers", "0", "--repeats", "1"]) == 1
    assert "which fastdata bench did not write" in capsys.readouterr().err
    assert (mine / "cache" / "entry.bin").read_bytes() == b"precious"
    from fastdata.cli._demo import WORKDIR_MARK, claim_workdir

    new = claim_workdir(tmp_path / "new" / "w", "demo")  # a new folder is claimed, then reused
    (new / "shards").mkdir()
    assert claim_workdir(new, "bench") == new
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / ".DS_Store").write_bytes(b"x")
    assert claim_workdir(hidden, "demo") == hidden
    old = tmp_path / "old"  # a demo's --dir from before the mark: its shards were converted from its images
    convert(_images(old / "images", 2), old / "shards", _opts())
    (old / "cache").mkdir()
    assert claim_workdir(old, "demo") == old
    (old / "notes.txt").write_text("mine")
    (old / WORKDIR_MARK).unlink()
    with pytest.raises(FastdataError, match="which fastdata demo did not write"):
        claim_workdir(old, "demo")


def test_inspect_reads_a_folder_url_as_verify_does(tmp_path, capsys):
    """`fastdata verify URL` and `fastdata shard SRC URL` work; `fastdata inspect URL` said "a URL;
    Manifest.load reads a local folder" (an API the user did not call)."""
    from tests.helpers.loopback_server import LoopbackServer

    convert(_images(tmp_path / "src", 4), tmp_path / "www" / "ds", _opts(samples_per_shard=2))
    with LoopbackServer(tmp_path / "www", max_requests=20, lifetime=30) as srv:
        assert main(["inspect", f"{srv.url}/ds", "--shards"]) == 0
        out = capsys.readouterr().out
        assert "samples     4" in out and "shard-000001.tar" in out
        assert main(["inspect", f"{srv.url}/nothing"]) == 1
        assert "nothing/manifest.json" in capsys.readouterr().err


def test_a_dest_holding_only_hidden_files_is_empty(tmp_path):
    """A DEST holding only Finder's .DS_Store was "not empty" and needed --overwrite (hidden files in
    SRC are ignored)."""
    src, dest = _images(tmp_path / "src", 4), tmp_path / "out"
    dest.mkdir()
    (dest / ".DS_Store").write_bytes(b"x")
    assert convert(src, dest, _opts(samples_per_shard=2)).manifest.num_samples == 4
    assert (dest / ".DS_Store").read_bytes() == b"x"
    (dest / "notes.txt").write_text("mine")  # a visible file still makes it not empty
    with pytest.raises(ConversionError, match=r"not empty \(a finished conversion .*holds manifest.json, notes.txt"):
        convert(src, dest, _opts(samples_per_shard=3))


def test_verify_and_inspect_tell_a_running_conversion_from_an_interrupted_one(tmp_path, capsys):
    """While a conversion runs, verify and inspect said it "did not finish (rerun it to resume)"; a
    rerun then only failed on the lock."""
    dest = tmp_path / "out"
    convert(_images(tmp_path / "src", 4), dest, _opts(samples_per_shard=2))
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


def test_verify_keeps_a_urls_password_and_token_out_of_its_lines(tmp_path, capsys):
    """`fastdata verify http://me:secret@host/ds?sig=tok` printed the password and the signed URL's
    token on its ok and error lines (the messages inside them were redacted)."""
    from tests.helpers.loopback_server import LoopbackServer

    convert(_images(tmp_path / "src", 4), tmp_path / "www" / "ds", _opts(samples_per_shard=2))
    with LoopbackServer(tmp_path / "www", max_requests=20, lifetime=30) as srv:
        base = srv.url.replace("http://", "http://me:secret@")
        assert main(["verify", f"{base}/ds?sig=tok", "--workers", "1"]) == 0
        assert main(["verify", f"{base}/nothing?sig=tok"]) == 1
    out, err = capsys.readouterr()
    assert "me:***@" in out and "me:***@" in err and "sig=***" in out
    assert "secret" not in out + err and "tok" not in out + err


class _FakeRay:
    """Just enough of ``ray`` for ``fastdata.shards._ray.execute``: tasks run at ``.remote()``."""

    class exceptions:
        class RayTaskError(Exception):
            pass

    def __init__(self, initialized: bool):
        self.initialized, self.calls = initialized, []

    def is_initialized(self):
        return self.initialized

    def init(self, **kw):
        self.calls.append("init")
        self.initialized = True

    def shutdown(self):
        self.calls.append("shutdown")
        self.initialized = False

    def cluster_resources(self):
        return {"CPU": 1}

    def remote(self, **kw):
        class Remote:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                return ("ref", self.fn(*args))
        return Remote

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref[1]

    def cancel(self, ref, force=False):
        pass


@pytest.mark.parametrize("initialized", [False, True])
def test_ray_started_by_a_conversion_is_shut_down_by_it(monkeypatch, initialized):
    """A Ray instance `--engine ray` started was left to Ray's atexit hook: a Ctrl-C landing there
    printed a traceback after the summary line and left Ray's agents orphaned. One the caller
    initialised is left running."""
    from fastdata.shards import _ray

    fake = _FakeRay(initialized)
    monkeypatch.setattr(_ray, "_ray", lambda: fake)
    out = list(_ray.execute([1, 2, 3], lambda task, tick: task * 10, workers=2, tick=lambda n: None, size=lambda t: 1))
    assert sorted(out) == [10, 20, 30]
    assert fake.calls == ([] if initialized else ["init", "shutdown"])
    fake.initialized = initialized

    def fail(task, tick):
        raise ValueError("bad shard")

    with pytest.raises(ValueError, match="bad shard"):  # an error ends it too
        list(_ray.execute([1], fail, workers=1, tick=lambda n: None, size=lambda t: 1))
    assert fake.initialized == initialized


def test_rerun_of_a_conversion_that_read_nothing_fails_again(tmp_path, capsys):
    """`fastdata shard SRC DEST` where no input is readable fails (status 1); the same command again
    said "DEST: complete, 0 samples ... nothing to do" with status 0 (a retry loop went on with an empty set)."""
    src, dest = tmp_path / "src", tmp_path / "out"
    (src / "c0").mkdir(parents=True)
    (src / "c0" / "a.jpg").write_bytes(b"not an image")
    for _ in range(2):
        assert main(["shard", str(src), str(dest), "--quiet"]) == 1
        assert "none of its 1 inputs could be read" in capsys.readouterr().err


def test_bench_out_file_is_written_before_stdout(tmp_path, capsys, monkeypatch):
    """`fastdata bench --json --out r.json | head -c 100`: the results were printed first, and the broken
    pipe ended the command before --out was written, after all the measuring."""
    import fastdata.cli._bench as bench

    dest = tmp_path / "out"
    convert(_images(tmp_path / "src", 4), dest, _opts(samples_per_shard=2))
    monkeypatch.setattr(bench, "measure", lambda *a, **kw: {"samples": 4, "measured": True})
    r, w = os.pipe()
    os.close(r)
    with open(w, "w", buffering=1) as out:  # line-buffered, as on a terminal: the print itself fails
        monkeypatch.setattr(sys, "stdout", out)
        assert main(["bench", str(dest), "--json", "--out", str(tmp_path / "r.json")]) == 1
        monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    assert '"measured": true' in (tmp_path / "r.json").read_text()


def test_bench_on_generated_data_names_no_deleted_folder(tmp_path, capsys, monkeypatch):
    """`fastdata bench` (no SHARDS, no --dir) reported "(64 samples of /tmp/fastdata-bench-x/shards, ...)",
    a temporary folder deleted before the line was printed."""
    import fastdata.cli._bench as bench
    import fastdata.cli._demo as demo

    def fake_shards(root, *a, **kw):
        convert(_images(root / "images", 4), root / "shards", _opts())
        return root / "shards", None

    monkeypatch.setattr(demo, "_make_shards", fake_shards)
    monkeypatch.setattr(bench, "measure", lambda source, **kw: {"source": str(source), "samples": 4})
    assert main(["bench", "--images", "4", "--json"]) == 0
    assert '"source": "4 generated photo-like JPEGs (in a temporary folder, deleted)"' in capsys.readouterr().out


def test_bench_dir_starts_with_an_empty_cache(tmp_path, capsys, monkeypatch):
    """`fastdata bench --dir D` kept every earlier run's cache entries in D/cache (one per dataset
    version, ~150 MB per 1024 images), piling up run after run."""
    import fastdata.cli._bench as bench

    dest, work = tmp_path / "out", tmp_path / "work"
    convert(_images(tmp_path / "src", 4), dest, _opts())
    seen = []
    monkeypatch.setattr(bench, "measure", lambda source, **kw: seen.append(sorted(
        p.name for p in (kw["workdir"] / "cache").glob("*"))) or {"source": str(source), "samples": 4})
    assert main(["bench", str(dest), "--dir", str(work), "--json"]) == 0
    (work / "cache").mkdir()
    (work / "cache" / "v1-old").mkdir()
    assert main(["bench", str(dest), "--dir", str(work), "--json"]) == 0
    assert seen == [[], []]
