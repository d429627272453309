"""The node cache's space: processes waiting for each other's space fail fast, slow ones are not taken
for deadlocked, idle holders give way, a killed downloader's reservation and a full disk."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from fastdata.dataset import RemoteShards, ShardedDataset
from fastdata.errors import RemoteError
from fastdata.manifest import Manifest
from fastdata.nodecache import _space
from tests.helpers.loopback_server import LoopbackServer
from tests.helpers.remote import expected_sample, under_a_size_limit


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


def _node_cache(url: str, cache_dir: Path, max_bytes: int):
    return ShardedDataset(RemoteShards(url, cache_dir=cache_dir, max_bytes=max_bytes, prefetch=0),
                          decode=False).source.node_cache


def _hold_then_fetch(cache, hold: int, want: int, barrier, out: Path) -> None:
    """Open shard ``hold``, wait for the other process to open its own, then fetch ``want``; stay
    alive (shard ``hold`` open, like a worker that raised) until the other one is done too."""
    cache.acquire(hold)
    barrier.wait(timeout=30)
    t0 = time.monotonic()
    try:
        cache.acquire(want)
        out.write_text(f"ok {time.monotonic() - t0:.2f}")
    except RemoteError as e:
        out.write_text(f"RemoteError {time.monotonic() - t0:.2f} {e}")
    try:
        barrier.wait(timeout=30)
    finally:
        os._exit(0)


def _hold_while_slow(cache, hold: int, barrier, out: Path) -> None:
    cache.acquire(hold)
    barrier.wait(timeout=30)
    time.sleep(2.0)  # reading slowly: not waiting for space
    cache.release(hold)
    out.write_text("released")
    try:
        barrier.wait(timeout=30)
    finally:
        os._exit(0)


def _run(ctx, targets) -> list:
    procs = [ctx.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 40
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    assert not alive, "the processes still waited for each other after 40 s"
    return [p.exitcode for p in procs]


# A hang guard for the fail-fast tests below: with the no-progress limit patched away (fork children inherit
# it) a fetch that does not fail fast waits until this timeout fails the test; the messages checked tell the
# fail-fast errors from the no-progress one
_NO_STALL_LIMIT = float("inf")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_processes_waiting_for_each_others_space_fail_fast(served_6_shards, tmp_path, method, monkeypatch):
    # each process holds one shard; the limit holds exactly those two: neither can fetch a third
    monkeypatch.setattr(_space, "_STALL_S", _NO_STALL_LIMIT)
    manifest = Manifest.load(served_6_shards / "ds")
    limit = manifest.shards[0].bytes + manifest.shards[1].bytes
    with LoopbackServer(served_6_shards, ranges=False, max_requests=200, lifetime=60) as srv:
        cache = _node_cache(srv.url + "/ds", tmp_path / "nc", limit)
        ctx = mp.get_context(method)
        barrier = ctx.Barrier(2)
        outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
        codes = _run(ctx, [(_hold_then_fetch, (cache, 0, 2, barrier, outs[0])),
                           (_hold_then_fetch, (cache, 1, 3, barrier, outs[1]))])
        assert codes == [0, 0]
    for out, shard in zip(outs, ("shard-000002.tar", "shard-000003.tar")):
        msg = out.read_text()
        assert msg.startswith("RemoteError"), msg
        assert str(cache.root) in msg and f"max_bytes={limit}" in msg and shard in msg, msg
        assert "2 processes" in msg and "2 shards open" in msg and "all waiting for space" in msg, msg
        assert "raise max_bytes" in msg and "open_shards" in msg and "num_workers" in msg, msg


def test_slow_holder_is_not_mistaken_for_a_deadlock(served_6_shards, tmp_path):
    manifest = Manifest.load(served_6_shards / "ds")
    limit = manifest.shards[0].bytes + manifest.shards[1].bytes
    with LoopbackServer(served_6_shards, ranges=False, max_requests=200, lifetime=60) as srv:
        cache = _node_cache(srv.url + "/ds", tmp_path / "nc", limit)
        ctx = mp.get_context("fork")
        barrier = ctx.Barrier(2)
        outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
        codes = _run(ctx, [(_hold_while_slow, (cache, 0, barrier, outs[0])),
                           (_hold_then_fetch, (cache, 1, 2, barrier, outs[1]))])
        assert codes == [0, 0]
    assert outs[0].read_text() == "released"
    msg = outs[1].read_text()
    assert msg.startswith("ok"), msg  # waited for the slow reader (about 2 s), no false alarm
    assert float(msg.split()[1]) >= 1.0, msg


@pytest.mark.timeout(120)
def test_killed_downloaders_reservation_does_not_block_the_limit(served_6_shards, tmp_path, monkeypatch):
    monkeypatch.setattr(_space, "_STALL_S", _NO_STALL_LIMIT)  # a reservation still counted: hangs (see above)
    manifest = Manifest.load(served_6_shards / "ds")
    limit = manifest.shards[0].bytes + manifest.shards[1].bytes
    with LoopbackServer(served_6_shards, ranges=False, max_requests=200, lifetime=60) as srv:
        cache = _node_cache(srv.url + "/ds", tmp_path / "nc", limit)
        cache.acquire(0)
        # a downloader of shard 5 was killed: its reservation fills the rest of the limit
        stale = cache.root / ".tmp" / f"5-{manifest.shards[5].bytes}-999999-dead.part"
        stale.write_bytes(b"partial")
        assert cache.acquire(1).is_file()
        assert not stale.exists()
        cache.close()


def _same(got: dict, want: dict) -> bool:
    return {k: bytes(v) if not isinstance(v, str) else v for k, v in got.items()} == want


def _parked_holder(source, shards, ready, go, out: Path, served_6_shards: Path) -> None:
    """Read a sample of each shard (their readers stay open, holding the cache), then sit idle until
    ``go`` like a DataLoader worker waiting for its next index; then read the next sample of each."""
    try:
        readers = [source.reader(s) for s in shards]
        ok = all(_same(r.read(0), expected_sample(served_6_shards, s, 0)) for r, s in zip(readers, shards))
        ready.set()
        if not go.wait(30):
            out.write_text("never resumed")
            return
        ok = ok and all(_same(r.read(1), expected_sample(served_6_shards, s, 1)) for r, s in zip(readers, shards))
        for r in readers:
            r.close()
        out.write_text("ok" if ok else "wrong data")
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.write_text(f"{type(e).__name__}: {e}")
    finally:
        os._exit(0)


def test_idle_holder_gives_way_to_a_process_waiting_for_space(served_6_shards, tmp_path, monkeypatch):
    # The stall this guards against: process A holds the whole cache through readers it does not read now
    # (parked); process B needs space for another shard; A waits for B (in the loader: the main
    # process waits for B's batch before A gets its next index). Before: B waited until the
    # no-progress limit (120 s; here 8 s) and raised a RemoteError.
    monkeypatch.setattr(_space, "_STALL_S", 8.0)
    manifest = Manifest.load(served_6_shards / "ds")
    held = [0, 1, 2]
    limit = sum(manifest.shards[s].bytes for s in held)
    want = min(range(3, 6), key=lambda s: manifest.shards[s].bytes)
    with LoopbackServer(served_6_shards, ranges=False, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", max_bytes=limit, prefetch=0),
                            decode=False)
        ctx = mp.get_context("fork")
        ready, go = ctx.Event(), ctx.Event()
        out = tmp_path / "a.txt"
        proc = ctx.Process(target=_parked_holder, args=(ds.source, held, ready, go, out, served_6_shards))
        proc.start()
        try:
            assert ready.wait(30), out.read_text() if out.exists() else "the holder did not start"
            cache = ds.source.node_cache
            assert cache.used_bytes() == limit
            reader = ds.source.reader(want)
            sample = reader.read(0)  # waits for space: A's idle readers must give way (else: RemoteError at 8 s)
            assert _same(sample, expected_sample(served_6_shards, want, 0))
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


def test_only_idle_readers_are_released(served_6_shards, tmp_path):
    manifest = Manifest.load(served_6_shards / "ds")
    with LoopbackServer(served_6_shards, ranges=False, max_requests=200, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc",
                                         max_bytes=3 * max(s.bytes for s in manifest.shards), prefetch=0),
                            decode=False)
        cache = ds.source.node_cache
        reader = ds.source.reader(0)
        assert _same(reader.read(0), expected_sample(served_6_shards, 0, 0))
        t = time.monotonic()
        assert not reader.release_if_idle(t, 5.0)  # first look at its read count: idle since now
        assert not reader.release_if_idle(t + 1, 5.0)  # idle for 1 s only
        assert _same(reader.read(1), expected_sample(served_6_shards, 0, 1))
        assert not reader.release_if_idle(t + 10, 5.0)  # read since: idle since t + 10
        assert not reader.release_if_idle(t + 12, 5.0)
        it = reader.iter_range(2, 4)
        assert _same(next(it), expected_sample(served_6_shards, 0, 2))
        assert not reader.release_if_idle(t + 60, 5.0)  # an iter_range is reading it
        assert 0 in cache._use
        assert _same(next(it), expected_sample(served_6_shards, 0, 3))
        it.close()
        assert not reader.release_if_idle(t + 61, 5.0)  # the iter_range's end counts as a read
        assert reader.release_if_idle(t + 70, 5.0)
        assert 0 not in cache._use and not cache._readers  # the use lock went with the reader
        assert _same(reader.read(3), expected_sample(served_6_shards, 0, 3))  # reopened on its next read
        assert 0 in cache._use and reader in cache._readers
        reader.close()
        assert 0 not in cache._use and not cache._readers


def test_a_full_disk_names_the_node_cache_folder(served_6_shards, tmp_path):
    with LoopbackServer(served_6_shards, ranges=False, max_requests=50, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        msg = under_a_size_limit(lambda: ds.source.reader(0).read(0), tmp_path / "out.txt")
        assert msg.startswith("NodeCacheError"), msg  # a RemoteError and a CacheError
        assert str(ds.source.node_cache.root) in msg and "shard-000000.tar" in msg and "free space" in msg, msg
        assert not list((ds.source.node_cache.root / ".tmp").iterdir())  # nothing half-written left


def test_space_accounting_lists_the_folder_not_every_manifest_shard(tmp_path, monkeypatch):
    # Each download with max_bytes (and each 50 ms poll of a process waiting for space) measured the cache under
    # the host-wide space lock with one stat per shard of the manifest, present or not: 0.4 s for 20,000 shards
    # and 2.8 s for 100,000 on this machine, so the host downloaded about one shard per 0.4-2.8 s however fast
    # the network. Now one listing of the folder: the cost follows the shards on disk.
    import json
    import pathlib

    from fastdata.nodecache import ShardCache
    from fastdata.manifest import Manifest

    names = [f"shard-{i:06d}.tar" for i in range(4998)] + ["./sub//one.tar", "sub/last.tar"]
    doc = {"format": "tar", "format_version": 1, "num_samples": len(names), "extra": {},
           "fields": [{"name": "bin", "kind": "bytes", "dtype": None, "shape": None}],
           "shards": [{"name": n, "index": n + ".idx", "bytes": 100, "num_samples": 1, "sha256": "0" * 64}
                      for n in names]}
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    cache = ShardCache("http://127.0.0.1:1/ds", Manifest.load(tmp_path), directory=tmp_path / "nc", max_bytes=10**6)
    for i in (0, 7, 4998, 4999):
        cache.path(i).parent.mkdir(exist_ok=True)
        cache.path(i).write_bytes(b"x" * 100)
    (cache.root / "shard-000007.tar.idx").write_bytes(b"x" * 50)  # not a shard
    stats = []
    real = pathlib.Path.stat
    monkeypatch.setattr(pathlib.Path, "stat", lambda self, *a, **k: stats.append(self) or real(self, *a, **k))
    used, victims = cache._usage(exclude=0)
    assert used == 400 and sorted(victims) == [7, 4998, 4999]
    assert cache.used_bytes() == 400
    assert len(stats) < 50, len(stats)
