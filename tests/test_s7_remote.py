"""Remote shards and the node-local cache (session 7): signed URLs (their tokens stay out of messages,
and a rotated token keeps the dataset's identity), the prefetch threads around fork."""
from __future__ import annotations

import logging
import os
import sys
import traceback

import pytest

from tests.helpers.loopback_server import LoopbackServer, make_shard_set

from fastdata.dataset import RemoteShards, ShardedDataset
from fastdata.errors import FastdataError
from fastdata.io import RetryPolicy, read_bytes, redact_url

pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")

SECRET = "SeCrEtSiGnAtUrE0123456789"
TOKEN = f"sv=2021-08-06&se=2030-01-01T00%3A00Z&sp=r&sig={SECRET}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    make_shard_set(root / "ds", 16, 4, payload=500, seed=1)  # 4 shards
    return root


def _shown(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))  # the message and every cause a traceback prints


def test_redact_url_hides_query_values_and_passwords_keeps_the_path():
    assert redact_url(f"https://acct.blob.core.windows.net/c/ds/shard-000001.tar?{TOKEN}") == \
        "https://acct.blob.core.windows.net/c/ds/shard-000001.tar?sv=2021-08-06&se=2030-01-01T00%3A00Z&sp=r&sig=***"
    s3 = "https://b.s3.amazonaws.com/a.tar?X-Amz-Credential=AKIA%2F1&X-Amz-Expires=60&X-Amz-Signature=f0"
    assert redact_url(s3) == \
        "https://b.s3.amazonaws.com/a.tar?X-Amz-Credential=***&X-Amz-Expires=60&X-Amz-Signature=***"
    assert redact_url("https://user:pw@h:8080/ds/a.tar") == "https://user:***@h:8080/ds/a.tar"
    assert redact_url("https://h/a.tar?tokenonly#frag") == "https://h/a.tar?***#***"
    assert redact_url("s3://bucket/ds/a.tar") == "s3://bucket/ds/a.tar"


def test_signed_url_tokens_stay_out_of_errors_names_and_logs(served, tmp_path, caplog):
    # Azure SAS / presigned / CDN-token URLs: every RemoteError, Source.names (the shard names in the
    # dataset's errors), RemoteShards' repr and the debug log showed the signature in full.
    def fault(path: str, nth: int):
        return {"/ds/shard-000000.tar": 404, "/ds/shard-000001.tar": 500, "/ds/shard-000002.tar": "corrupt",
                "/ds/shard-000003.tar": "drop"}.get(path)

    caplog.set_level(logging.DEBUG, logger="fastdata")
    with LoopbackServer(served, ranges=False, fault=fault, max_requests=300, lifetime=60) as srv:
        spec = RemoteShards(f"{srv.url}/ds?{TOKEN}", cache_dir=tmp_path / "nc", retries=1, prefetch=1)
        assert SECRET not in repr(spec)
        ds = ShardedDataset(spec, decode=False)
        assert ds.source.names[1] == f"{srv.url}/ds/shard-000001.tar?sv=2021-08-06&se=2030-01-01T00%3A00Z&sp=r&sig=***"
        ds.source.node_cache.plan([3, 2, 1, 0], {}, 0.0)  # prefetch (its failures are logged)
        for s in range(4):
            with pytest.raises(FastdataError) as info:
                ds.source.reader(s).read(0)
            assert f"shard-{s:06d}.tar" in str(info.value) and SECRET not in _shown(info.value), _shown(info.value)
        stream = ShardedDataset([f"{srv.url}/ds/shard-{s:06d}.tar?{TOKEN}" for s in range(4)], decode=False)
        assert not any(SECRET in n for n in stream.source.names)
        with pytest.raises(FastdataError) as info:
            list(stream)
        assert "shard-000000.tar" in str(info.value) and SECRET not in _shown(info.value)
        with pytest.raises(FastdataError) as info:  # the standard library quotes the query in its own error
            read_bytes(f"{srv.url}/ds/a b.tar?{TOKEN}", retry=RetryPolicy(1))
        assert "a b.tar" in str(info.value) and SECRET not in _shown(info.value)
    assert caplog.records and not [r for r in caplog.records if SECRET in r.getMessage()]


def test_a_signed_tar_url_streams_gzipped_or_not(served, tmp_path):
    # One signed tar URL given as a string was taken for a folder URL (".../shard-000000.tar/manifest.json?sig=..."
    # HTTP 404), and a signed .tar.gz URL was read as a plain tar ("truncated tar: header at byte offset 0").
    import gzip
    import shutil

    www = tmp_path / "www"
    shutil.copytree(served / "ds", www / "ds")
    with open(www / "ds" / "shard-000001.tar", "rb") as f, gzip.open(www / "ds" / "one.tar.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    with LoopbackServer(www, ranges=False, max_requests=50, lifetime=60) as srv:
        plain = ShardedDataset(f"{srv.url}/ds/shard-000000.tar?{TOKEN}", decode=False)
        assert plain.source.streaming and [s["__key__"] for s in plain] == [f"k{i:05d}" for i in range(4)]
        gz = ShardedDataset([f"{srv.url}/ds/one.tar.gz?{TOKEN}"], decode=False)
        assert [s["__key__"] for s in gz] == [f"k{i:05d}" for i in range(4, 8)]


def test_a_rotated_token_resumes_a_streaming_dataset_another_dataset_does_not(served):
    # Signed URLs expire: the restarted job gets new tokens. The fingerprint of a URL list hashed the tokens,
    # so load_state_dict refused the checkpoint ("fingerprint='urls:...' in the state, ... here").
    def urls(base: str, token: str, shards=(0, 1, 2, 3), extra: str = "") -> list[str]:
        return [f"{base}/ds/shard-{s:06d}.tar?{extra}{token}" for s in shards]

    with LoopbackServer(served, ranges=False, max_requests=100, lifetime=60) as srv:
        first = ShardedDataset(urls(srv.url, TOKEN), decode=False)
        it = iter(first)
        seen = [next(it)["__key__"] for _ in range(6)]
        state = first.state_dict()
        rotated = TOKEN.replace(SECRET, "AnOtHeRsIgNaTuRe987654321").replace("2030", "2031")
        again = ShardedDataset(urls(srv.url, rotated), decode=False)
        again.load_state_dict(state)
        rest = [s["__key__"] for s in again]
        assert sorted(seen + rest) == [f"k{i:05d}" for i in range(16)] and not set(seen) & set(rest)
        for other in (urls(srv.url, rotated, shards=(0, 1, 3, 2)), urls(srv.url, rotated, shards=(0, 1, 2)),
                      urls(srv.url, TOKEN, extra="versionId=2&")):
            with pytest.raises(ValueError, match="fingerprint"):
                ShardedDataset(other, decode=False).load_state_dict(state)


def test_a_rotated_token_keeps_a_remote_manifests_identity(served, tmp_path):
    # A folder URL's identity is its manifest's content (resume states, preprocessing-cache keys) and its
    # node-cache folder is the URL's path plus that content: neither depends on the token.
    import shutil

    www = tmp_path / "www"
    shutil.copytree(served / "ds", www / "ds")
    make_shard_set(www / "other", 16, 4, payload=500, seed=2)
    with LoopbackServer(www, ranges=False, max_requests=50, lifetime=60) as srv:
        def source(path: str, token: str):
            return ShardedDataset(RemoteShards(f"{srv.url}/{path}?{token}", cache_dir=tmp_path / "nc", prefetch=0),
                                  decode=False).source

        a, b = source("ds", TOKEN), source("ds", TOKEN.replace(SECRET, "RoTaTeD0123456789"))
        assert a.fingerprint == b.fingerprint and a.node_cache.root == b.node_cache.root
        c = source("other", TOKEN)
        assert c.fingerprint != a.fingerprint and c.node_cache.root != a.node_cache.root


def test_no_prefetch_thread_runs_while_the_process_forks(served, tmp_path, monkeypatch):
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

    with LoopbackServer(served, ranges=False, fault=slow, max_requests=100, lifetime=60) as srv:
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


def test_a_url_with_user_and_password_is_read_with_basic_auth(served, tmp_path):
    # https://user:password@host/... (a private mirror): the standard-library client sent the user info to
    # DNS as part of the host name ("Name or service not known", retried 5 times); fsspec's client takes
    # it as basic auth. The password also named a new node-cache folder whenever it changed.
    with LoopbackServer(served, ranges=False, max_requests=100, lifetime=60) as srv:
        def url(password: str) -> str:
            return srv.url.replace("http://", f"http://reader:{password}@") + "/ds"

        assert read_bytes(url("pw%2F1") + "/manifest.json", retry=RetryPolicy(1)).startswith(b"{")
        a = ShardedDataset(RemoteShards(url("pw%2F1"), cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        assert len(list(a)) == 16 and "pw%2F1" not in " ".join(a.source.names)
        b = ShardedDataset(RemoteShards(url("new"), cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        assert b.source.node_cache.root == a.source.node_cache.root
        stream = ShardedDataset([url("pw") + "/shard-000000.tar"], decode=False)
        assert len(list(stream)) == 4


def test_node_cache_dir_expands_the_home_folder_and_survives_a_chdir(served, tmp_path, monkeypatch):
    # cache_dir="~/..." (and $FASTDATA_NODE_CACHE="~/...", as a quoted value leaves it) made a folder named "~"
    # in the working directory, and a relative cache_dir moved with os.chdir (shards downloaded again into
    # the new place); the preprocessing cache (Cache(directory)) expands "~" and resolves the path already.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with LoopbackServer(served, ranges=False, max_requests=100, lifetime=60) as srv:
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


def test_shard_names_that_need_quoting_in_a_url(served, tmp_path):
    # A manifest naming "part 1.tar" or "a#b.tar" (legal names): the standard-library client refused the
    # space ("URL can't contain control characters"), and "#" cut the URL short (HTTP 404).
    import json
    import shutil

    ds = tmp_path / "www" / "ds"
    shutil.copytree(served / "ds", ds)
    doc = json.loads((ds / "manifest.json").read_text())
    for shard, new in zip(doc["shards"], ["part 1.tar", "a#b.tar", "50%+x.tar", "sub dir/c?d.tar"]):
        (ds / new).parent.mkdir(exist_ok=True)
        (ds / shard["name"]).rename(ds / new)
        (ds / shard["index"]).rename(ds / (new + ".idx"))
        shard["name"], shard["index"] = new, new + ".idx"
    (ds / "manifest.json").write_text(json.dumps(doc))
    with LoopbackServer(tmp_path / "www", ranges=False, max_requests=100, lifetime=60) as srv:
        got = ShardedDataset(RemoteShards(f"{srv.url}/ds?{TOKEN}", cache_dir=tmp_path / "nc", prefetch=1),
                             decode=False)
        assert sorted(s["__key__"] for s in got) == [f"k{i:05d}" for i in range(16)]
        assert "/ds/part%201.tar?" in got.source.names[0]
        from fastdata.shards.reader import verify

        assert verify(f"{srv.url}/ds?{TOKEN}") == []


def test_remote_shards_are_checked_against_the_manifest_as_local_ones(served, tmp_path):
    # A manifest that does not list a field its shards hold: the folder refused it (ShardError naming the shard
    # and the field), the same folder over HTTP delivered the unlisted field without a word.
    import json
    import shutil

    ds = tmp_path / "www" / "ds"
    shutil.copytree(served / "ds", ds)
    doc = json.loads((ds / "manifest.json").read_text())
    doc["fields"] = [f for f in doc["fields"] if f["name"] != "bin"]
    (ds / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(FastdataError, match=r"holds fields \['bin'\] that the manifest does not list"):
        list(ShardedDataset(ds, decode=False))
    with LoopbackServer(tmp_path / "www", ranges=False, max_requests=100, lifetime=60) as srv:
        remote = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        with pytest.raises(FastdataError, match=r"holds fields \['bin'\] that the manifest does not list"):
            list(remote)


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


def test_fastdata_cache_build_of_a_signed_url_keeps_the_token_out_of_its_error(served, tmp_path, capsys,
                                                                               monkeypatch):
    from fastdata.cli._main import main

    monkeypatch.setenv("FASTDATA_NODE_CACHE", str(tmp_path / "nc"))
    with LoopbackServer(served, ranges=False, max_requests=50, lifetime=60) as srv:
        code = main(["cache", "build", f"{srv.url}/ds?{TOKEN}", "--cache", str(tmp_path / "c"), "--size", "8", "-q"])
    err = capsys.readouterr().err
    assert code != 0 and "no image field" in err and "/ds?" in err and SECRET not in err, err


def test_an_empty_remote_dataset_is_a_source_error_naming_its_url(tmp_path):
    # A local folder said "<folder>/manifest.json: the dataset has no samples"; the same folder over HTTP
    # gave a bare ValueError naming nothing ("the dataset has no samples (every shard is empty)").
    from fastdata.errors import SourceError
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "www" / "ds", max_samples=4):
        pass
    with LoopbackServer(tmp_path / "www", ranges=False, max_requests=20, lifetime=60) as srv:
        with pytest.raises(SourceError, match=r"/ds/manifest\.json\?sv=.*sig=\*\*\*: the dataset has no samples"):
            ShardedDataset(RemoteShards(f"{srv.url}/ds?{TOKEN}", cache_dir=tmp_path / "nc"))


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
