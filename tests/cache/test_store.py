"""Preprocessing stores: round trips, fingerprints, concurrency, crash safety, eviction, disk full,
and damaged stores refused as CacheErrors."""
from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastdata.cache._files as cache_files
import fastdata.cache._store as cache_store
from fastdata.cache import Cache, CACHE_FORMAT_VERSION, Store, store_key
from fastdata.dataset import ShardedDataset
from fastdata.errors import CacheError
from fastdata.transforms import ResizeCenterCrop
from tests.helpers.shards import make_shards
from tests.helpers.stores import check_store, expected


FORK = mp.get_context("fork")
IMG = (3, 64, 64)


def fill(directory: str, fingerprint: str, n: int, order: list[int], barrier=None) -> None:
    if barrier is not None:
        barrier.wait()
    store = Cache(directory).open_store(fingerprint=fingerprint, num_samples=n)
    for i in order:
        store.put(i, expected(i))
    store.close()


def test_round_trip_zero_copy_and_pickle(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c")
    store = cache.open_store(fingerprint="f" * 64, num_samples=10)
    assert store.get(0) is None and store.fields is None and store.num_valid() == 0
    for i in (0, 3, 9):
        store.put(i, {"img": torch.from_numpy(expected(i)["img"]), "aux": expected(i)["aux"]})
    assert store.get(1) is None
    assert check_store(store) == 3
    got = store.get(3)
    assert got is not None and got["img"].dtype == torch.uint8 and got["img"].shape == IMG
    assert not got["img"].numpy().flags.owndata  # a view of the mapping, not a copy
    clone = pickle.loads(pickle.dumps(store))
    assert check_store(clone) == 3 and clone.num_valid() == 3
    store.put(3, expected(3))  # already valid: a no-op
    clone.close(), store.close(), store.close()  # close twice is fine
    assert got["img"][0, 0, 1].item() == expected(3)["img"][0, 0, 1]  # tensors outlive close()


def test_scalars_and_dtypes(tmp_path: Path) -> None:
    store = Cache(tmp_path).open_store(fingerprint="x", num_samples=4)
    store.put(2, {"cls": 7, "w": np.float16(0.5), "m": np.ones((2, 2), dtype=bool), "big": np.arange(3, dtype=">i4")})
    got = store.get(2)
    assert got is not None
    assert got["cls"].item() == 7 and got["cls"].shape == ()
    assert got["w"].dtype == torch.float16 and got["m"].dtype == torch.bool
    assert got["big"].tolist() == [0, 1, 2] and got["big"].dtype == torch.int32


def test_option_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        Cache(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="max_bytes"):
        Cache(tmp_path, max_bytes=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fsync must be a bool"):
        Cache(tmp_path, fsync=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="directory must be"):
        Cache("")
    cache = Cache(tmp_path)
    with pytest.raises(ValueError, match="fingerprint must be"):
        cache.open_store(fingerprint="", num_samples=3)
    with pytest.raises(ValueError, match="num_samples must be an int >= 1, got 0"):
        cache.open_store(fingerprint="a", num_samples=0)
    store = cache.open_store(fingerprint="a", num_samples=3)
    with pytest.raises(IndexError, match="index 3 out of range"):
        store.get(3)
    with pytest.raises(CacheError, match="non-empty mapping"):
        store.put(0, {})


def test_mismatched_shapes_dtypes_and_fields(tmp_path: Path) -> None:
    store = Cache(tmp_path).open_store(fingerprint="a", num_samples=5)
    store.put(0, {"img": np.zeros((3, 8, 8), np.uint8), "cls": 1})
    with pytest.raises(CacheError, match=r"field 'img' of sample 1: expected shape \(3, 8, 8\) dtype uint8, "
                                         r"got shape \(3, 8, 9\) dtype uint8"):
        store.put(1, {"img": np.zeros((3, 8, 9), np.uint8), "cls": 1})
    with pytest.raises(CacheError, match="expected shape .* dtype uint8, got shape .* dtype float32"):
        store.put(1, {"img": np.zeros((3, 8, 8), np.float32), "cls": 1})
    with pytest.raises(CacheError, match=r"sample 2 has fields \['img'\].*missing \['cls'\]"):
        store.put(2, {"img": np.zeros((3, 8, 8), np.uint8)})
    with pytest.raises(CacheError, match="field 'txt' of sample 2 has dtype <U3"):
        store.put(2, {"img": np.zeros((3, 8, 8), np.uint8), "txt": "abc"})
    assert store.num_valid() == 1
    # another process (here: another Store object) sees the layout the first put defined
    other = Cache(tmp_path).open_store(fingerprint="a", num_samples=5)
    with pytest.raises(CacheError, match="field 'img' of sample 4: expected shape"):
        other.put(4, {"img": np.zeros((1, 8, 8), np.uint8), "cls": 1})


def test_changed_fingerprint_or_count_misses(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    a = cache.open_store(fingerprint="manifest-A/resize-224", num_samples=4)
    a.put(0, expected(0))
    assert cache.open_store(fingerprint="manifest-A/resize-224", num_samples=4).get(0) is not None
    assert cache.open_store(fingerprint="manifest-A/resize-256", num_samples=4).get(0) is None
    assert cache.open_store(fingerprint="manifest-B/resize-224", num_samples=4).get(0) is None
    assert cache.open_store(fingerprint="manifest-A/resize-224", num_samples=5).get(0) is None
    key = store_key("manifest-A/resize-224", 4)
    assert key.startswith(f"v{CACHE_FORMAT_VERSION}-") and a.path.name == key
    assert len({i.key for i in cache.list()}) == 4


def test_foreign_meta_is_refused(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    store = cache.open_store(fingerprint="a", num_samples=3)
    meta = (store.path / "meta.json").read_text().replace('"fingerprint": "a"', '"fingerprint": "zzz"')
    store.close()
    (store.path / "meta.json").write_text(meta)
    with pytest.raises(CacheError, match="meta.json has fingerprint='zzz', expected 'a'"):
        cache.open_store(fingerprint="a", num_samples=3)


def test_two_processes_fill_one_store_concurrently(tmp_path: Path) -> None:
    n = 300
    barrier = FORK.Barrier(2)
    orders = [list(range(n)), list(reversed(range(n)))]
    random.Random(0).shuffle(orders[1])
    procs = [FORK.Process(target=fill, args=(str(tmp_path), "fp", n, order, barrier)) for order in orders]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (info,) = Cache(tmp_path).list()
    assert info.num_valid == n and info.fill_ratio == 1.0 and not info.in_use
    assert check_store(Cache(tmp_path).open_store(fingerprint="fp", num_samples=n), require_full=True) == n


def test_layout_creation_race(tmp_path: Path) -> None:
    """Many processes doing their first put at once: exactly one layout wins, all samples land."""
    n, k = 64, 6
    barrier = FORK.Barrier(k)
    procs = [FORK.Process(target=fill, args=(str(tmp_path), "race", n, list(range(j, n, k)), barrier))
             for j in range(k)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [store_key("race", n)]  # no leftovers
    store = Cache(tmp_path).open_store(fingerprint="race", num_samples=n)
    assert check_store(store, require_full=True) == n


def _fill_forever(directory: str, n: int, seed: int) -> None:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    fill(directory, "killed", n, order)


def test_fill_killed_at_random_points_never_serves_a_wrong_sample(tmp_path: Path) -> None:
    n = 600
    rng = random.Random(1234)
    seen = []
    for round_ in range(10):
        p = FORK.Process(target=_fill_forever, args=(str(tmp_path), n, round_))
        p.start()
        time.sleep(rng.uniform(0.0, 0.04))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        store = Cache(tmp_path).open_store(fingerprint="killed", num_samples=n)
        seen.append(check_store(store))
        store.close()
    assert seen == sorted(seen)  # fills resume: valid samples never disappear
    # a half-written sample (data without its flag, as a writer killed mid-put leaves it) is a miss
    store = Cache(tmp_path).open_store(fingerprint="killed", num_samples=n)
    missing = next((i for i in range(n) if store.get(i) is None), None)
    if missing is not None:
        field = store.fields[0]  # type: ignore[index]
        with open(store.path / field.file, "r+b") as f:
            f.seek(missing * field.nbytes)
            f.write(b"\xff" * (field.nbytes // 2))
        assert store.get(missing) is None
    fill(str(tmp_path), "killed", n, list(range(n)))
    assert check_store(store, require_full=True) == n


def _fill_killed_after(directory: str, n: int, writes: int) -> None:
    """Fill, and SIGKILL this process right after its ``writes``-th pwrite (data or valid flag)."""
    real = cache_store.pwrite_all
    done = [0]

    def pwrite_then_die(fd: int, data: memoryview, offset: int) -> None:
        if done[0] == writes:
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd, data, offset)
        done[0] += 1

    cache_store.pwrite_all = pwrite_then_die
    fill(directory, "cut", n, list(range(n)))


def test_fill_killed_at_every_write_of_a_put_never_serves_a_wrong_sample(tmp_path: Path) -> None:
    """Deterministic companion of the random-kill test: a put is 2 field writes then the valid flag;
    kill before the first and after each write of two puts and check what a fresh reader sees."""
    n = 4
    for writes in range(7):
        directory = tmp_path / f"w{writes}"
        p = FORK.Process(target=_fill_killed_after, args=(str(directory), n, writes))
        p.start()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        store = Cache(directory).open_store(fingerprint="cut", num_samples=n)
        assert check_store(store) == writes // 3  # only samples whose flag was written are served
        assert [store.is_valid(i) for i in range(n)] == [i < writes // 3 for i in range(n)]
        store.close()


def test_disk_full_mid_fill_gives_clear_error_and_usable_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Cache(tmp_path).open_store(fingerprint="full", num_samples=20)
    for i in range(5):
        store.put(i, expected(i))
    real_pwrite = os.pwrite
    calls = {"n": 0}

    def pwrite(fd: int, data: object, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 1:  # first field of sample 5 lands, the second hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(CacheError, match=rf"cache store {store.path}: disk full while writing sample 5 .*"
                                         "the 5 samples already filled stay valid"):
        store.put(5, expected(5))
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert store.get(5) is None and check_store(store) == 5
    store.put(5, expected(5))  # space freed: filling resumes
    assert check_store(store) == 6


def test_disk_full_at_preallocation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, nbytes: int) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_files, "preallocate", no_space)
    store = Cache(tmp_path).open_store(fingerprint="big", num_samples=100)
    with pytest.raises(CacheError, match="disk full: cannot reserve 1235300 bytes"):
        store.put(0, expected(0))
    assert sorted(p.name for p in store.path.iterdir() if p.name.endswith(".bin")) == []  # space given back
    with pytest.raises(CacheError, match="disk full"):  # later puts fail fast, reads just miss
        store.put(1, expected(1))
    assert store.get(0) is None


def _filled(cache: Cache, fingerprint: str, n: int, *, age: float) -> Path:
    store = cache.open_store(fingerprint=fingerprint, num_samples=n)
    for i in range(n):
        store.put(i, expected(i))
    store.close()
    t = time.time() - age
    os.utime(store.path / "last_used", (t, t))
    return store.path


def test_list_and_remove(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    a = cache.open_store(fingerprint="aaaa1111", num_samples=10)
    for i in range(4):
        a.put(i, expected(i))
    _filled(cache, "aaaa2222", 2, age=100)
    _filled(cache, "bbbb", 2, age=200)
    infos = cache.list()
    assert [i.fingerprint for i in infos] == ["aaaa1111", "aaaa2222", "bbbb"]  # most recent first
    assert infos[0].fill_ratio == 0.4 and infos[0].in_use and not infos[1].in_use
    assert infos[0].sample_nbytes == int(np.prod(IMG)) + 64
    assert infos[0].size_bytes >= 10 * infos[0].sample_nbytes
    with pytest.raises(CacheError, match="'aaaa' matches 2 fingerprints"):
        cache.remove("aaaa")
    with pytest.raises(CacheError, match="no store matches 'cccc'"):
        cache.remove("cccc")
    with pytest.raises(CacheError, match="is open in a running process"):
        cache.remove("aaaa1")
    assert [i.fingerprint for i in cache.remove("aaaa2")] == ["aaaa2222"]
    assert [i.fingerprint for i in cache.remove(store_key("bbbb", 2)[:10])] == ["bbbb"]
    a.close()
    cache.remove("aaaa1111")
    assert cache.list() == [] and list(tmp_path.iterdir()) == []


def test_eviction_respects_limit_and_skips_open_stores(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    old = _filled(cache, "old", 8, age=300)
    busy = _filled(cache, "busy", 8, age=200)
    mid = _filled(cache, "mid", 8, age=100)
    size = Cache(tmp_path).list()[0].size_bytes
    held = cache.open_store(fingerprint="busy", num_samples=8)  # open: never evicted
    os.utime(busy / "last_used", (time.time() - 400,) * 2)
    limited = Cache(tmp_path, max_bytes=3 * size)
    assert limited.evict() == [] and limited.total_bytes() == 3 * size
    new = limited.open_store(fingerprint="new", num_samples=8)
    new.put(0, expected(0))  # needs room for one more store: the least recently used closed one goes
    assert not old.exists() and busy.exists() and mid.exists() and new.path.exists()
    assert limited.total_bytes() <= 3 * size
    tight = Cache(tmp_path, max_bytes=size)
    assert [i.fingerprint for i in tight.evict()] == ["mid"]  # busy and new are open
    assert tight.total_bytes() == 2 * size > size
    held.close(), new.close()
    os.utime(busy / "last_used", (time.time() - 50,) * 2)  # used before `new` (mtimes are coarse)
    assert sorted(i.fingerprint for i in tight.evict()) == ["busy"]  # LRU first, then under the limit
    assert tight.total_bytes() <= size
    with pytest.raises(CacheError, match="does not fit in max_bytes"):
        Cache(tmp_path, max_bytes=1000).open_store(fingerprint="huge", num_samples=8).put(0, expected(0))


def test_store_reopens_after_eviction(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    path = _filled(cache, "gone", 4, age=10)
    assert [i.fingerprint for i in cache.remove("gone")] == ["gone"] and not path.exists()
    store = cache.open_store(fingerprint="gone", num_samples=4)  # a fresh, empty store
    assert store.get(0) is None and store.path == path


def test_fsync_mode(tmp_path: Path) -> None:
    store = Cache(tmp_path, fsync=True).open_store(fingerprint="durable", num_samples=3)
    for i in range(3):
        store.put(i, expected(i))
    assert check_store(store, require_full=True) == 3


def test_get_batch(tmp_path: Path) -> None:
    store = Cache(tmp_path).open_store(fingerprint="batch", num_samples=10)
    for i in range(8):
        store.put(i, expected(i))
    got = store.get_batch([5, 0, 7])
    assert got is not None and got["img"].shape == (3, *IMG) and got["aux"].shape == (3, 16)
    assert torch.equal(got["img"][0], torch.from_numpy(expected(5)["img"])) and got["aux"][2, 0] == 7
    assert store.get_batch([1, 8]) is None  # 8 is not filled
    assert store.missing([9, 5, 8, 0]).tolist() == [9, 8] and len(store.missing(np.arange(8))) == 0
    with pytest.raises(IndexError, match="index -1 out of range"):
        store.missing([-1])
    out = {"img": torch.zeros((4, *IMG), dtype=torch.uint8)}
    got = store.get_batch(np.arange(2, 4), out=out)
    assert got is not None and got["img"].data_ptr() == out["img"].data_ptr()
    assert torch.equal(out["img"][1], torch.from_numpy(expected(3)["img"]))
    with pytest.raises(CacheError, match=r"out\['img'\] has shape \(4, 1, 64, 64\) dtype torch.uint8, expected"):
        store.get_batch([0], out={"img": torch.zeros((4, *IMG), dtype=torch.uint8)[:, :1]})
    with pytest.raises(IndexError, match="index 10 out of range"):
        store.get_batch([0, 10])


def test_parse_bytes() -> None:
    import argparse

    from fastdata.cli._args import byte_size

    assert byte_size("20GB") == 20 * 10**9 and byte_size("512MiB") == 512 << 20 and byte_size("1000") == 1000
    assert byte_size("1e9") == 10**9
    with pytest.raises(argparse.ArgumentTypeError, match="cannot parse size '12 parsecs'"):
        byte_size("12 parsecs")


def test_damaged_store_is_reported_and_removable(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    store = cache.open_store(fingerprint="dmg", num_samples=2)
    store.close()
    (store.path / "open.lock").unlink()
    with pytest.raises(CacheError, match="no open.lock .*remove it with `fastdata cache rm`"):
        cache.open_store(fingerprint="dmg", num_samples=2)
    assert [i.fingerprint for i in cache.remove("dmg")] == ["dmg"] and not store.path.exists()


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

    src = make_shards(tmp_path / "ds", 6, 4, key="k{i:03d}", image=(20, 24))
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

    src = make_shards(tmp_path / "ds", 6, 4, key="k{i:03d}", image=(20, 24))
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
    ds = ShardedDataset(make_shards(tmp_path / "ds", 6, 4, key="k{i:03d}", image=(20, 24)), preprocess=ResizeCenterCrop(8), cache=tmp_path / "c",
                        on_error="skip")
    with pytest.raises(CacheError, match=rf"cache store .*cannot lock .*{which}\.lock.*not supported"):
        list(ds)
    assert ds.skipped == []
