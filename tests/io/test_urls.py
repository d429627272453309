"""URLs: signed-URL tokens and passwords stay out of names, messages and logs; a rotated token keeps
a dataset's identity; basic auth; shard names that need quoting."""
from __future__ import annotations

import logging
import traceback
from pathlib import Path

import pytest

from fastdata.cli._main import main
from fastdata.dataset import RemoteShards, ShardedDataset
from fastdata.errors import FastdataError
from fastdata.io import RetryPolicy, read_bytes, redact_url
from fastdata.shards.convert import convert
from tests.helpers.loopback_server import LoopbackServer, make_shard_set
from tests.helpers.sources import opts, synth_folder


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


SECRET = "SeCrEtSiGnAtUrE0123456789"
TOKEN = f"sv=2021-08-06&se=2030-01-01T00%3A00Z&sp=r&sig={SECRET}"


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


def test_signed_url_tokens_stay_out_of_errors_names_and_logs(served_4_shards, tmp_path, caplog):
    # Azure SAS / presigned / CDN-token URLs: every RemoteError, Source.names (the shard names in the
    # dataset's errors), RemoteShards' repr and the debug log showed the signature in full.
    def fault(path: str, nth: int):
        return {"/ds/shard-000000.tar": 404, "/ds/shard-000001.tar": 500, "/ds/shard-000002.tar": "corrupt",
                "/ds/shard-000003.tar": "drop"}.get(path)

    caplog.set_level(logging.DEBUG, logger="fastdata")
    with LoopbackServer(served_4_shards, ranges=False, fault=fault, max_requests=300, lifetime=60) as srv:
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


def test_a_signed_tar_url_streams_gzipped_or_not(served_4_shards, tmp_path):
    # One signed tar URL given as a string was taken for a folder URL (".../shard-000000.tar/manifest.json?sig=..."
    # HTTP 404), and a signed .tar.gz URL was read as a plain tar ("truncated tar: header at byte offset 0").
    import gzip
    import shutil

    www = tmp_path / "www"
    shutil.copytree(served_4_shards / "ds", www / "ds")
    with open(www / "ds" / "shard-000001.tar", "rb") as f, gzip.open(www / "ds" / "one.tar.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    with LoopbackServer(www, ranges=False, max_requests=50, lifetime=60) as srv:
        plain = ShardedDataset(f"{srv.url}/ds/shard-000000.tar?{TOKEN}", decode=False)
        assert plain.source.streaming and [s["__key__"] for s in plain] == [f"k{i:05d}" for i in range(4)]
        gz = ShardedDataset([f"{srv.url}/ds/one.tar.gz?{TOKEN}"], decode=False)
        assert [s["__key__"] for s in gz] == [f"k{i:05d}" for i in range(4, 8)]


def test_a_rotated_token_resumes_a_streaming_dataset_another_dataset_does_not(served_4_shards):
    # Signed URLs expire: the restarted job gets new tokens. The fingerprint of a URL list hashed the tokens,
    # so load_state_dict refused the checkpoint ("fingerprint='urls:...' in the state, ... here").
    def urls(base: str, token: str, shards=(0, 1, 2, 3), extra: str = "") -> list[str]:
        return [f"{base}/ds/shard-{s:06d}.tar?{extra}{token}" for s in shards]

    with LoopbackServer(served_4_shards, ranges=False, max_requests=100, lifetime=60) as srv:
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


def test_a_rotated_token_keeps_a_remote_manifests_identity(served_4_shards, tmp_path):
    # A folder URL's identity is its manifest's content (resume states, preprocessing-cache keys) and its
    # node-cache folder is the URL's path plus that content: neither depends on the token.
    import shutil

    www = tmp_path / "www"
    shutil.copytree(served_4_shards / "ds", www / "ds")
    make_shard_set(www / "other", 16, 4, payload=500, seed=2)
    with LoopbackServer(www, ranges=False, max_requests=50, lifetime=60) as srv:
        def source(path: str, token: str):
            return ShardedDataset(RemoteShards(f"{srv.url}/{path}?{token}", cache_dir=tmp_path / "nc", prefetch=0),
                                  decode=False).source

        a, b = source("ds", TOKEN), source("ds", TOKEN.replace(SECRET, "RoTaTeD0123456789"))
        assert a.fingerprint == b.fingerprint and a.node_cache.root == b.node_cache.root
        c = source("other", TOKEN)
        assert c.fingerprint != a.fingerprint and c.node_cache.root != a.node_cache.root


def test_a_url_with_user_and_password_is_read_with_basic_auth(served_4_shards, tmp_path):
    # https://user:password@host/... (a private mirror): the standard-library client sent the user info to
    # DNS as part of the host name ("Name or service not known", retried 5 times); fsspec's client takes
    # it as basic auth. The password also named a new node-cache folder whenever it changed.
    with LoopbackServer(served_4_shards, ranges=False, max_requests=100, lifetime=60) as srv:
        def url(password: str) -> str:
            return srv.url.replace("http://", f"http://reader:{password}@") + "/ds"

        assert read_bytes(url("pw%2F1") + "/manifest.json", retry=RetryPolicy(1)).startswith(b"{")
        a = ShardedDataset(RemoteShards(url("pw%2F1"), cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        assert len(list(a)) == 16 and "pw%2F1" not in " ".join(a.source.names)
        b = ShardedDataset(RemoteShards(url("new"), cache_dir=tmp_path / "nc", prefetch=0), decode=False)
        assert b.source.node_cache.root == a.source.node_cache.root
        stream = ShardedDataset([url("pw") + "/shard-000000.tar"], decode=False)
        assert len(list(stream)) == 4


def test_shard_names_that_need_quoting_in_a_url(served_4_shards, tmp_path):
    # A manifest naming "part 1.tar" or "a#b.tar" (legal names): the standard-library client refused the
    # space ("URL can't contain control characters"), and "#" cut the URL short (HTTP 404).
    import json
    import shutil

    ds = tmp_path / "www" / "ds"
    shutil.copytree(served_4_shards / "ds", ds)
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


def test_fastdata_cache_build_of_a_signed_url_keeps_the_token_out_of_its_error(served_4_shards, tmp_path, capsys,
                                                                               monkeypatch):
    from fastdata.cli._main import main

    monkeypatch.setenv("FASTDATA_NODE_CACHE", str(tmp_path / "nc"))
    with LoopbackServer(served_4_shards, ranges=False, max_requests=50, lifetime=60) as srv:
        code = main(["cache", "build", f"{srv.url}/ds?{TOKEN}", "--cache", str(tmp_path / "c"), "--size", "8", "-q"])
    err = capsys.readouterr().err
    assert code != 0 and "no image field" in err and "/ds?" in err and SECRET not in err, err


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


def test_signed_folder_url_keeps_its_query_on_every_url(served_6_shards, tmp_path):
    # A folder URL with a token in its query (an Azure SAS token, a CDN token) gave
    # ".../ds?sig=abc/manifest.json" (HTTP 404), and ".../manifest.json?sig=abc" read the manifest as
    # each shard ("body ended at byte 1465 of 20480").
    with LoopbackServer(served_6_shards, ranges=False, max_requests=200, lifetime=60) as srv:
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


def test_converting_a_signed_source_url_keeps_its_token_out_of_names_and_messages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """convert() from a signed SRC URL named its staging folder after the URL's last segment, query
    and all: the token landed in the output manifest (extra.source.path); a signed single .tar URL was
    taken for a folder (HTTP 404 for .../shard-000000.tar/manifest.json); errors printed the raw URL."""
    import json

    from fastdata.errors import FastdataError
    from fastdata.shards.convert import ConvertOptions, convert

    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "1")  # the 404 below: no back-off
    from tests.helpers.loopback_server import LoopbackServer, make_shard_set

    make_shard_set(tmp_path / "www" / "ds", 8, 4, payload=64, seed=1)
    staging = str(tmp_path / "staging")
    with LoopbackServer(tmp_path / "www") as srv:
        for n, src in enumerate((f"{srv.url}/ds?sig=SECRET123", f"{srv.url}/ds/manifest.json?sig=SECRET123",
                                 f"{srv.url}/ds/shard-000000.tar?sig=SECRET123")):
            out = tmp_path / f"out{n}"
            result = convert(src, out, ConvertOptions(samples_per_shard=4, workers=1, staging=f"{staging}{n}"))
            assert result.manifest.num_samples == (4 if n == 2 else 8)
            assert "SECRET" not in (out / "manifest.json").read_text()
            assert json.loads((out / "manifest.json").read_text())["extra"]["source"]["path"].endswith(
                "shard-000000.tar" if n == 2 else "ds")
        with pytest.raises(FastdataError) as e:
            convert(f"{srv.url}/nothing?sig=SECRET123", tmp_path / "out9", ConvertOptions(staging=f"{staging}9"))
    assert "SECRET" not in str(e.value) and "nothing" in str(e.value)


def test_verify_keeps_a_urls_password_and_token_out_of_its_lines(tmp_path, capsys):
    """`fastdata verify http://me:secret@host/ds?sig=tok` printed the password and the signed URL's
    token on its ok and error lines (the messages inside them were redacted)."""
    from tests.helpers.loopback_server import LoopbackServer

    convert(synth_folder(tmp_path / "src", 4), tmp_path / "www" / "ds", opts(samples_per_shard=2))
    with LoopbackServer(tmp_path / "www", max_requests=20, lifetime=30) as srv:
        base = srv.url.replace("http://", "http://me:secret@")
        assert main(["verify", f"{base}/ds?sig=tok", "--workers", "1"]) == 0
        assert main(["verify", f"{base}/nothing?sig=tok"]) == 1
    out, err = capsys.readouterr()
    assert "me:***@" in out and "me:***@" in err and "sig=***" in out
    assert "secret" not in out + err and "tok" not in out + err
