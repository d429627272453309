"""A conversion's DEST: overwrite safety, resuming an interrupted run, the lock against a second run,
and reruns that are refused naming what differs."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from fastdata.cli._main import main
from fastdata.shards.convert import ConversionError, convert
from fastdata.shards.reader import verify
from tests.helpers.sources import image_folder, interrupted_convert, opts, synth_folder


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


def test_overwrite_of_a_url_dest_removes_its_old_manifest_first(tmp_path, monkeypatch):
    """Before: an interrupted ``--overwrite`` into a URL left the old manifest above shards partly
    replaced by the new run, and the rerun without --overwrite refused to resume ("holds a
    finished conversion with different arguments")."""
    pytest.importorskip("fsspec")
    from fastdata.io import remote_size

    url = f"memory://fastdata-overwrite/{tmp_path.name}/ds"
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


def test_dest_holding_a_src_file_of_another_name_is_allowed_with_overwrite(tmp_path):
    """Only SRC files the conversion would replace or remove make DEST unusable."""
    from fastdata.shards.tar import write_tar_shard

    write_tar_shard(tmp_path / "data.tar", [{"__key__": f"k{i}", "txt": f"v{i}"} for i in range(3)])
    result = convert(tmp_path / "data.tar", tmp_path, opts(overwrite=True))
    assert result.manifest.num_samples == 3 and (tmp_path / "data.tar").is_file()


def test_a_second_conversion_into_a_busy_dest_fails_at_once(tmp_path):
    src, dest = synth_folder(tmp_path / "src", 4), tmp_path / "out"
    dest.mkdir()
    fd = os.open(dest, os.O_RDONLY)  # the running conversion's lock (another open file: conflicts in-process too)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConversionError, match=rf"another conversion is writing DEST {dest} \(pid {os.getpid()}\)"):
            convert(src, dest, opts(samples_per_shard=2))
        assert os.listdir(dest) == []  # nothing touched
    finally:
        os.close(fd)
    assert convert(src, dest, opts(samples_per_shard=2)).manifest.num_samples == 4


def test_a_dead_holders_lock_is_gone(tmp_path):
    """A conversion killed (SIGKILL) while holding the lock: the rerun resumes."""
    src, dest = synth_folder(tmp_path / "src", 4), tmp_path / "out"
    dest.mkdir()
    code = (f"import fcntl, os, time\nfd = os.open({str(dest)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConversionError, match=rf"\(pid {holder.pid}\)"):
            convert(src, dest, opts(samples_per_shard=2))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert convert(src, dest, opts(samples_per_shard=2)).manifest.num_samples == 4


def test_the_lock_is_released_by_an_interrupted_run(tmp_path, monkeypatch):
    import fastdata.shards.convert as convert_mod

    src, dest = synth_folder(tmp_path / "src", 4), tmp_path / "out"
    real = convert_mod._write_job

    def interrupt(task, tick):
        if task.job.number == 1:
            raise KeyboardInterrupt
        return real(task, tick)

    monkeypatch.setattr(convert_mod, "_write_job", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dest, opts(samples_per_shard=2))
    monkeypatch.setattr(convert_mod, "_write_job", real)
    result = convert(src, dest, opts(samples_per_shard=2))
    assert result.kept == 1 and result.manifest.num_samples == 4 and not convert_mod._held_locks


def test_refused_rerun_names_the_argument_and_the_inputs(tmp_path):
    src, dest = synth_folder(tmp_path / "src", 6), tmp_path / "out"
    convert(src, dest, opts(samples_per_shard=2))
    with pytest.raises(ConversionError, match=r"different arguments or inputs: --samples-per-shard was 2, now 3; holds"):
        convert(src, dest, opts(samples_per_shard=3))
    with pytest.raises(ConversionError, match=r"inputs: --format was tar, now hdf5, --check was header, now full;"):
        convert(src, dest, opts(samples_per_shard=2, format="hdf5", check="full"))
    touched = src / "class_01" / "img_000003.jpg"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # `touch`, as `cp -r` does to every input
    with pytest.raises(ConversionError, match=r"inputs: input files modified or added since: class_01/img_000003.jpg;"):
        convert(src, dest, opts(samples_per_shard=2))
    os.utime(touched, ns=(1, 1))
    with pytest.raises(ConversionError, match=r"inputs: input files' modification times changed;"):
        convert(src, dest, opts(samples_per_shard=2))
    (src / "class_00" / "img_000000.jpg").unlink()
    with pytest.raises(ConversionError, match=r"inputs: SRC has 5 input files, was 6;"):
        convert(src, dest, opts(samples_per_shard=2))


def test_refused_resume_names_what_differs(tmp_path, monkeypatch):
    import fastdata.shards.convert as convert_mod

    src, dest = synth_folder(tmp_path / "src", 4), tmp_path / "out"
    monkeypatch.setattr(convert_mod, "_write_job", lambda task, tick: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        convert(src, dest, opts(samples_per_shard=2, shuffle=True, seed=1))
    monkeypatch.undo()
    with pytest.raises(ConversionError, match=r"an interrupted conversion with different arguments or inputs: "
                                              r"--seed was 1, now 2; holds"):
        convert(src, dest, opts(samples_per_shard=2, shuffle=True, seed=2))


def test_a_dest_holding_only_hidden_files_is_empty(tmp_path):
    """A DEST holding only Finder's .DS_Store was "not empty" and needed --overwrite (hidden files in
    SRC are ignored)."""
    src, dest = synth_folder(tmp_path / "src", 4), tmp_path / "out"
    dest.mkdir()
    (dest / ".DS_Store").write_bytes(b"x")
    assert convert(src, dest, opts(samples_per_shard=2)).manifest.num_samples == 4
    assert (dest / ".DS_Store").read_bytes() == b"x"
    (dest / "notes.txt").write_text("mine")  # a visible file still makes it not empty
    with pytest.raises(ConversionError, match=r"not empty \(a finished conversion .*holds manifest.json, notes.txt"):
        convert(src, dest, opts(samples_per_shard=3))


def test_rerun_of_a_conversion_that_read_nothing_fails_again(tmp_path, capsys):
    """`fastdata shard SRC DEST` where no input is readable fails (status 1); the same command again
    said "DEST: complete, 0 samples ... nothing to do" with status 0 (a retry loop went on with an empty set)."""
    src, dest = tmp_path / "src", tmp_path / "out"
    (src / "c0").mkdir(parents=True)
    (src / "c0" / "a.jpg").write_bytes(b"not an image")
    for _ in range(2):
        assert main(["shard", str(src), str(dest), "--quiet"]) == 1
        assert "none of its 1 inputs could be read" in capsys.readouterr().err
