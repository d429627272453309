"""Session 6, lead: defects found beside the helpers' areas (each test failed on the code before its fix)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers.loopback_server import LoopbackServer, make_shard_set  # noqa: E402


@pytest.mark.parametrize("suffix", ["/ds?sig=abc", "/ds/?sig=abc", "/ds/manifest.json?sig=abc", "/ds/manifest.json"])
def test_manifest_and_verify_of_a_signed_manifest_url(tmp_path: Path, suffix: str) -> None:
    """A signed URL of the manifest itself (``.../ds/manifest.json?sig=...``) names the same folder as the
    signed folder URL: it fetched ``.../manifest.json/manifest.json?sig=...`` (HTTP 404)."""
    from fastdata.shards.reader import load_manifest, verify_remote_shard

    make_shard_set(tmp_path / "www" / "ds", 8, 4, payload=64, seed=1)
    with LoopbackServer(tmp_path / "www", ranges=False) as srv:
        url = srv.url + suffix
        m = load_manifest(url)
        assert len(m.shards) == 2
        assert verify_remote_shard(url, m, m.shards[0]) == []


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
