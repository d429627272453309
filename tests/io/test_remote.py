"""Remote shard sets over a real loopback HTTP server (127.0.0.1 only) and moto's S3 server.

Remote manifests read through the node cache (byte-identical to the local read), Range-free
streaming of shards larger than fsspec's 5 MiB block, retries on drops, 500/503 and TLS errors,
clear errors (status, URL, reason), conversion to and verification of URLs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastdata.dataset import RemoteShards, ShardedDataset
from fastdata.errors import FastdataError, RemoteError
from fastdata.io import RemoteStream, RetryPolicy, read_bytes
from fastdata.loader import DataLoader
from tests.helpers.loopback_server import LoopbackServer, make_shard_set
from tests.helpers.remote import under_a_size_limit


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning",
                                        "ignore:Unclosed:ResourceWarning")


FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)


def make_set(dest: Path, n: int, per_shard: int, payload: int = 200) -> Path:
    return make_shard_set(dest, n, per_shard, payload=payload, seed=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    make_set(root / "ds", 40, 6)
    # one 7 MiB shard (> fsspec's 5 MiB block) for Range-free streaming
    make_set(root / "big", 7, 7, payload=1 << 20)
    return root


def _remote(url: str, tmp_path: Path, **kw) -> RemoteShards:
    kw.setdefault("retries", 4)
    return RemoteShards(url, cache_dir=tmp_path / "nodecache", **kw)


def test_remote_manifest_epoch_equals_local(served, tmp_path):
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
        remote = ShardedDataset(_remote(srv.url + "/ds", tmp_path), shuffle=True, seed=3, decode=False)
        local = ShardedDataset(served / "ds", shuffle=True, seed=3, decode=False)
        assert remote.source.fingerprint == local.source.fingerprint  # same content, same caches
        assert list(remote) == list(local)
        shard_gets = {p: c for p, c in srv.counts.items() if p.endswith(".tar")}
        assert len(shard_gets) == 7 and set(shard_gets.values()) == {1}


def test_range_free_streaming_of_a_large_shard(served):
    url_path = "/big/shard-000000.tar"
    assert (served / url_path.lstrip("/")).stat().st_size > 5 << 20
    with LoopbackServer(served, ranges=False, max_requests=50, lifetime=60) as srv:
        got = list(ShardedDataset(srv.url + url_path, decode=False))
        want = list(ShardedDataset(served / "big", decode=False))
        assert got == want and len(got) == 7


def test_streaming_resumes_after_dropped_connections(served):
    url_path = "/big/shard-000000.tar"
    drops = {1, 2}  # the first two GETs are cut in the middle of the body
    with LoopbackServer(served, ranges=False, fault=lambda p, n: "drop" if n in drops else None,
                        max_requests=50, lifetime=60) as srv:
        with RemoteStream(srv.url + url_path, retry=FAST) as s:
            data = s.read()
        assert data == (served / url_path.lstrip("/")).read_bytes()
        assert srv.counts[url_path] == 3 and srv.faults == 2


@pytest.mark.parametrize("status", [500, 503])
def test_transient_status_retried_then_served(served, tmp_path, status):
    fault = lambda p, n: status if n <= 2 else None  # noqa: E731
    with LoopbackServer(served, ranges=False, fault=fault, max_requests=500, lifetime=60) as srv:
        ds = ShardedDataset(_remote(srv.url + "/ds", tmp_path, retries=4), decode=False)
        ds.source.node_cache.retry = FAST
        assert [s["cls"] for s in ds] == [str(i).encode() for i in range(40)]
        assert srv.faults > 0


def test_error_after_last_retry_names_url_and_status(served, tmp_path):
    with LoopbackServer(served, ranges=False, fault=lambda p, n: 503 if p.endswith("000002.tar") else None,
                        max_requests=500, lifetime=60) as srv:
        ds = ShardedDataset(_remote(srv.url + "/ds", tmp_path, retries=3), decode=False)
        ds.source.node_cache.retry = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
        with pytest.raises(RemoteError) as info:
            list(ds)
        msg = str(info.value)
        assert srv.url + "/ds/shard-000002.tar" in msg and "HTTP 503" in msg and "after 3 attempts" in msg
        assert srv.counts["/ds/shard-000002.tar"] == 3


def test_permanent_errors_not_retried(served):
    with LoopbackServer(served, ranges=False, fault=lambda p, n: 403 if "forbidden" in p else None,
                        max_requests=100, lifetime=60) as srv:
        with pytest.raises(RemoteError, match=r"HTTP 403") as info:
            read_bytes(srv.url + "/forbidden/manifest.json", retry=FAST)
        assert srv.url + "/forbidden/manifest.json" in str(info.value)
        with pytest.raises(RemoteError, match="not found") as info:
            ShardedDataset(srv.url + "/nowhere", decode=False)
        assert srv.url + "/nowhere/manifest.json" in str(info.value)
        assert srv.counts["/forbidden/manifest.json"] == 1  # no retries


def test_streaming_error_keeps_reason(served):
    with LoopbackServer(served, ranges=False, fault=lambda p, n: 500, max_requests=100, lifetime=60) as srv:
        os.environ["FASTDATA_REMOTE_RETRIES"] = "2"
        try:
            with pytest.raises(RemoteError) as info:
                list(ShardedDataset(srv.url + "/ds/shard-000000.tar", decode=False))
        finally:
            del os.environ["FASTDATA_REMOTE_RETRIES"]
        assert "HTTP 500" in str(info.value) and srv.url + "/ds/shard-000000.tar" in str(info.value)


@pytest.mark.filterwarnings("ignore:a streaming \\(URL\\) source:UserWarning")  # unequal ranks: not the point here
def test_streaming_urls_exactly_once_over_ranks_and_workers(served):
    urls = [f"{{}}/ds/shard-{i:06d}.tar" for i in range(7)]
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
        seen = []
        for rank in range(2):
            ds = ShardedDataset([u.format(srv.url) for u in urls], decode=False, rank=rank, world_size=2)
            for b in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda xs: xs):
                seen += [s["cls"] for s in b]
        assert sorted(int(c) for c in seen) == list(range(40))


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server on 127.0.0.1 with fsspec configured for it; yields the s3fs filesystem."""
    moto_server = pytest.importorskip("moto.server")
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")

    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    try:
        host, port = srv.get_host_and_port()
        assert host == "127.0.0.1"
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(k, "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{port}",
                                                       "key": "testing", "secret": "testing"})
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST"),
                               timeout=10).close()  # moto keeps buckets in this process between servers
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bucket")
        yield fs
    finally:
        srv.stop()
        fsspec.filesystem("s3").invalidate_cache()


def test_s3_through_moto_server(served, tmp_path, s3):
    fs = s3
    if True:
        fs.put(str(served / "ds"), "s3://bucket/ds", recursive=True)
        fs.invalidate_cache()
        ds = ShardedDataset(_remote("s3://bucket/ds", tmp_path), shuffle=True, seed=1, decode=False)
        assert list(ds) == list(ShardedDataset(served / "ds", shuffle=True, seed=1, decode=False))
        streamed = list(ShardedDataset("s3://bucket/ds/shard-000001.tar", decode=False))
        assert [s["cls"] for s in streamed] == [str(i).encode() for i in range(6, 12)]
        with pytest.raises(RemoteError, match="not found") as info:
            ShardedDataset(_remote("s3://bucket/missing", tmp_path))
        assert "s3://bucket/missing/manifest.json" in str(info.value)


def test_convert_to_s3_url_and_verify_url(tmp_path, s3):
    from fastdata.cli._shard_cmd import verify_folder
    from fastdata.shards.convert import ConvertOptions, convert
    from fastdata.shards.reader import verify

    src = make_set(tmp_path / "src", 20, 20)
    local = convert(src, tmp_path / "local", ConvertOptions(samples_per_shard=6, workers=1))
    staging = tmp_path / "staging"
    result = convert(src, "s3://bucket/out", ConvertOptions(samples_per_shard=6, workers=1, staging=str(staging)))
    assert result.written == 4 and not staging.exists()  # staging removed after the manifest went up
    for name in ["manifest.json"] + [s.name for s in local.manifest.shards]:
        assert s3.cat_file(f"bucket/out/{name}") == (tmp_path / "local" / name).read_bytes(), name
    assert convert(src, "s3://bucket/out", ConvertOptions(samples_per_shard=6)).complete
    assert verify("s3://bucket/out") == [] and verify_folder("s3://bucket/out", workers=2, progress=False) == []
    ds = ShardedDataset(_remote("s3://bucket/out", tmp_path), decode=False)
    assert [s["cls"] for s in ds] == [str(i).encode() for i in range(20)]
    # a damaged object and a missing one are reported by name
    s3.pipe_file("bucket/out/shard-000001.tar", b"x" * local.manifest.shards[1].bytes)
    s3.rm_file("bucket/out/shard-000002.tar")
    problems = verify("s3://bucket/out")
    assert any("shard-000001.tar: sha256 mismatch" in p for p in problems), problems
    assert any("shard-000002.tar: shard file is missing" in p for p in problems), problems
    with pytest.raises(Exception, match="different arguments"):
        convert(src, "s3://bucket/out", ConvertOptions(samples_per_shard=5, staging=str(staging)))


def test_interrupted_upload_resumes(tmp_path, s3, monkeypatch):
    from fastdata.shards import _progress
    from fastdata.shards.convert import ConvertOptions, convert

    src = make_set(tmp_path / "src", 20, 20)
    opts = ConvertOptions(samples_per_shard=6, workers=1, staging=str(tmp_path / "staging"))
    real, calls = _progress.ProgressState.record, []

    def record_then_stop(self, result):
        real(self, result)
        calls.append(result.number)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(_progress.ProgressState, "record", record_then_stop)
    with pytest.raises(KeyboardInterrupt):
        convert(src, "s3://bucket/again", opts)
    monkeypatch.setattr(_progress.ProgressState, "record", real)
    assert not s3.exists("bucket/again/manifest.json")
    assert not list((tmp_path / "staging").glob("*.tar"))  # uploaded shards are not kept locally
    resumed = convert(src, "s3://bucket/again", opts)
    assert resumed.kept == 2 and resumed.written == 2


def test_verify_over_http_and_http_dest_refused(served, tmp_path):
    from fastdata.shards.convert import ConvertOptions, convert
    from fastdata.shards.reader import verify

    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
        assert verify(srv.url + "/ds") == []
        problems = verify(srv.url + "/nowhere")
        assert len(problems) == 1 and srv.url + "/nowhere/manifest.json" in problems[0]
        with pytest.raises(Exception, match="read-only"):
            convert(served / "ds", srv.url + "/out", ConvertOptions(samples_per_shard=6))


def test_convert_from_url_sources(served, tmp_path):
    pytest.importorskip("aiohttp")  # URL sources are staged through fsspec's HTTP filesystem
    from fastdata.shards.convert import ConvertOptions, convert

    opts = ConvertOptions(samples_per_shard=9, workers=1, staging=str(tmp_path / "staging"))
    with LoopbackServer(served, ranges=False, max_requests=500, lifetime=60) as srv:
        remote = convert(srv.url + "/ds", tmp_path / "from_url", opts)
        single = convert(srv.url + "/ds/shard-000001.tar", tmp_path / "from_tar_url", opts)
    local = convert(served / "ds", tmp_path / "from_local", ConvertOptions(samples_per_shard=9, workers=1))
    assert remote.written == local.written == 5
    assert not (tmp_path / "staging").exists() and not list((tmp_path / "staging-src").glob("**/*.tar"))
    for s in local.manifest.shards:
        assert (tmp_path / "from_url" / s.name).read_bytes() == (tmp_path / "from_local" / s.name).read_bytes()
    assert single.manifest.num_samples == 6


def test_fsspec_http_client_path(served, tmp_path, monkeypatch):
    """FASTDATA_HTTP_CLIENT=fsspec (or an fsspec HTTP configuration) reads through fsspec/aiohttp:
    same data, same error reasons, same retries."""
    pytest.importorskip("aiohttp")
    monkeypatch.setenv("FASTDATA_HTTP_CLIENT", "fsspec")
    fault = lambda p, n: 503 if p.endswith("000003.tar") else ("drop" if n == 1 and p.endswith(".tar") else None)  # noqa: E731
    with LoopbackServer(served, ranges=False, fault=fault, max_requests=500, lifetime=60) as srv:
        ds = ShardedDataset(_remote(srv.url + "/ds", tmp_path, retries=3), decode=False)
        ds.source.node_cache.retry = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
        with pytest.raises(RemoteError) as info:
            list(ds)
        assert "HTTP 503" in str(info.value) and "shard-000003.tar" in str(info.value)
        srv.set_fault(lambda p, n: "drop" if n == 1 else None)
        srv.reset_counts()
        url_path = "/big/shard-000000.tar"
        with RemoteStream(srv.url + url_path, retry=FAST) as s:
            assert s.read() == (served / url_path.lstrip("/")).read_bytes()
        assert srv.counts[url_path] == 2


SECRET = "SeCrEtSiGnAtUrE0123456789"
TOKEN = f"sv=2021-08-06&se=2030-01-01T00%3A00Z&sp=r&sig={SECRET}"


def test_remote_shards_are_checked_against_the_manifest_as_local_ones(served_4_shards, tmp_path):
    # A manifest that does not list a field its shards hold: the folder refused it (ShardError naming the shard
    # and the field), the same folder over HTTP delivered the unlisted field without a word.
    import json
    import shutil

    ds = tmp_path / "www" / "ds"
    shutil.copytree(served_4_shards / "ds", ds)
    doc = json.loads((ds / "manifest.json").read_text())
    doc["fields"] = [f for f in doc["fields"] if f["name"] != "bin"]
    (ds / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(FastdataError, match=r"holds fields \['bin'\] that the manifest does not list"):
        list(ShardedDataset(ds, decode=False))
    with LoopbackServer(tmp_path / "www", ranges=False, max_requests=100, lifetime=60) as srv:
        remote = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        with pytest.raises(FastdataError, match=r"holds fields \['bin'\] that the manifest does not list"):
            list(remote)


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


def test_download_that_cannot_be_written_names_the_destination(served_6_shards, tmp_path):
    # fastdata.shards.download (a URL SRC of `fastdata shard`) let a local write error out bare:
    # "OSError: [Errno 27] File too large", naming neither the file nor the URL (and not a RemoteError,
    # which the conversion turns into a ConversionError naming SRC).
    from fastdata.io import download

    dest = tmp_path / "copy.tar"
    with LoopbackServer(served_6_shards, ranges=False, max_requests=50, lifetime=60) as srv:
        msg = under_a_size_limit(lambda: download(srv.url + "/ds/shard-000000.tar", dest), tmp_path / "out.txt")
    assert msg.startswith("RemoteError") and str(dest) in msg and "shard-000000.tar" in msg, msg
    assert not list(tmp_path.glob("copy.tar*"))  # nothing half-written left


def test_a_tls_error_while_a_body_is_read_is_retried() -> None:
    """An ssl.SSLError raised while reading a body (a cut or garbled TLS record) was not taken for a
    transient failure, so the read failed at once; at connect time (wrapped in a URLError) it was
    retried. A certificate that does not verify is still not retried."""
    import ssl

    from fastdata.io import RetryPolicy, is_transient, with_retries

    calls = []

    def flaky() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
        return b"ok"

    assert with_retries(flaky, "https://h/a.tar", RetryPolicy(attempts=2, base_delay=0.0)) == b"ok"
    assert is_transient(ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC]"))
    assert not is_transient(ssl.SSLCertVerificationError(1, "certificate verify failed"))
