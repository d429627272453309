"""ShardedDataset's shard-reader cache: thread-safe leases, walk-aware size, opens per epoch."""
from __future__ import annotations

import multiprocessing
import sys
import threading
import traceback
from typing import Any

import numpy as np
import pytest

from fastdata.dataset import ShardedDataset, ShuffleOptions, _readers
from fastdata.loader import DataLoader
from tests.helpers.batches import batch_keys
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class _Counting:
    """Wraps a dataset's shard opener: readers opened, closed, open at most at once."""

    def __init__(self, ds: ShardedDataset):
        self.inner = ds.source._opener
        self.opened = self.closed = self.peak = 0
        self.lock = threading.Lock()
        object.__setattr__(ds.source, "_opener", self)

    def __call__(self, i: int) -> Any:
        reader = self.inner(i)
        counter = self
        close = reader.close

        def counted_close() -> None:
            with counter.lock:
                counter.closed += 1
            close()

        reader.close = counted_close
        with self.lock:
            self.opened += 1
            self.peak = max(self.peak, self.opened - self.closed)
        return reader


def _sample_id(sample: dict[str, Any]) -> tuple[str, int, int]:
    data = sample["bin"]
    data = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    return str(sample["__key__"]), int(sample["cls"]), data[0] if len(set(data)) == 1 else -1


@pytest.mark.parametrize(("fmt", "budget", "lock_free"), [
    ("tar", None, True), ("hdf5", None, True), ("tar", 2, True), ("hdf5", 2, True), ("tar", 2, False)])
def test_threads_load_samples_through_a_small_reader_cache(tmp_path, monkeypatch, fmt, budget, lock_free):
    """Several threads walk the dataset at once through a reader cache far smaller than the
    shards they read: an eviction never closes a reader another thread is reading (it did:
    TypeError/ValueError in the tar reader, invalid ids in h5py), and every sample is right.
    ``lock_free=False``: the path a free-threaded Python takes (the lock on every lease)."""
    if budget is not None:
        monkeypatch.setattr(_readers, "MAX_OPEN_READERS", budget)
    monkeypatch.setattr(_readers, "_LOCK_FREE", lock_free)
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    root = make_shards(tmp_path / fmt, 240 if fmt == "tar" else 90, 3, key="s{i:05d}", payload=2000, format=fmt)  # 80 / 30 shards (HDF5 opens are slow)
    passes = 2 if fmt == "tar" else 1
    ds = ShardedDataset(root, shuffle=ShuffleOptions(open_shards=1, buffer_size=0), seed=5, decode=False)
    expect = {}
    for s in ShardedDataset(root, decode=False):
        key, cls, byte = _sample_id(s)
        expect[key] = (int(cls), byte)
    threads, errors, results = 6, [], {}
    start = ds.loader_seam.epoch_start(0)
    cursors = [ds.loader_seam.cursor(start, 0) for _ in range(threads)]
    seq = cursors[0].seq
    shards, local = ds.loader_seam.locate(seq)
    work = list(zip(shards.tolist(), local.tolist(), seq.tolist()))
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: inside reads, between lease and close

    def run(k: int) -> None:
        try:
            rot = work[k * len(work) // threads:] + work[: k * len(work) // threads]
            got = []
            for _ in range(passes):
                for shard, i, g in rot:
                    got.append(_sample_id(cursors[k].load(shard, i, g)))
            results[k] = got
        except BaseException:  # noqa: BLE001 - reported below
            errors.append(traceback.format_exc())

    try:
        pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(120)
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[0]
    assert len(results) == threads
    for got in results.values():
        assert len(got) == passes * len(work)
        for key, cls, byte in got:
            assert (cls, byte) == expect[key]


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_thread_decoder_with_readers_evicted_under_it(tmp_path, monkeypatch, fmt):
    """decode_threads=4 through a cache of 2 readers (the thread decoder keeps no readers alive of
    its own any more): the same batches as worker processes."""
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    monkeypatch.setattr(_readers, "MAX_OPEN_READERS", 2)
    root = make_shards(tmp_path / fmt, 300 if fmt == "tar" else 150, 3, key="s{i:05d}", payload=2000, format=fmt)
    make = lambda: ShardedDataset(root, shuffle=ShuffleOptions(open_shards=2, buffer_size=50), seed=3)  # noqa: E731
    ref = batch_keys(DataLoader(make(), batch_size=16, num_workers=2))
    for _ in range(2):
        ds = make()
        count = _Counting(ds)
        assert batch_keys(DataLoader(ds, batch_size=16, num_workers=2, decode_threads=4)) == ref
        assert count.peak <= 2 + 4 and count.opened > 40  # evicted readers stay open while a thread reads them


class _FakeReader:
    def __init__(self, shard: int):
        self.shard, self.closed, self.reads = shard, 0, 0
        self.keys = ("a", "b")

    def __len__(self) -> int:
        return 2

    def read(self, i: int, fields: Any = None) -> dict[str, Any]:
        assert not self.closed, "read from a closed reader"
        self.reads += 1
        return {"__key__": self.keys[i]}

    def close(self) -> None:
        self.closed += 1


def test_a_reader_in_use_is_closed_by_its_last_user_and_taken_back_before(tmp_path, monkeypatch):
    monkeypatch.setattr(_readers, "MAX_OPEN_READERS", 1)
    ds = ShardedDataset(make_shards(tmp_path / "ds", 12, 3, key="s{i:05d}", payload=2000), decode=False)  # 4 shards
    made: list[_FakeReader] = []

    def opener(i: int) -> _FakeReader:
        made.append(_FakeReader(i))
        return made[-1]

    object.__setattr__(ds.source, "_opener", opener)
    cache = ds._samples.reader_cache()
    a = cache.acquire(0, None, ds._samples)
    a2 = cache.acquire(0, None, ds._samples)
    assert a is a2 and len(made) == 1
    b = cache.acquire(1, None, ds._samples)  # budget 1: shard 0 leaves the cache, still in use
    assert made[0].closed == 0
    cache.release(b)
    again = cache.acquire(0, None, ds._samples)  # taken back, not reopened; shard 1 (idle) is closed now
    assert again is a and len(made) == 2 and made[1].closed == 1
    for lease in (a, a2, again):
        cache.release(lease)
    assert made[0].closed == 0  # in the cache again
    cache.release(cache.acquire(2, None, ds._samples))
    assert made[0].closed == 1 and len(made) == 3


def test_a_failing_open_is_not_cached_and_wakes_waiters(tmp_path):
    ds = ShardedDataset(make_shards(tmp_path / "ds", 12, 3, key="s{i:05d}", payload=2000), decode=False)
    calls = []

    def opener(i: int) -> Any:
        calls.append(i)
        raise OSError(f"cannot open shard {i}")

    object.__setattr__(ds.source, "_opener", opener)
    cache = ds._samples.reader_cache()
    for _ in range(2):
        with pytest.raises(OSError, match="cannot open shard 3"):
            cache.acquire(3, None, ds._samples)
    assert calls == [3, 3] and not cache._opening and not cache._entries


@pytest.mark.parametrize(("shards", "per_shard"), [(16, 32), (64, 32), (40, 50)])
def test_a_shuffled_epoch_opens_each_shard_once(tmp_path, shards, per_shard):
    """Default shuffle (buffer 1000 > what open_shards pieces hold): the walk interleaves every
    shard, more than open_shards + 2 readers; before, an epoch of 16 x 32 reopened readers ~190 times."""
    root = make_shards(tmp_path / "ds", shards * per_shard, per_shard, key="s{i:05d}", payload=2000)
    ds = ShardedDataset(root, shuffle=True, seed=1, decode=False)
    count = _Counting(ds)
    ref = [s["__key__"] for s in ShardedDataset(root, shuffle=True, seed=1, decode=False)]
    for epoch in range(2):
        ds.set_epoch(epoch)
        before = count.opened
        keys = [s["__key__"] for s in ds]
        assert count.opened - before <= shards, f"epoch {epoch}: {count.opened - before} opens for {shards} shards"
        if epoch == 0:
            assert keys == ref  # the order is the plan's, whatever the cache does
    assert sorted(keys) == sorted(ref)


@pytest.mark.parametrize("kw", [{"num_workers": 0}, {"num_workers": 3, "decode_threads": 2}], ids=["in-process", "threads"])
def test_in_process_loader_and_threads_open_each_shard_once(tmp_path, kw):
    root = make_shards(tmp_path / "ds", 64 * 16, 16, key="s{i:05d}", payload=2000)
    ds = ShardedDataset(root, shuffle=True, seed=2, decode=False)
    count = _Counting(ds)
    assert len(batch_keys(list(DataLoader(ds, batch_size=8, **kw)))) == 64 * 16
    assert count.opened <= 64, count.opened


def test_the_open_budget_bounds_open_readers(tmp_path, monkeypatch):
    monkeypatch.setattr(_readers, "MAX_OPEN_READERS", 5)
    root = make_shards(tmp_path / "ds", 30 * 8, 8, key="s{i:05d}", payload=2000)
    ds = ShardedDataset(root, shuffle=True, seed=3, decode=False)
    count = _Counting(ds)
    ref = [s["__key__"] for s in ShardedDataset(root, shuffle=True, seed=3, decode=False)]
    assert [s["__key__"] for s in ds] == ref
    assert count.peak <= 5 and count.opened > 30  # the walk interleaves 30 shards: reopens are a must


def test_readers_needed_soon_stay_open_across_epochs(tmp_path):
    """At an epoch's start the cache still holds the last epoch's readers; the new walk's readers
    evict those it needs last, never the ones it is reading."""
    root = make_shards(tmp_path / "ds", 200 * 10, 10, key="s{i:05d}", payload=2000)
    ds = ShardedDataset(root, shuffle=ShuffleOptions(open_shards=4, buffer_size=100), seed=4, decode=False)
    count = _Counting(ds)
    for epoch in range(3):
        ds.set_epoch(epoch)
        before = count.opened
        n = sum(1 for _ in ds)
        assert n == 2000 and count.opened - before <= 200, (epoch, count.opened - before)
    assert count.peak < 200  # sized by the walk's interleaving, not by every shard


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_forked_children_start_with_their_own_readers(tmp_path):
    root = make_shards(tmp_path / "ds", 10 * 4, 4, key="s{i:05d}", payload=2000)
    ds = ShardedDataset(root, shuffle=True, seed=6, decode=False)
    first = [s["__key__"] for s in ds]  # readers open in this process
    got = batch_keys(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork"))
    assert sorted(got) == sorted(first)
    assert ds._samples.reader_cache().forks == _readers._FORKS and ds._samples.reader_cache()._entries


def test_a_resumed_epoch_opens_each_remaining_shard_once(tmp_path):
    root = make_shards(tmp_path / "ds", 40 * 20, 20, key="s{i:05d}", payload=2000)
    ds = ShardedDataset(root, shuffle=True, seed=7, decode=False)
    full = [s["__key__"] for s in ds]
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(333)]
    state = ds.state_dict()
    del it
    again = ShardedDataset(root, shuffle=True, seed=7, decode=False)
    again.load_state_dict(state)
    count = _Counting(again)
    rest = [s["__key__"] for s in again]
    assert head + rest == full
    touched = {int(k[1:]) // 20 for k in rest}  # the shards the rest reads (20 samples per shard, in key order)
    assert count.opened == len(touched)


def test_open_budget_follows_the_file_descriptor_limit(monkeypatch):
    resource = pytest.importorskip("resource")
    for soft, want in [(100, 25), (40, 16), (1 << 20, 1024), (resource.RLIM_INFINITY, 1024)]:
        monkeypatch.setattr(resource, "getrlimit", lambda _which, soft=soft: (soft, soft))
        assert _readers._open_budget() == want
    monkeypatch.setattr(_readers, "MAX_OPEN_READERS", 7)
    assert _readers._open_budget() == 7


def test_a_node_cache_with_a_byte_limit_keeps_the_floor(tmp_path):
    """Each open reader of a remote manifest pins its shard in the node cache, whose max_bytes is
    documented to need room for open_shards x walks + 2 readers: a wide walk keeps to that."""
    from tests.helpers.loopback_server import LoopbackServer, make_shard_set

    from fastdata.dataset import RemoteShards
    from fastdata.manifest import Manifest

    make_shard_set(tmp_path / "www" / "ds", 48, 4, payload=2000, seed=1)  # 12 shards
    limit = 6 * max(s.bytes for s in Manifest.load(tmp_path / "www" / "ds").shards)  # floor 2 x 1 + 2 = 4 fits
    with LoopbackServer(tmp_path / "www", ranges=False, max_requests=2000, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", max_bytes=limit, prefetch=0),
                            shuffle=ShuffleOptions(open_shards=2, buffer_size=1000), seed=1, decode=False)
        count = _Counting(ds)
        assert sorted(int(s["cls"]) for s in ds) == list(range(48))  # the walk interleaves all 12 shards
        assert count.peak <= 4
