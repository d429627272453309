"""Remote shards and the node-local cache (session 6): a process that holds shards open but does not
read them (a DataLoader worker parked by in-order delivery) gives them up to a process waiting for
space, and reads them again, correctly, when it resumes."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.loopback_server import LoopbackServer, make_shard_set

from fastdata.dataset import RemoteShards, ShardedDataset
from fastdata.errors import RemoteError
from fastdata.manifest import Manifest
from fastdata.nodecache import _cache, _space
from fastdata.shards.tar import TarShardReader

pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    make_shard_set(root / "ds", 24, 4, payload=2000, seed=1)  # 6 shards of ~8 KB
    return root


def _expected(served: Path, shard: int, i: int) -> dict:
    with TarShardReader(served / "ds" / f"shard-{shard:06d}.tar") as r:
        return {k: bytes(v) if not isinstance(v, str) else v for k, v in r.read(i).items()}


def _same(got: dict, want: dict) -> bool:
    return {k: bytes(v) if not isinstance(v, str) else v for k, v in got.items()} == want


def _parked_holder(source, shards, ready, go, out: Path, served: Path) -> None:
    """Read a sample of each shard (their readers stay open, holding the cache), then sit idle until
    ``go`` like a DataLoader worker waiting for its next index; then read the next sample of each."""
    try:
        readers = [source.reader(s) for s in shards]
        ok = all(_same(r.read(0), _expected(served, s, 0)) for r, s in zip(readers, shards))
        ready.set()
        if not go.wait(30):
            out.write_text("never resumed")
            return
        ok = ok and all(_same(r.read(1), _expected(served, s, 1)) for r, s in zip(readers, shards))
        for r in readers:
            r.close()
        out.write_text("ok" if ok else "wrong data")
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.write_text(f"{type(e).__name__}: {e}")
    finally:
        os._exit(0)


def test_idle_holder_gives_way_to_a_process_waiting_for_space(served, tmp_path, monkeypatch):
    # The stall of session 5: process A holds the whole cache through readers it does not read now
    # (parked); process B needs space for another shard; A waits for B (in the loader: the main
    # process waits for B's batch before A gets its next index). Before: B waited until the
    # no-progress limit (120 s; here 8 s) and raised a RemoteError.
    monkeypatch.setattr(_space, "_STALL_S", 8.0)
    manifest = Manifest.load(served / "ds")
    held = [0, 1, 2]
    limit = sum(manifest.shards[s].bytes for s in held)
    want = min(range(3, 6), key=lambda s: manifest.shards[s].bytes)
    with LoopbackServer(served, ranges=False, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", max_bytes=limit, prefetch=0),
                            decode=False)
        ctx = mp.get_context("fork")
        ready, go = ctx.Event(), ctx.Event()
        out = tmp_path / "a.txt"
        proc = ctx.Process(target=_parked_holder, args=(ds.source, held, ready, go, out, served))
        proc.start()
        try:
            assert ready.wait(30), out.read_text() if out.exists() else "the holder did not start"
            cache = ds.source.node_cache
            assert cache.used_bytes() == limit
            reader = ds.source.reader(want)
            sample = reader.read(0)  # waits for space: A's idle readers must give way (else: RemoteError at 8 s)
            assert _same(sample, _expected(served, want, 0))
            assert cache.used_bytes() <= limit
            reader.close()
        finally:
            go.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        assert out.read_text() == "ok"  # A read its shards again (downloaded again where evicted), right data
        assert srv.counts.get(f"/ds/shard-{want:06d}.tar") == 1
        assert cache.used_bytes() <= limit


def test_only_idle_readers_are_released(served, tmp_path):
    manifest = Manifest.load(served / "ds")
    with LoopbackServer(served, ranges=False, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc",
                                         max_bytes=3 * max(s.bytes for s in manifest.shards), prefetch=0),
                            decode=False)
        cache = ds.source.node_cache
        reader = ds.source.reader(0)
        assert _same(reader.read(0), _expected(served, 0, 0))
        t = time.monotonic()
        assert not reader.release_if_idle(t, 5.0)  # first look at its read count: idle since now
        assert not reader.release_if_idle(t + 1, 5.0)  # idle for 1 s only
        assert _same(reader.read(1), _expected(served, 0, 1))
        assert not reader.release_if_idle(t + 10, 5.0)  # read since: idle since t + 10
        assert not reader.release_if_idle(t + 12, 5.0)
        it = reader.iter_range(2, 4)
        assert _same(next(it), _expected(served, 0, 2))
        assert not reader.release_if_idle(t + 60, 5.0)  # an iter_range is reading it
        assert 0 in cache._use
        assert _same(next(it), _expected(served, 0, 3))
        it.close()
        assert not reader.release_if_idle(t + 61, 5.0)  # the iter_range's end counts as a read
        assert reader.release_if_idle(t + 70, 5.0)
        assert 0 not in cache._use and not cache._readers  # the use lock went with the reader
        assert _same(reader.read(3), _expected(served, 0, 3))  # reopened on its next read
        assert 0 in cache._use and reader in cache._readers
        reader.close()
        assert 0 not in cache._use and not cache._readers


def _all_samples(url: str, cache_dir: Path) -> dict:
    ds = ShardedDataset(RemoteShards(url, cache_dir=cache_dir, prefetch=0), decode=False)
    return {s["__key__"]: bytes(s["bin"]) for s in ds}


def test_damaged_local_copies_are_replaced_not_trusted(served, tmp_path):
    # The node cache trusted any file under a shard's name (and any sidecar index) for ever: a copy
    # left truncated or empty by a host crash (nothing is fsynced) or by hand failed every later job on
    # the host with "the shard was changed or truncated (rebuild the index)".
    want = {k: v["bin"] for k, v in ((f"k{i:05d}", _expected(served, i // 4, i % 4)) for i in range(24))}
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
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


def test_signed_folder_url_keeps_its_query_on_every_url(served, tmp_path):
    # A folder URL with a token in its query (an Azure SAS token, a CDN token) gave
    # ".../ds?sig=abc/manifest.json" (HTTP 404), and ".../manifest.json?sig=abc" read the manifest as
    # each shard ("body ended at byte 1465 of 20480").
    with LoopbackServer(served, ranges=False, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds/?sig=abc&se=1", cache_dir=tmp_path / "nc", prefetch=0),
                            decode=False)
        assert ds.source.node_cache.url(0) == srv.url + "/ds/shard-000000.tar?sig=abc&se=1"
        assert ds.source.names[0] == srv.url + "/ds/shard-000000.tar?sig=***&se=1"  # shown without the token
        assert sorted(s["__key__"] for s in ds) == [f"k{i:05d}" for i in range(24)]
        srv.reset_counts()
        # a new token (and the manifest's own URL) finds the same node-local copies
        again = ShardedDataset(RemoteShards(srv.url + "/ds/manifest.json?sig=new", cache_dir=tmp_path / "nc"),
                               decode=False)
        assert again.source.node_cache.root == ds.source.node_cache.root
        assert again.source.node_cache.url(5) == srv.url + "/ds/shard-000005.tar?sig=new"
        assert len(list(again)) == 24 and not [p for p in srv.counts if p.endswith(".tar")]


def test_cache_dir_that_is_a_file_is_a_remote_error_naming_it(served, tmp_path):
    not_a_dir = tmp_path / "afile"
    not_a_dir.write_text("x")
    with LoopbackServer(served, ranges=False, max_requests=50, lifetime=60) as srv:
        with pytest.raises(RemoteError, match="node cache folder .*afile.*cache_dir") as info:
            ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=not_a_dir), decode=False)
    assert isinstance(info.value, OSError)  # it was a bare NotADirectoryError


def _under_a_size_limit(action, out: Path) -> str:
    """Run ``action()`` in a fork child whose files cannot grow past 4 KB (a full disk); its outcome:
    "done", or the exception's type and message."""

    def child() -> None:
        import resource
        import signal

        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            action()
            out.write_text("done")
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.write_text(f"{type(e).__name__}: {e}")
        finally:
            os._exit(0)

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    return out.read_text()


def test_a_full_disk_names_the_node_cache_folder(served, tmp_path):
    with LoopbackServer(served, ranges=False, max_requests=50, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        msg = _under_a_size_limit(lambda: ds.source.reader(0).read(0), tmp_path / "out.txt")
        assert msg.startswith("NodeCacheError"), msg  # a RemoteError and a CacheError (test_s8_multirank)
        assert str(ds.source.node_cache.root) in msg and "shard-000000.tar" in msg and "free space" in msg, msg
        assert not list((ds.source.node_cache.root / ".tmp").iterdir())  # nothing half-written left


def test_a_prefetch_failure_of_an_abandoned_walk_is_not_raised_by_a_later_one(served, tmp_path):
    # A prefetch that failed (server down for a moment) was remembered for good: the next walk's
    # demand fetch of that shard raised the old error without a request, although the server was back.
    down = {"shard-000001.tar": True}
    fault = lambda path, nth: 503 if down.get(path.rsplit("/", 1)[-1]) else None  # noqa: E731
    with LoopbackServer(served, ranges=False, fault=fault, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=2, retries=1),
                            decode=False)
        cache = ds.source.node_cache
        it = iter(ds)
        next(it)  # reads shard 0 and prefetches shards 1 and 2: shard 1 fails
        deadline = time.monotonic() + 20
        while 1 not in cache._failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in cache._failed
        it.close()  # the walk is abandoned (an early exit)
        down.clear()  # the server is back
        assert sorted(s["__key__"] for s in ds) == [f"k{i:05d}" for i in range(24)]
        assert srv.counts["/ds/shard-000001.tar"] == 2


def test_an_old_prefetch_failure_is_retried_by_the_demand_fetch(served, tmp_path, monkeypatch):
    monkeypatch.setattr(_cache, "_FAILED_FRESH_S", 0.0)  # every failure is old by the time it is needed
    down = {"shard-000001.tar": True}
    fault = lambda path, nth: 503 if down.get(path.rsplit("/", 1)[-1]) else None  # noqa: E731
    with LoopbackServer(served, ranges=False, fault=fault, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=2, retries=1),
                            decode=False)
        cache = ds.source.node_cache
        it = iter(ds)
        keys = [next(it)["__key__"]]
        deadline = time.monotonic() + 20
        while 1 not in cache._failed and time.monotonic() < deadline:
            time.sleep(0.01)
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
def test_a_dropped_dataset_gives_its_use_locks_back(served, tmp_path):
    # Every remote dataset object let go of kept a descriptor and a use lock per shard it had open for
    # the life of the process: 12 more per dataset here (EMFILE in a sweep or a notebook; with
    # max_bytes, shards pinned in the node cache that nothing could release).
    import gc

    import threading

    releasers = lambda: sum(t.name == "fastdata-nodecache-release" for t in threading.enumerate())  # noqa: E731
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
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


def test_threads_acquiring_and_releasing_one_shard_keep_count(served, tmp_path):
    # ShardCache.release checked and deleted _use[i] without a lock: two threads releasing the same
    # shard raised KeyError (and an acquire between the check and the delete lost track of its lock).
    # The idle-reader thread releases while the process's readers acquire, so this now happens.
    import threading

    with LoopbackServer(served, ranges=False, max_requests=50, lifetime=60) as srv:
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


def test_download_that_cannot_be_written_names_the_destination(served, tmp_path):
    # fastdata.shards.download (a URL SRC of `fastdata shard`) let a local write error out bare:
    # "OSError: [Errno 27] File too large", naming neither the file nor the URL (and not a RemoteError,
    # which the conversion turns into a ConversionError naming SRC).
    from fastdata.io import download

    dest = tmp_path / "copy.tar"
    with LoopbackServer(served, ranges=False, max_requests=50, lifetime=60) as srv:
        msg = _under_a_size_limit(lambda: download(srv.url + "/ds/shard-000000.tar", dest), tmp_path / "out.txt")
    assert msg.startswith("RemoteError") and str(dest) in msg and "shard-000000.tar" in msg, msg
    assert not list(tmp_path.glob("copy.tar*"))  # nothing half-written left
