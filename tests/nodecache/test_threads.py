"""The node cache's threads: prefetch and release threads stopped around fork, prefetch failures,
use locks given back, many threads acquiring one shard."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

from fastdata.dataset import RemoteShards, ShardedDataset
from fastdata.nodecache import _cache
from tests.helpers.loopback_server import LoopbackServer, make_shard_set


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


@contextlib.contextmanager
def _shard_1_down(root, tmp_path, down):
    """Serve ``root`` with the shards named in ``down`` failing (503); yield after the first sample, once the
    prefetch of shard 1 has failed: ``(server, dataset, walk, first sample)``."""
    fault = lambda path, nth: 503 if down.get(path.rsplit("/", 1)[-1]) else None  # noqa: E731
    with LoopbackServer(root, ranges=False, fault=fault, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=2, retries=1),
                            decode=False)
        cache = ds.source.node_cache
        it = iter(ds)
        first = next(it)  # reads shard 0 and prefetches shards 1 and 2: shard 1 fails
        deadline = time.monotonic() + 20
        while 1 not in cache._failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in cache._failed
        yield srv, ds, it, first


def test_a_prefetch_failure_of_an_abandoned_walk_is_not_raised_by_a_later_one(served_6_shards, tmp_path):
    # A prefetch that failed (server down for a moment) was remembered for good: the next walk's
    # demand fetch of that shard raised the old error without a request, although the server was back.
    down = {"shard-000001.tar": True}
    with _shard_1_down(served_6_shards, tmp_path, down) as (srv, ds, it, _):  # shard 1's prefetch has failed
        it.close()  # the walk is abandoned (an early exit)
        down.clear()  # the server is back
        assert sorted(s["__key__"] for s in ds) == [f"k{i:05d}" for i in range(24)]
        assert srv.counts["/ds/shard-000001.tar"] == 2


def test_an_old_prefetch_failure_is_retried_by_the_demand_fetch(served_6_shards, tmp_path, monkeypatch):
    monkeypatch.setattr(_cache, "_FAILED_FRESH_S", 0.0)  # every failure is old by the time it is needed
    down = {"shard-000001.tar": True}
    with _shard_1_down(served_6_shards, tmp_path, down) as (srv, ds, it, first):  # shard 1's prefetch has failed
        keys = [first["__key__"]]
        down.clear()
        keys += [s["__key__"] for s in it]  # the same walk reaches shard 1
        assert sorted(keys) == [f"k{i:05d}" for i in range(24)]


def _use_locks_open() -> int:
    fds = Path("/proc/self/fd")
    n = 0
    for fd in fds.iterdir():
        try:
            n += os.readlink(fd).endswith(".use")
        except OSError:
            pass
    return n


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_dropped_dataset_gives_its_use_locks_back(served_6_shards, tmp_path):
    # Every remote dataset object let go of kept a descriptor and a use lock per shard it had open for
    # the life of the process: 12 more per dataset here (EMFILE in a sweep or a notebook; with
    # max_bytes, shards pinned in the node cache that nothing could release).
    import gc

    import threading

    releasers = lambda: sum(t.name == "fastdata-nodecache-release" for t in threading.enumerate())  # noqa: E731
    with LoopbackServer(served_6_shards, ranges=False, max_requests=500, lifetime=60) as srv:
        spec = RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=0, max_bytes=10**9)
        before = _use_locks_open()
        held = []
        for seed in range(3):
            ds = ShardedDataset(spec, shuffle=True, seed=seed, decode=False)
            assert len(list(ds)) == 24
            del ds
            deadline = time.monotonic() + 10  # a dropped cache's idle-reader thread ends within its next poll
            while True:
                gc.collect()
                n = _use_locks_open() - before
                if n <= 6 or time.monotonic() > deadline:
                    break
                time.sleep(0.15)
            held.append(n)
        # the last walk's dataset stays referenced (its cursor, for a collate to take) until the next walk: its 6 shards at most
        assert max(held) <= 6, held
        deadline = time.monotonic() + 10
        while releasers() > 1 and time.monotonic() < deadline:  # the dropped caches' idle-reader threads end
            time.sleep(0.05)
        assert releasers() <= 1


def test_threads_acquiring_and_releasing_one_shard_keep_count(served_6_shards, tmp_path):
    # ShardCache.release checked and deleted _use[i] without a lock: two threads releasing the same
    # shard raised KeyError (and an acquire between the check and the delete lost track of its lock).
    # The idle-reader thread releases while the process's readers acquire, so this now happens.
    import threading

    with LoopbackServer(served_6_shards, ranges=False, max_requests=50, lifetime=60) as srv:
        cache = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=0),
                               decode=False).source.node_cache
        cache.acquire(0)
        cache.release(0)  # downloaded; from here on the threads empty and refill its list of locks
        errors: list[str] = []

        def churn() -> None:
            try:
                for _ in range(1000):
                    cache.acquire(0)
                    cache.release(0)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=churn) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            sys.setswitchinterval(interval)
        assert errors == []
        assert cache._use == {}  # nothing lost or left over


def test_no_node_cache_releaser_runs_while_the_process_forks(tmp_path: Path) -> None:
    """The node cache's releaser thread (running while this process holds readers, with max_bytes)
    is stopped before a fork and started again after it: a thread alive at fork time can leave a
    lock held forever in the child (a fork worker), and Python 3.12 warns about it."""
    import threading

    from tests.helpers import fork_probe

    from fastdata.dataset import RemoteShards, ShardedDataset
    from fastdata.manifest import Manifest

    make_shard_set(tmp_path / "www" / "ds", 8, 4, payload=256, seed=1)
    biggest = max(s.bytes for s in Manifest.load(tmp_path / "www" / "ds").shards)

    def releasers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "fastdata-nodecache-release" and t.is_alive()]

    with LoopbackServer(tmp_path / "www", ranges=False) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", max_bytes=2 * biggest,
                                         prefetch=0), decode=False)
        reader = ds.source.reader(0)
        reader.read(0)  # an open reader: the releaser thread runs
        assert releasers()
        exitcode, recorded = fork_probe.fork_child()
        assert exitcode == 0
        assert recorded and all("fastdata-nodecache-release" not in names for names in recorded), recorded
        assert releasers(), "the releaser was not started again after the fork"
        assert reader.read(1)["__key__"]  # the reader still works
        reader.close()


def test_no_prefetch_thread_runs_while_the_process_forks(served_4_shards, tmp_path, monkeypatch):
    # Prefetch threads (and their download's hashing thread) were alive when a DataLoader forked its workers
    # (e.g. right after a look at a sample in the main process): a lock one of them held at that moment stays
    # held for good in the child, and Python 3.12 warns about such forks. Like the releaser (a50f56f), they
    # stop before a fork (an unfinished download is dropped) and the parent prefetches again after it.
    import threading
    import time

    from tests.helpers import fork_probe

    from fastdata.nodecache import _threads

    monkeypatch.setattr(_threads, "_FORK_JOIN_S", 20.0)  # a loaded machine may answer late: wait for it

    def slow(path: str, nth: int):
        if path.endswith(".tar") and not path.endswith("000000.tar"):
            time.sleep(0.2)  # the prefetches are in flight when the process forks
        return None

    def prefetchers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith("fastdata-nodecache")
                and t.name != "fastdata-nodecache-release"]

    with LoopbackServer(served_4_shards, ranges=False, fault=slow, max_requests=100, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=3), decode=False)
        cache = ds.source.node_cache
        cache.plan([0, 1, 2, 3], {}, 0.0)
        assert cache.ensure(0) and prefetchers()
        exitcode, recorded = fork_probe.fork_child()
        assert exitcode == 0
        assert recorded and not [n for names in recorded for n in names if n.startswith("fastdata-nodecache")], recorded
        deadline = time.monotonic() + 10  # the parent goes on prefetching after the fork
        while not all(cache.is_local(s) for s in range(4)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(cache.is_local(s) for s in range(4))
        assert not list((cache.root / ".tmp").glob("*.part"))
        srv.reset_counts()
        assert sorted(s["__key__"] for s in ds) == [f"k{i:05d}" for i in range(16)]
        assert not [p for p in srv.counts if p.endswith(".tar")]
