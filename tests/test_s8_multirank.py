"""Session 8, multirank: several ranks (datasets with rank=/world_size=, torch.distributed patched in one
process) and the node-local cache shared by several processes."""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
import torch

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.shards.tar import write_tar_shard

from tests.test_s7_resume import _ids, _loader  # noqa: E402 - the loader over conftest's `seven` set

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.mark.parametrize("rank, world_size, name", [
    (1.5, 2, "rank"), (0, 2.7, "world_size"), ("1", 2, "rank"), (0, "2", "world_size"), (True, 2, "rank"),
    (0, 0, "world_size"), (0, -1, "world_size"), (None, 2, "both"), (2, 2, r"rank must be in \[0, world_size=2\)"),
])
def test_malformed_rank_or_world_size_is_refused_naming_it(seven, rank, world_size, name):
    """rank=1.5 was read as 1, "1" as 1, True as 1 and world_size=2.7 as 2 (int() of anything), and
    world_size=0 said "rank must be in [0, world_size=0)"."""
    with pytest.raises(ValueError, match=name):
        ShardedDataset(seven, rank=rank, world_size=world_size)


def test_numpy_and_tensor_ints_are_a_rank(seven):
    ds = ShardedDataset(seven, rank=np.int64(1), world_size=torch.tensor(2))
    assert (ds.rank, ds.world_size) == (1, 2) and type(ds.rank) is int


def _fake_dist(monkeypatch, rank: int, world: int) -> None:
    """torch.distributed as initialised at ``rank`` of ``world`` (one process plays every rank)."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)


def test_a_state_loaded_before_init_process_group_is_not_applied_to_another_rank(seven, monkeypatch):
    """load_checkpoint before dist.init_process_group: the dataset was rank 0 of 1 then, so the list of
    every rank's state was split for one rank; once torch.distributed was initialised that split no
    longer fit, and every rank read its whole part of the epoch again (14 of 14 samples where 8 had been
    consumed), without a word."""
    states = []
    for r in range(2):
        dl = _loader(seven, r, 2, batch_size=2)
        it = iter(dl)
        next(it)
        states.append(dl.state_dict())
    for loaded in (states, states[1]):
        dl = DataLoader(ShardedDataset(seven), batch_size=2, collate_fn=_ids)  # torch.distributed not initialised
        try:
            dl.load_state_dict(loaded)
        except ValueError as e:  # the single state: world_size 2 in the state, 1 here
            assert "world_size=2 in the state, 1 here (torch.distributed is not initialised" in str(e)
            continue
        with monkeypatch.context() as m:
            _fake_dist(m, 1, 2)
            with pytest.raises(ValueError, match=r"loaded while this dataset was rank 0 of world_size=1; it now runs "
                                                 r"as rank 1 of world_size=2.*init_process_group"):
                list(dl)
    good = DataLoader(ShardedDataset(seven), batch_size=2, collate_fn=_ids)
    with monkeypatch.context() as m:
        _fake_dist(m, 1, 2)
        good.load_state_dict(states)  # after init: the rest of rank 1
        assert [x for b in good for x in b] == [6, 0]  # 4, 5 consumed; 0 pads rank 1's part to 4


def test_one_ranks_state_after_an_elastic_resume_with_another_loader_is_refused(seven):
    """The open case of session 7: after an elastic resume the ranks hold different sample counts (7 over
    4 ranks: 2, 2, 2, 1), equal in batches only for the loader the rest was split for. Each rank loading
    its own state with batch_size=1 gave [2, 2, 2, 1] batches: a DDP hang. The state now records the
    loader it was split for; another one is refused (the list of every rank's is split again)."""
    first = _loader(seven, 0, 1, batch_size=1)
    resized = [_loader(seven, r, 4, batch_size=2) for r in range(4)]
    for dl in resized:
        dl.load_state_dict([first.state_dict()])
    states = [dl.state_dict() for dl in resized]
    assert states[0]["dataset"]["split_for"] == [2, 1, False]
    for batch_size, num_workers in ((1, 0), (2, 2), (3, 0)):
        again = [_loader(seven, r, 4, batch_size=batch_size, num_workers=num_workers) for r in range(4)]
        with pytest.raises(ValueError, match=r"rank 0's rest of epoch 0 after an elastic resume: the ranks hold "
                                             r"\[2, 2, 2, 1\] samples, split for equal batch counts with batch_size=2"
                                             r".*Load the list of every rank's state"):
            again[0].load_state_dict(states[0])
    same = [_loader(seven, r, 4, batch_size=2) for r in range(4)]  # the loader it was split for: exact
    for dl, st in zip(same, states):
        dl.load_state_dict(st)
    got = [list(dl) for dl in same]
    assert [len(b) for b in got] == [1, 1, 1, 1] and sorted(x for b in got for y in b for x in y) == list(range(7))
    for dl, st in zip([_loader(seven, r, 4, batch_size=1) for r in range(4)], [d.state_dict() for d in same]):
        dl.load_state_dict(st)  # the rest read to its end: nothing left on any rank, any loader will do
        assert list(dl) == []
    relisted = [_loader(seven, r, 4, batch_size=1) for r in range(4)]  # the list, split again for batch_size=1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one worker per rank: even="pad" repeats one
        for dl in relisted:
            dl.load_state_dict(states)
    assert relisted[0].state_dict()["dataset"]["split_for"] == [1, 1, False]
    for dl, st in zip([_loader(seven, r, 4, batch_size=1) for r in range(4)], [d.state_dict() for d in relisted]):
        dl.load_state_dict(st)  # now split for batch_size=1: each rank's own state is taken
        assert len(list(dl)) == 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.helpers.loopback_server import make_shard_set  # noqa: E402

    root = tmp_path_factory.mktemp("s8www")
    make_shard_set(root / "ds", 8, 4, payload=300, seed=3)  # 2 shards
    return root


def test_a_node_cache_that_cannot_store_or_lock_is_an_error_not_a_skip(served, tmp_path, monkeypatch):
    """With on_error="skip", a full local disk (or a cache folder whose lock files cannot be made) "skipped"
    every sample as if it were bad data, each one downloading its shard again (16 GETs for 8 samples, 0
    yielded), and a rank whose host had the problem yielded nothing while the others trained on: a DDP
    hang. The node cache's local side is this host's problem, as the preprocessing cache's: raised."""
    import errno

    from tests.helpers.loopback_server import LoopbackServer

    from fastdata.dataset import RemoteShards
    from fastdata.nodecache import ShardCache
    from fastdata.errors import CacheError, RemoteError

    def full(self, i, shard, tmp, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    with LoopbackServer(served, max_requests=100, lifetime=60) as srv:
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "a", prefetch=0), decode=False,
                            on_error="skip")
        with monkeypatch.context() as m:
            m.setattr(ShardCache, "_download", full)
            with pytest.raises(CacheError, match=r"node cache .*cannot store shard-00000\d.tar.*No space left") as e:
                list(ds)
        assert isinstance(e.value, RemoteError) and not ds.skipped
        ds = ShardedDataset(RemoteShards(srv.url + "/ds", cache_dir=tmp_path / "b", prefetch=0), decode=False,
                            on_error="skip")
        (ds.source.node_cache.root / ".locks" / "0.use").mkdir()  # cannot be opened as a lock file
        with pytest.raises(CacheError, match=r"node cache .*shard-000000.tar: .*0\.use.*choose another cache_dir"):
            list(ds)
        assert not ds.skipped


def test_torchrun_without_init_process_group_warns_that_every_process_reads_everything(seven, monkeypatch):
    """Under torchrun (WORLD_SIZE=4) with torch.distributed not initialised, each of the 4 processes read
    all 7 samples and len() sized a schedule for one rank, without a word."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    ds = ShardedDataset(seven)  # built before init_process_group: fine, nothing is sized yet
    with pytest.warns(UserWarning, match=r"WORLD_SIZE='4' and RANK='2' are set .*not initialised.*reads every "
                                         r"sample.*init_process_group"):
        assert len(DataLoader(ds, batch_size=2)) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(ds)) == 7  # once per dataset
        assert len(list(ShardedDataset(seven, rank=0, world_size=1))) == 7  # on purpose: no warning
        with monkeypatch.context() as m:
            _fake_dist(m, 2, 4)
            assert len(list(ShardedDataset(seven))) == 2


def test_shard_schedule_of_a_host_costs_one_shard_order_per_pass(monkeypatch):
    """plan_reads (every walk of a remote dataset) asks for the schedule of every rank on the host and
    every worker: each (rank, worker) rebuilt the pass's shard order (an argsort of every shard) and
    summed every shard size in Python several times: 9.3 s at 100,000 shards for 8 ranks x 8 workers
    (0.1 s now), and each worker's len()/walk start summed them again (22 ms a call)."""
    from dataclasses import replace

    from fastdata.dataset import _split

    calls = []
    real = _split.permutation
    monkeypatch.setattr(_split, "permutation", lambda key, n: calls.append(n) or real(key, n))
    plan = _split.SplitPlan(tuple([3, 0, 5, 7, 1] * 40), world_size=16, rank=5, seed=2,
                            shuffle=_split.ShuffleOptions(), samples_per_epoch=500)
    got = _split.shard_schedule(plan, 1, range(8, 16), 8)
    assert len(calls) <= 2  # the passes epoch 1's window spans (was 64: one per rank and worker)
    want: dict[int, float] = {}
    for r in range(8, 16):  # the definition: each rank's own plan
        p = replace(plan, rank=r)
        for w in range(8):
            pos, n = 0, max(1, p.worker_counts(8)[w])
            for shard, a, b in p.worker_segments(1, w, 8):
                want[shard] = min(want.get(shard, float("inf")), 1 + pos / n)
                pos += b - a
    assert got == want


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


def test_persistent_workers_started_before_init_process_group_read_the_new_split(seven, monkeypatch):
    """Persistent workers keep the dataset copy they started with: a loader iterated once before
    torch.distributed was initialised (rank 0 of 1) went on reading every sample on every rank, while
    len() said one rank's share (and a next-epoch preload of the old split was served as well)."""
    ds = ShardedDataset(seven)
    dl = DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=True, collate_fn=_ids,
                    multiprocessing_context="fork")
    assert sorted(x for b in dl for x in b) == list(range(7))
    with monkeypatch.context() as m:
        _fake_dist(m, 1, 2)
        dl.set_epoch(1)
        want = [x for b in DataLoader(ShardedDataset(seven, rank=1, world_size=2), batch_size=2, collate_fn=_ids)
                for x in b]
        assert [x for b in dl for x in b] == want and len(want) == 4
    del dl


def test_an_explicit_rank_that_contradicts_torch_distributed_is_warned_about(seven, monkeypatch):
    """rank=LOCAL_RANK on a 2-node job (world_size=WORLD_SIZE): rank 0 of each node read the same part and
    the parts of ranks 4-7 were never read, without a word."""
    with monkeypatch.context() as m:
        _fake_dist(m, 5, 8)
        with pytest.warns(UserWarning, match=r"rank=1 was passed, but torch.distributed says this process is rank 5 "
                                             r"of the same world_size=8.*LOCAL_RANK"):
            ShardedDataset(seven, rank=1, world_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ShardedDataset(seven, rank=5, world_size=8)  # agrees
            ShardedDataset(seven, rank=1, world_size=2)  # a data-parallel group of its own (tensor parallel): fine


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
            return [_loader(urls, r, world, batch_size=2, samples_per_epoch=8) for r in range(world)]

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
