"""Session 6 bug hunt in the preprocessing cache and the cached fast path: one regression test per defect."""
from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastdata.cache._store as cache_store
from fastdata.cache import Cache, Store
from fastdata.dataset import ShardedDataset
from fastdata.errors import CacheError
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import ResizeCenterCrop


def _tiny_shards(dest: Path, n: int = 6) -> Path:
    from fastdata.cli._synth import jpeg_bytes, synth_image

    with ShardWriter(dest, max_samples=4) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "jpg": jpeg_bytes(synth_image(np.random.default_rng(i), 20, 24), 90),
                     "cls": str(i).encode()})
    return dest


def _filled_store(directory: Path, n: int = 4) -> Store:
    store = Cache(directory).open_store(fingerprint="fp", num_samples=n)
    for i in range(n):
        store.put(i, {"img": np.full((3, 4, 4), i, np.uint8)})
    store.close()
    return store


def test_disk_full_while_writing_the_layout_is_a_cache_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first put reserves the field files, then writes the layout into meta.json. A full disk at that
    write escaped as a bare OSError: under on_error="skip" every sample of the epoch was then recorded as
    a bad sample of its shard instead of a CacheError, and the reserved space was not given back."""
    real = cache_store.write_json_atomic

    def full_at_layout(path: Path, obj: dict[str, Any], *, fsync: bool = True) -> None:
        if obj.get("fields"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, obj, fsync=fsync)

    monkeypatch.setattr(cache_store, "write_json_atomic", full_at_layout)
    store = Cache(tmp_path / "c").open_store(fingerprint="fp", num_samples=4)
    for _ in range(2):  # and again: no half-made layout left behind
        with pytest.raises(CacheError, match=r"cache store .*disk full.*meta\.json"):
            store.put(0, {"img": np.zeros((3, 4, 4), np.uint8)})
    assert sorted(p.name for p in store.path.iterdir() if p.name.endswith(".bin")) == []  # space given back
    store.close()

    src = _tiny_shards(tmp_path / "ds")
    ds = ShardedDataset(src, preprocess=ResizeCenterCrop(8), cache=tmp_path / "c2", on_error="skip")
    with pytest.raises(CacheError, match="disk full"):
        list(ds)
    assert ds.skipped == []
    monkeypatch.setattr(cache_store, "write_json_atomic", real)
    assert len(list(ShardedDataset(src, preprocess=ResizeCenterCrop(8), cache=tmp_path / "c2"))) == 6


def test_a_store_without_its_layout_lock_is_a_cache_error(tmp_path: Path) -> None:
    """A damaged store (layout.lock gone) failed its first put with a bare FileNotFoundError, which the
    dataset reported as an error of the sample's shard (or a skip under on_error="skip")."""
    store = Cache(tmp_path).open_store(fingerprint="fp", num_samples=2)
    (store.path / "layout.lock").unlink()
    with pytest.raises(CacheError, match=r"cache store .*layout\.lock"):
        store.put(0, {"img": np.zeros(3, np.uint8)})


def _edit_fields(path: Path, edit: Any) -> None:
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("case", ["bogus dtype", "object dtype", "outside file", "no fields", "twice", "key"])
def test_a_tampered_layout_is_refused(tmp_path: Path, case: str) -> None:
    """meta.json's layout was trusted: an unknown dtype raised a bare TypeError, an empty field list
    served every sample without its fields, a field listed twice was served once, and a field file
    named outside the store was opened for writing (and served when its size fit)."""
    path = _filled_store(tmp_path / "c").path
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(4 * 48))
    edits = {
        "bogus dtype": lambda m: m["fields"][0].update(dtype="foo"),
        "object dtype": lambda m: m["fields"][0].update(dtype="|O", shape=[6]),
        "outside file": lambda m: m["fields"][0].update(file=str(outside)),
        "no fields": lambda m: m.update(fields=[]),
        "twice": lambda m: m.update(fields=m["fields"] * 2),
        "key": lambda m: m.update(key="v1-" + "0" * 40),
    }
    _edit_fields(path, edits[case])
    with pytest.raises(CacheError, match=rf"cache store {path}: meta\.json"):
        store = Cache(tmp_path / "c").open_store(fingerprint="fp", num_samples=4)
        store.get(0)


def test_a_valid_map_with_other_bytes_than_0_and_1_is_refused(tmp_path: Path) -> None:
    """valid.bin is written with 0 and 1 only; any other byte (garbage, another file copied over it)
    marked its sample valid and served whatever the field files held."""
    path = _filled_store(tmp_path, n=4).path
    (path / "valid.bin").write_bytes(b"\x01\x00\x7f\x01")
    with pytest.raises(CacheError, match=r"valid\.bin holds byte 127 for sample 2"):
        Cache(tmp_path).open_store(fingerprint="fp", num_samples=4).get(2)


def test_boolean_or_float_indices_are_refused(tmp_path: Path) -> None:
    """get_batch/missing cast indices to int64: a boolean mask [True, False] read rows 1 and 0, and
    1.7 read row 1."""
    store = _filled_store(tmp_path, n=4)
    assert store.get_batch([3, 1])["img"][:, 0, 0, 0].tolist() == [3, 1]
    assert store.get_batch([])["img"].shape == (0, 3, 4, 4)
    for bad in ([True, False, True, False], np.array([1.7]), [0.0]):
        with pytest.raises(TypeError, match="integer"):
            store.get_batch(bad)
        with pytest.raises(TypeError, match="integer"):
            store.missing(bad)
    store.close()


def test_an_unreadable_store_is_a_cache_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store another user owns (open.lock not readable) failed with a bare PermissionError, which the
    dataset took for an error of each sample: under on_error="skip" a whole epoch was skipped."""
    import os

    src = _tiny_shards(tmp_path / "ds")
    list(ShardedDataset(src, preprocess=ResizeCenterCrop(8), cache=tmp_path / "c"))
    real_open = os.open

    def deny_lock(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith("open.lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", deny_lock)
    ds = ShardedDataset(src, preprocess=ResizeCenterCrop(8), cache=tmp_path / "c", on_error="skip")
    with pytest.raises(CacheError, match=r"cache store .*open\.lock.*Permission denied"):
        list(ds)
    assert ds.skipped == []


@pytest.mark.parametrize("which", ["open", "layout"])
def test_a_file_system_without_flock_is_a_cache_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      which: str) -> None:
    """On a file system without flock (some FUSE mounts) the store's locks failed with a bare OSError, which
    the dataset took for an error of each sample (under on_error="skip": a whole epoch skipped)."""
    import fcntl

    real_flock = fcntl.flock
    blocking = fcntl.LOCK_SH if which == "open" else fcntl.LOCK_EX

    def no_flock(fd: int, op: int) -> None:
        if op == blocking:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        real_flock(fd, op)

    monkeypatch.setattr(cache_store.fcntl, "flock", no_flock)
    ds = ShardedDataset(_tiny_shards(tmp_path / "ds"), preprocess=ResizeCenterCrop(8), cache=tmp_path / "c",
                        on_error="skip")
    with pytest.raises(CacheError, match=rf"cache store .*cannot lock .*{which}\.lock.*not supported"):
        list(ds)
    assert ds.skipped == []
