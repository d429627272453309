"""Node-local cache: processes that wait for each other's space are told so within seconds (not after 120 s),
processes that are merely slow are not, and a killed downloader's reservation does not block the limit."""
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

pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    make_shard_set(root / "ds", 24, 4, payload=2000, seed=1)  # 6 shards of ~8 KB
    return root


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


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_processes_waiting_for_each_others_space_fail_fast(served, tmp_path, method):
    # each process holds one shard; the limit holds exactly those two: neither can fetch a third
    manifest = Manifest.load(served / "ds")
    limit = manifest.shards[0].bytes + manifest.shards[1].bytes
    with LoopbackServer(served, ranges=False, max_requests=200, lifetime=60) as srv:
        cache = _node_cache(srv.url + "/ds", tmp_path / "nc", limit)
        ctx = mp.get_context(method)
        barrier = ctx.Barrier(2)
        outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
        t0 = time.monotonic()
        codes = _run(ctx, [(_hold_then_fetch, (cache, 0, 2, barrier, outs[0])),
                           (_hold_then_fetch, (cache, 1, 3, barrier, outs[1]))])
        assert codes == [0, 0]
        took = time.monotonic() - t0
    for out, shard in zip(outs, ("shard-000002.tar", "shard-000003.tar")):
        msg = out.read_text()
        assert msg.startswith("RemoteError"), msg
        assert str(cache.root) in msg and f"max_bytes={limit}" in msg and shard in msg, msg
        assert "2 processes" in msg and "2 shards open" in msg and "all waiting for space" in msg, msg
        assert "raise max_bytes" in msg and "open_shards" in msg and "num_workers" in msg, msg
    assert took < 30, took  # a hang guard: the 120 s no-progress limit was the only way out before


def test_slow_holder_is_not_mistaken_for_a_deadlock(served, tmp_path):
    manifest = Manifest.load(served / "ds")
    limit = manifest.shards[0].bytes + manifest.shards[1].bytes
    with LoopbackServer(served, ranges=False, max_requests=200, lifetime=60) as srv:
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


def test_killed_downloaders_reservation_does_not_block_the_limit(served, tmp_path):
    manifest = Manifest.load(served / "ds")
    limit = manifest.shards[0].bytes + manifest.shards[1].bytes
    with LoopbackServer(served, ranges=False, max_requests=200, lifetime=60) as srv:
        cache = _node_cache(srv.url + "/ds", tmp_path / "nc", limit)
        cache.acquire(0)
        # a downloader of shard 5 was killed: its reservation fills the rest of the limit
        stale = cache.root / ".tmp" / f"5-{manifest.shards[5].bytes}-999999-dead.part"
        stale.write_bytes(b"partial")
        t0 = time.monotonic()
        assert cache.acquire(1).is_file()
        assert time.monotonic() - t0 < 30 and not stale.exists()  # a hang guard (the no-progress limit: 120 s)
        cache.close()
