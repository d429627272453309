"""Node-local shard cache over a real loopback HTTP server (127.0.0.1 only).

One download per host across processes, checksum verification, the byte limit, later epochs
served locally, furthest-future eviction beating LRU at 2x oversubscription, stale and damaged
downloads, RemoteShards' arguments and the cache folder."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fastdata.dataset import RemoteShards, ShardedDataset, ShuffleOptions
from fastdata.errors import RemoteError
from fastdata.io import RetryPolicy
from fastdata.loader import DataLoader
from fastdata.manifest import Manifest
from fastdata.nodecache import _space
from fastdata.shards.writer import ShardWriter
from tests.helpers.loopback_server import LoopbackServer, make_shard_set
from tests.helpers.remote import expected_sample


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning",
                                        "ignore:Unclosed:ResourceWarning")


FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)


def make_set(dest: Path, n: int, per_shard: int, payload: int = 2000) -> Path:
    return make_shard_set(dest, n, per_shard, payload=payload, seed=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    make_set(root / "ds", 48, 4)  # 12 shards of ~8 KB
    return root


def _cache(ds: ShardedDataset):
    return ds.source.node_cache


def _shard_gets(srv: LoopbackServer) -> dict[str, int]:
    return {p: c for p, c in srv.counts.items() if p.endswith(".tar")}


def _fetch_all(cache, order, barrier) -> None:
    barrier.wait(timeout=30)
    for i in order:
        assert cache.ensure(i).is_file()
    os._exit(0 if cache.stats.downloads + cache.stats.waited + cache.stats.hits == len(order) else 3)


def test_concurrent_processes_share_one_download(served, tmp_path):
    # slow server (2 MB/s) so that the processes really overlap on the same shards
    with LoopbackServer(served, ranges=False, rate=2e6, max_requests=500, lifetime=90) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, prefetch=0), decode=False)
        cache = _cache(ds)
        n = len(cache.manifest.shards)
        ctx = mp.get_context("fork")
        barrier = ctx.Barrier(4)
        orders = [list(range(n)), list(range(n))[::-1], list(range(0, n, 2)) + list(range(1, n, 2)), list(range(n))]
        procs = [ctx.Process(target=_fetch_all, args=(cache, o, barrier)) for o in orders]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        gets = _shard_gets(srv)
        assert len(gets) == n and set(gets.values()) == {1}, gets
        assert not list((cache.root / ".tmp").iterdir())
        for i in range(n):
            assert cache.path(i).read_bytes() == (served / "ds" / cache.manifest.shards[i].name).read_bytes()


def test_corrupted_download_is_detected_and_retried(served, tmp_path):
    target = "/ds/shard-000001.tar"
    with LoopbackServer(served, ranges=False, fault=lambda p, n: "corrupt" if p == target and n == 1 else None,
                        max_requests=500, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, prefetch=0), decode=False)
        _cache(ds).retry = FAST
        assert [s["cls"] for s in ds] == [str(i).encode() for i in range(48)]
        assert srv.counts[target] == 2 and srv.faults == 1
        assert _cache(ds).stats.retries == 1


def test_always_corrupted_download_fails_clearly(served, tmp_path):
    target = "/ds/shard-000002.tar"
    with LoopbackServer(served, ranges=False, fault=lambda p, n: "corrupt" if p == target else None,
                        max_requests=500, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, prefetch=0), decode=False)
        cache = _cache(ds)
        cache.retry = FAST
        with pytest.raises(RemoteError) as info:
            cache.ensure(2)
        msg = str(info.value)
        assert srv.url + target in msg and "sha256" in msg and "after 3 attempts" in msg
        assert not cache.path(2).exists() and not list((cache.root / ".tmp").iterdir())


def _cache_bytes(root: Path, manifest: Manifest) -> int:
    """Verified shards plus reserved downloads, measured under the cache's space lock (evictions and
    reservations happen under it, so the count is consistent)."""
    import fcntl

    fd = os.open(root / ".locks" / "space.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        total = sum((root / s.name).stat().st_size for s in manifest.shards if (root / s.name).is_file())
        for part in (root / ".tmp").glob("*.part"):
            total += int(part.name.split("-")[1])  # reserved: the size the download will reach
        return total
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def test_byte_limit_respected_with_prefetch(served, tmp_path):
    manifest = Manifest.load(served / "ds")
    biggest = max(s.bytes for s in manifest.shards)
    limit = 5 * biggest  # the dataset keeps up to open_shards x walks + 2 = 3 (4 while an old walk lingers) open
    with LoopbackServer(served, ranges=False, max_requests=2000, lifetime=90) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, max_bytes=limit, prefetch=2),
                            shuffle=ShuffleOptions(open_shards=1, buffer_size=0), decode=False)
        cache = _cache(ds)
        peak = 0
        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                try:
                    peak = max(peak, _cache_bytes(cache.root, manifest))
                except FileNotFoundError:  # a file vanished between listing and stat
                    pass
                time.sleep(0.001)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            for epoch in range(2):
                ds.set_epoch(epoch)
                got = sorted(int(s["cls"]) for s in ds)
                assert got == list(range(48))
                assert cache.used_bytes() <= limit
        finally:
            stop.set()
            t.join(5)
        assert 0 < peak <= limit
        assert cache.stats.evictions > 0


def test_second_epoch_served_locally(served, tmp_path):
    with LoopbackServer(served, ranges=False, max_requests=2000, lifetime=90) as srv:
        spec = RemoteShards(srv.url + "/ds", cache_dir=tmp_path, prefetch=2)
        ds = ShardedDataset(spec, shuffle=True, decode=False)
        loader = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=lambda xs: [s["cls"] for s in xs])
        first = sorted(int(c) for b in loader for c in b)
        assert first == list(range(48)) and len(_shard_gets(srv)) == 12
        srv.reset_counts()
        loader.set_epoch(1)
        second = sorted(int(c) for b in loader for c in b)
        assert second == first and _shard_gets(srv) == {}
        # a new dataset object (a restarted job on the same host) finds them too
        again = ShardedDataset(spec, shuffle=True, decode=False)
        assert sorted(int(s["cls"]) for s in again) == first and _shard_gets(srv) == {}


def test_idle_prefetch_threads_exit(served, tmp_path):
    """Prefetch threads do not outlive the downloads they serve (a forked worker must not inherit them)."""
    with LoopbackServer(served, ranges=False, max_requests=2000, lifetime=90) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, prefetch=2), decode=False)
        assert len(list(ds)) == 48
        # (not the idle-reader releaser: it lives while a cache with max_bytes has readers open, e.g. an
        # earlier test's dataset not yet collected)
        names = lambda: [t.name for t in threading.enumerate()  # noqa: E731
                         if t.name.startswith("fastdata-nodecache") and t.name != "fastdata-nodecache-release"]
        assert names(), "the epoch should have started prefetch threads"
        deadline = time.monotonic() + 10
        while names() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert names() == []
        assert len(list(ds)) == 48  # a later epoch starts new ones as needed


def _later_epoch_downloads(url: str, cache_dir: Path, eviction: str, limit: int, epochs: int) -> int:
    """Downloads in epochs 1.. (epoch 0 downloads every shard whatever the policy)."""
    ds = ShardedDataset(RemoteShards(url, cache_dir=cache_dir, max_bytes=limit, prefetch=0, eviction=eviction),
                        shuffle=ShuffleOptions(open_shards=1, buffer_size=0, within_shard=False), decode=False)
    first = 0
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        assert len(list(ds)) == 48
        if epoch == 0:
            first = _cache(ds).stats.downloads
            assert first == 12
    return _cache(ds).stats.downloads - first


def test_future_eviction_beats_lru_at_2x_oversubscription(served, tmp_path):
    manifest = Manifest.load(served / "ds")
    limit = 6 * max(s.bytes for s in manifest.shards)  # 12 shards, room for 6
    epochs = 6
    with LoopbackServer(served, ranges=False, max_requests=5000, lifetime=120) as srv:
        lru = _later_epoch_downloads(srv.url + "/ds", tmp_path / "lru", "lru", limit, epochs)
        future = _later_epoch_downloads(srv.url + "/ds", tmp_path / "future", "future", limit, epochs)
    reads = 12 * (epochs - 1)
    hit_lru, hit_future = 1 - lru / reads, 1 - future / reads
    # Belady on 2x oversubscription keeps ~half of each later epoch; LRU keeps what it just read
    assert hit_future >= 0.35, (hit_future, hit_lru)
    assert hit_future > hit_lru + 0.1, (hit_future, hit_lru)


def test_stale_part_from_a_killed_downloader_is_removed(served, tmp_path):
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
        manifest = Manifest.load(served / "ds")
        limit = 2 * max(s.bytes for s in manifest.shards)
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, max_bytes=limit, prefetch=0),
                            decode=False)
        cache = _cache(ds)
        stale = cache.root / ".tmp" / f"3-{manifest.shards[3].bytes}-999999-dead.part"
        stale.write_bytes(b"partial")
        assert cache.ensure(3).is_file() and not stale.exists()


def test_limit_smaller_than_a_shard_is_refused(served, tmp_path):
    with LoopbackServer(served, ranges=False, max_requests=50, lifetime=60) as srv:
        with pytest.raises(ValueError, match="smaller than the largest shard"):
            ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, max_bytes=100))


@pytest.mark.timeout(120)
def test_limit_below_the_open_readers_fails_fast(served, tmp_path, monkeypatch):
    # with the no-progress limit patched away, a fetch that does not fail fast hangs until the timeout
    monkeypatch.setattr(_space, "_STALL_S", float("inf"))
    manifest = Manifest.load(served / "ds")
    limit = 4 * max(s.bytes for s in manifest.shards)  # the dataset keeps 3 x 1 + 2 = 5 readers open
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, max_bytes=limit, prefetch=0),
                            shuffle=ShuffleOptions(open_shards=3, buffer_size=0), decode=False)
        with pytest.raises(RemoteError, match="this process has open"):
            list(ds)


def test_hdf5_shards_through_the_node_cache(tmp_path):
    pytest.importorskip("h5py")
    with ShardWriter(tmp_path / "www" / "h5", format="hdf5", max_samples=5) as w:
        for i in range(17):
            w.write({"__key__": f"k{i:03d}", "cls": i, "x.npy": np.full((3,), i, dtype=np.int16)})
    with LoopbackServer(tmp_path / "www", ranges=False, max_requests=200, lifetime=60) as srv:
        remote = ShardedDataset(RemoteShards(srv.url + "/h5", cache_dir=tmp_path / "nc"), shuffle=True, seed=2)
        local = ShardedDataset(tmp_path / "www" / "h5", shuffle=True, seed=2)
        got, want = list(remote), list(local)
        assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
        assert all(np.array_equal(a["x.npy"], b["x.npy"]) and a["cls"] == b["cls"] for a, b in zip(got, want))
        assert set(_shard_gets_any(srv).values()) == {1}


def _shard_gets_any(srv: LoopbackServer) -> dict[str, int]:
    return {p: c for p, c in srv.counts.items() if not p.endswith("manifest.json")}


def test_forked_workers_after_in_process_reading_take_their_own_locks(served, tmp_path):
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path, prefetch=0), decode=False)
        it = iter(ds)
        next(it)  # this process now holds an open reader (and its use lock) of the first shard
        loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=lambda xs: [s["cls"] for s in xs],
                            multiprocessing_context="fork")
        got = sorted(int(c) for b in loader for c in b)
        assert got == list(range(48))
        del it


def _cls_batch(samples):
    return [int(s["cls"]) for s in samples]


@pytest.mark.slow
def test_spawned_workers_share_the_node_cache(served, tmp_path):
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=90) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path), shuffle=True, decode=False)
        loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=_cls_batch, multiprocessing_context="spawn")
        assert sorted(c for b in loader for c in b) == list(range(48))
        assert set(_shard_gets(srv).values()) == {1} and len(_shard_gets(srv)) == 12


def _all_samples(url: str, cache_dir: Path) -> dict:
    ds = ShardedDataset(RemoteShards(url, cache_dir=cache_dir, prefetch=0), decode=False)
    return {s["__key__"]: bytes(s["bin"]) for s in ds}


def test_damaged_local_copies_are_replaced_not_trusted(served_6_shards, tmp_path):
    # The node cache trusted any file under a shard's name (and any sidecar index) for ever: a copy
    # left truncated or empty by a host crash (nothing is fsynced) or by hand failed every later job on
    # the host with "the shard was changed or truncated (rebuild the index)".
    want = {k: v["bin"] for k, v in ((f"k{i:05d}", expected_sample(served_6_shards, i // 4, i % 4)) for i in range(24))}
    with LoopbackServer(served_6_shards, ranges=False, max_requests=500, lifetime=60) as srv:
        url = srv.url + "/ds"
        assert _all_samples(url, tmp_path / "nc") == want
        root = ShardedDataset(RemoteShards(url, cache_dir=tmp_path / "nc"), decode=False).source.node_cache.root
        shard = lambda s: root / f"shard-{s:06d}.tar"  # noqa: E731
        shard(0).write_bytes(shard(0).read_bytes()[:-512])  # truncated
        shard(1).write_bytes(b"")  # empty
        Path(str(shard(2)) + ".idx").write_bytes(b"")  # index left empty
        Path(str(shard(3)) + ".idx").unlink()  # index gone
        Path(str(shard(4)) + ".idx").write_bytes(b"garbage")
        shard(5).write_bytes(bytes(shard(5).stat().st_size))  # right size, not a tar: its index rebuild fails
        Path(str(shard(5)) + ".idx").unlink()
        srv.reset_counts()
        assert _all_samples(url, tmp_path / "nc") == want
        gets = {p: n for p, n in srv.counts.items() if p.endswith(".tar")}
        assert gets == {"/ds/shard-000000.tar": 1, "/ds/shard-000001.tar": 1, "/ds/shard-000005.tar": 1}, gets
        srv.reset_counts()
        assert _all_samples(url, tmp_path / "nc") == want  # repaired for good
        assert not [p for p in srv.counts if p.endswith(".tar")]


def test_cache_dir_that_is_a_file_is_a_remote_error_naming_it(served_6_shards, tmp_path):
    not_a_dir = tmp_path / "afile"
    not_a_dir.write_text("x")
    with LoopbackServer(served_6_shards, ranges=False, max_requests=50, lifetime=60) as srv:
        with pytest.raises(RemoteError, match="node cache folder .*afile.*cache_dir") as info:
            ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=not_a_dir), decode=False)
    assert isinstance(info.value, OSError)  # it was a bare NotADirectoryError


@pytest.mark.parametrize("kwargs, match", [
    ({"eviction": "LRU"}, r"RemoteShards\.eviction must be one of"),
    ({"prefetch": -1}, r"RemoteShards\.prefetch must be an int >= 0"),
    ({"prefetch": True}, r"RemoteShards\.prefetch must be an int >= 0"),
    ({"cache_dir": 123}, r"RemoteShards\.cache_dir must be a path"),
])
def test_remote_shards_arguments_are_checked_before_any_request(kwargs, match):
    # They were checked only after the manifest was fetched: with the server down the user got the
    # RemoteError of five retried requests (seconds) instead; with it up, a message not naming RemoteShards.
    with pytest.raises((ValueError, TypeError), match=match):
        RemoteShards("http://127.0.0.1:9/ds", **kwargs)


def test_node_cache_dir_expands_the_home_folder_and_survives_a_chdir(served_4_shards, tmp_path, monkeypatch):
    # cache_dir="~/..." (and $FASTDATA_NODE_CACHE="~/...", as a quoted value leaves it) made a folder named "~"
    # in the working directory, and a relative cache_dir moved with os.chdir (shards downloaded again into
    # the new place); the preprocessing cache (Cache(directory)) expands "~" and resolves the path already.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with LoopbackServer(served_4_shards, ranges=False, max_requests=100, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir="~/nc", prefetch=0), decode=False)
        assert str(ds.source.node_cache.root).startswith(str(tmp_path / "home" / "nc"))
        rel = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir="rel", prefetch=0), decode=False)
        monkeypatch.chdir(tmp_path)
        assert len(list(rel)) == 16 and rel.source.node_cache.is_local(3)
        assert (work / "rel").is_dir() and not (tmp_path / "rel").exists()
        monkeypatch.setenv("FASTDATA_NODE_CACHE", "~/env")
        env = ShardedDataset(RemoteShards(srv.url + "/ds", prefetch=0), decode=False)
        assert str(env.source.node_cache.root).startswith(str(tmp_path / "home" / "env"))
    assert not (work / "~").exists() and not (tmp_path / "~").exists()


def test_a_shard_that_cannot_be_fetched_is_not_fetched_again_for_each_sample(tmp_path):
    # on_error="skip" and a shard the server refuses (HTTP 503 after every retry): each of its samples started
    # a new download with all its retries and back-off (here 8 samples x 2 attempts; 20,000 samples x 5
    # attempts and their back-off on a real shard: hours of requests at a failing server).
    make_shard_set(tmp_path / "www" / "ds", 16, 8, payload=200, seed=3)
    fault = lambda path, nth: 503 if path.endswith("shard-000001.tar") else None  # noqa: E731
    with LoopbackServer(tmp_path / "www", ranges=False, fault=fault, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=0, retries=2),
                            decode=False, on_error="skip")
        assert sorted(s["__key__"] for s in ds) == [f"k{i:05d}" for i in range(8)]
        assert len(ds.skipped) == 8 and all("HTTP 503" in s["reason"] for s in ds.skipped), ds.skipped
        assert srv.counts["/ds/shard-000001.tar"] == 2
        srv.reset_counts()
        list(ds)  # the next pass tries again, once
        assert srv.counts["/ds/shard-000001.tar"] == 2


@pytest.mark.parametrize("value", [1.5, 0.5, 1e9 + 0.5, float("nan"), True])
def test_remote_shards_refuses_a_fractional_or_bool_max_bytes(value):
    # max_bytes=1.5 (meant as 1.5 GB) became a limit of 1 byte
    with pytest.raises(ValueError, match="max_bytes"):
        RemoteShards("https://example.invalid/ds", max_bytes=value)
    assert RemoteShards("https://example.invalid/ds", max_bytes=2e9).max_bytes == 2_000_000_000
    assert RemoteShards("https://example.invalid/ds", max_bytes="1.5GB").max_bytes == 1_500_000_000


def test_remote_shards_refuses_an_empty_cache_dir():
    # '' was the current folder
    with pytest.raises(ValueError, match="cache_dir"):
        RemoteShards("https://example.invalid/ds", cache_dir="")


def test_remote_shards_retries_error_names_the_argument() -> None:
    """RemoteShards(retries=RetryPolicy(...)) said 'RetryPolicy.attempts must be an int >= 1'."""
    from fastdata.dataset import RemoteShards
    from fastdata.io import RetryPolicy

    for bad in (RetryPolicy(attempts=3), 0, True):
        with pytest.raises(ValueError, match=r"RemoteShards\.retries must be an int >= 1"):
            RemoteShards("https://example.invalid/ds", retries=bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served_2_shards(tmp_path_factory):
    from tests.helpers.loopback_server import make_shard_set  # noqa: E402

    root = tmp_path_factory.mktemp("www")
    make_shard_set(root / "ds", 8, 4, payload=300, seed=3)  # 2 shards
    return root


def test_a_node_cache_that_cannot_store_or_lock_is_an_error_not_a_skip(served_2_shards, tmp_path, monkeypatch):
    """With on_error="skip", a full local disk (or a cache folder whose lock files cannot be made) "skipped"
    every sample as if it were bad data, each one downloading its shard again (16 GETs for 8 samples, 0
    yielded), and a rank whose host had the problem yielded nothing while the others trained on: a DDP
    hang. The node cache's local side is this host's problem, as the preprocessing cache's: raised."""
    import errno

    from tests.helpers.loopback_server import LoopbackServer

    from fastdata.dataset import RemoteShards
    from fastdata.nodecache import ShardCache
    from fastdata.errors import CacheError, RemoteError

    def full(self, i, shard, tmp, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    with LoopbackServer(served_2_shards, max_requests=100, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "a", prefetch=0), decode=False,
                            on_error="skip")
        with monkeypatch.context() as m:
            m.setattr(ShardCache, "_download", full)
            with pytest.raises(CacheError, match=r"node cache .*cannot store shard-00000\d.tar.*No space left") as e:
                list(ds)
        assert isinstance(e.value, RemoteError) and not ds.skipped
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "b", prefetch=0), decode=False,
                            on_error="skip")
        (ds.source.node_cache.root / ".locks" / "0.use").mkdir()  # cannot be opened as a lock file
        with pytest.raises(CacheError, match=r"node cache .*shard-000000.tar: .*0\.use.*choose another cache_dir"):
            list(ds)
        assert not ds.skipped
