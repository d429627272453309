"""Streaming sources (tar URLs without a manifest): shards dealt to ranks and workers, resume by
replay, shards cut off, members left out."""
from __future__ import annotations

from pathlib import Path

import pytest

from fastdata.dataset import ShardedDataset
from fastdata.shards.tar import write_tar_shard
from tests.helpers.loopback_server import LoopbackServer, make_shard_set
from tests.helpers.ranks import rank_loader


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning",
                                        "ignore:This DataLoader will create:UserWarning")


def test_a_streamed_shard_cut_off_says_the_rest_of_it_is_lost(tmp_path, monkeypatch):
    # One skip record with the bare network error stood for every sample behind the cut: the reason did not
    # say that the rest of the shard was lost, nor that their number is unknown (no manifest).
    make_shard_set(tmp_path / "www" / "ds", 16, 4, payload=2000, seed=1)
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "1")
    fault = {"/ds/shard-000001.tar": "drop", "/ds/shard-000002.tar": 404}
    with LoopbackServer(tmp_path / "www", fault=lambda p, n: fault.get(p), max_requests=50, lifetime=60) as srv:
        urls = [f"{srv.url}/ds/shard-{s:06d}.tar" for s in range(4)]
        ds = ShardedDataset(urls, decode=False, on_error="skip")
        got = [s["__key__"] for s in ds]
    assert got[:4] == ["k00000", "k00001", "k00002", "k00003"] and got[-4:] == [f"k{i:05d}" for i in range(12, 16)]
    cut, missing = ds.skipped
    assert cut["shard"].endswith("shard-000001.tar") and missing["shard"].endswith("shard-000002.tar")
    read = len(got) - 8  # samples of shard 1 delivered before the cut
    assert f"the rest of the shard is lost after its first {read} samples" in cut["reason"]
    assert "count unknown" in cut["reason"] and "byte" in cut["reason"]  # the network error is kept
    assert "no sample of the shard could be read (count unknown" in missing["reason"] and "404" in missing["reason"]


def test_fields_selects_the_fields_of_a_streamed_tar_as_of_a_folder(tmp_path):
    # fields=["cls"] over tar URLs still gave (and decoded) every field of each sample; a folder gives only cls.
    make_shard_set(tmp_path / "www" / "ds", 4, 2, payload=10, seed=1)
    with LoopbackServer(tmp_path / "www", max_requests=20, lifetime=60) as srv:
        urls = [f"{srv.url}/ds/shard-{s:06d}.tar" for s in range(2)]
        streamed = list(ShardedDataset(urls, fields=["cls"]))
    indexed = list(ShardedDataset(tmp_path / "www" / "ds", fields=["cls"]))
    assert [sorted(s) for s in streamed] == [sorted(s) for s in indexed] == [["__key__", "cls"]] * 4


@pytest.mark.parametrize("num_workers", [0, 1])
def test_members_a_streamed_tar_leaves_out_are_listed_in_skipped(tmp_path, num_workers):
    # The README: each tar member left out (a symlink out of the archive, a name that is no '<key>.<field>') is
    # listed in ShardedDataset.skipped for manifest-less tars. A streamed tar only warned, in the process that
    # read it (a DataLoader worker's warning never reaches the training process), and listed nothing.
    import io
    import tarfile
    import warnings

    import fastdata

    (tmp_path / "www").mkdir()
    with tarfile.open(tmp_path / "www" / "a.tar", "w") as t:
        for name, data in (("k0.cls", b"0"), ("k1.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("k1.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(link)
    with LoopbackServer(tmp_path / "www", max_requests=10, lifetime=60) as srv:
        ds = ShardedDataset([f"{srv.url}/a.tar"], max_skips=0)  # a member left out is no skipped sample
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keys = [k for b in fastdata.DataLoader(ds, batch_size=2, num_workers=num_workers) for k in b["__key__"]]
    assert keys == ["k0", "k1"]
    (record,) = ds.skipped
    assert (record["shard"], record["key"], record["member"], record["epoch"]) == (f"{srv.url}/a.tar", "k1", "k1.txt", 0)
    assert "points outside the archive" in record["reason"]


def test_streaming_source_over_several_ranks_without_samples_per_epoch_warns(tmp_path):
    """Whole streamed shards are dealt to ranks: their counts can differ (a DDP hang) unless
    samples_per_epoch fixes each rank's share. The warning comes once per dataset, not at world_size 1."""
    import warnings

    fsspec = pytest.importorskip("fsspec")
    from fastdata import ShardedDataset
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "s", max_samples=4) as w:
        for i in range(10):
            w.write({"__key__": f"k{i:03d}", "cls": i})
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted((tmp_path / "s").glob("*.tar")):
        fs.pipe(f"/fastdata-uneven/{p.name}", p.read_bytes())
        urls.append(f"memory://fastdata-uneven/{p.name}")
    with pytest.warns(UserWarning, match="samples_per_epoch") as record:
        ds = ShardedDataset(urls, rank=0, world_size=2)
        ds.loader_seam.resolve_dist()
    assert sum("samples_per_epoch" in str(r.message) for r in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedDataset(urls, rank=0, world_size=2, samples_per_epoch=6)
        ShardedDataset(urls)


def _memory_urls(tmp_path, name, n, per_shard):
    fsspec = pytest.importorskip("fsspec")
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / name, max_samples=per_shard) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "cls": i})
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted((tmp_path / name).glob("*.tar")):
        fs.pipe(f"/{name}/{p.name}", p.read_bytes())
        urls.append(f"memory://{name}/{p.name}")
    return urls


def test_a_streaming_source_with_too_few_shards_fails_at_iter_not_in_a_worker(tmp_path):
    from fastdata import DataLoader, ShardedDataset

    urls = _memory_urls(tmp_path, "fastdata-few", 4, 2)  # 2 shards
    loader = DataLoader(ShardedDataset(urls), batch_size=2, num_workers=3)
    with pytest.raises(ValueError, match=r"at least world_size x num_workers = 3 shards, got 2") as info:
        iter(loader)
    assert "worker process" not in str(info.value)  # raised in this process, not re-raised from a worker
    assert sorted(int(c) for b in DataLoader(ShardedDataset(urls), batch_size=2, num_workers=2) for c in b["cls"]) \
        == list(range(4))


def test_a_streaming_rank_dealt_only_empty_shards_raises_instead_of_looping(tmp_path):
    """Tar URLs with samples_per_epoch: a rank whose dealt shards were all empty looped over them for
    good (without shuffling each pass deals the same ones), one GET per shard per pass: 2000 GETs in a
    few seconds, a hang for the other ranks. Empty shards are fetched once per walk now."""
    from tests.helpers.loopback_server import LoopbackServer

    from fastdata.errors import SourceError

    for j, n in enumerate([3, 0, 3, 0]):
        write_tar_shard(tmp_path / f"s{j}.tar", [{"__key__": f"s{j}k{k}", "cls": b"1"} for k in range(n)])
    with LoopbackServer(tmp_path, max_requests=40, lifetime=60) as srv:
        urls = [f"{srv.url}/s{j}.tar" for j in range(4)]
        with pytest.raises(SourceError, match=r"rank 1 of world_size=2.*every shard it is dealt is empty .*s1\.tar, "
                                              r".*s3\.tar\).*samples_per_epoch"):
            list(ShardedDataset(urls, rank=1, world_size=2, samples_per_epoch=4))
        assert sum(srv.counts.values()) == 2
        srv.reset_counts()
        got = [s["__key__"] for s in ShardedDataset(urls, rank=0, world_size=2, samples_per_epoch=4)]
        assert got == ["s0k0", "s0k1"] and sum(srv.counts.values()) == 1
        with pytest.warns(UserWarning, match="without samples_per_epoch"):  # one pass: no loop, nothing to raise
            assert list(ShardedDataset(urls, rank=1, world_size=2)) == []


def test_a_streaming_datasets_list_of_rank_states_resumes(tmp_path):
    """The list of every rank's state (what a DDP checkpoint holds) of a tar-URL dataset could not be
    loaded at all: "ValueError: the dataset has no samples (every shard is empty)", from a split plan
    that streaming sources do not have; at another world size too, instead of the streaming message."""
    from tests.helpers.loopback_server import LoopbackServer

    for j in range(4):
        write_tar_shard(tmp_path / f"s{j}.tar", [{"__key__": f"s{j}k{k}", "cls": str(3 * j + k).encode()}
                                                 for k in range(3)])
    with LoopbackServer(tmp_path, max_requests=100, lifetime=60) as srv:
        urls = [f"{srv.url}/s{j}.tar" for j in range(4)]

        def loaders(world):
            return [rank_loader(urls, r, world, batch_size=2, samples_per_epoch=8) for r in range(world)]

        first = loaders(2)
        for dl in first:
            next(iter(dl))
        states = [dl.state_dict() for dl in first]
        whole = [list(dl) for dl in loaders(2)]
        again = loaders(2)
        for dl in again:
            dl.load_state_dict(states)
        assert [list(dl) for dl in again] == [w[1:] for w in whole]
        with pytest.raises(ValueError, match="a streaming .URL. source cannot resume at world_size=1"):
            loaders(1)[0].load_state_dict(states)


def test_a_streaming_resume_whose_replay_fails_raises_instead_of_losing_samples(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL-list dataset resumes by re-reading the consumed part without decoding. A shard that failed
    there (404) counted as one position, so the replay ran on into later shards and the resumed epoch
    silently lost the rest of that shard and the whole next one, under on_error="raise"."""

    from fastdata.errors import FastdataError

    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "1")
    from tests.helpers.loopback_server import LoopbackServer, make_shard_set

    make_shard_set(tmp_path / "www" / "ds", 16, 4, payload=64, seed=1)
    bad: set[str] = set()
    with LoopbackServer(tmp_path / "www", fault=lambda p, n: 404 if p in bad else None) as srv:
        urls = [f"{srv.url}/ds/shard-{s:06d}.tar" for s in range(4)]
        first = ShardedDataset(urls, decode=False)
        it = iter(first)
        for _ in range(6):
            next(it)
        state = first.state_dict()
        bad.update({"/ds/shard-000001.tar", "/ds/shard-000002.tar"})
        again = ShardedDataset(urls, decode=False)
        again.load_state_dict(state)
        with pytest.raises(FastdataError, match="shard-000001"):
            list(again)
        skipping = ShardedDataset(urls, decode=False, on_error="skip")
        skipping.load_state_dict(state)
        list(skipping)
        assert [r["shard"] for r in skipping.skipped][:1] == [urls[1]]  # reported, not lost in silence
