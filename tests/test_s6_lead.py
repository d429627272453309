"""Session 6, lead: defects found beside the helpers' areas (each test failed on the code before its fix)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from loopback_server import LoopbackServer, make_shard_set  # noqa: E402


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
