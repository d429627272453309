"""A ShardedDataset state is checked in full at load_state_dict: errors name the field, the value and the
logical worker, and a refused state changes nothing (no error waits for the first batch or a worker)."""
from __future__ import annotations

import pytest

import fastdata
from fastdata import ShardedDataset, StateError
from tests.helpers.shards import make_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("schema") / "s", 20, 5, key="k{i:02d}", cls="int")


@pytest.fixture
def state(shards):
    loader = fastdata.DataLoader(ShardedDataset(shards, seed=1), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it), next(it), next(it)
    return loader.state_dict()["dataset"]  # 2 workers of 10 samples: positions [4, 2]


@pytest.mark.parametrize(("change", "match"), [
    (dict(version=7), "version=7; this fastdata reads ShardedDataset states of version 1"),
    (dict(epoch=1.5), "epoch must be an int, got 1.5"),
    (dict(epoch=-1), "epoch=-1 is out of range"),
    (dict(rank=5), r"rank=5 is out of range: must be in \[0, 1\)"),
    (dict(stages=[[2, [4, 11]]]), r"stages\[0\] \(num_workers=2\): logical worker 1 consumed 11 samples; its part "
                                  "of the epoch has 10"),
    (dict(stages=[[2, [4, 2]], [3, [0, 0, 9]]]), r"stages\[1\] \(num_workers=3\): logical worker 2 consumed 9 "
                                                 "samples; its part of the epoch has 4"),
    (dict(stages=[[2, [4]]]), r"stages\[0\] lists 1 positions for num_workers=2"),
    (dict(stages=[[2, [4, True]]]), "position of logical worker 1 must be an int, got True"),
    (dict(next_worker=2), r"next_worker=2 is out of range: must be in \[0, 2\)"),
    (dict(stages="[[2, [4, 2]]]"), "stages must be a list"),
    (dict(seed=2), "seed=2 in the state, 1 here"),
    (dict(eras=[{"world_size": 2, "workers": None, "stages": [[], []]}], split=[[5], [5]]),
     "split must list the worker counts of world_size=1 ranks"),
])
def test_a_bad_state_names_the_field_and_changes_nothing(shards, state, change, match):
    ds = ShardedDataset(shards, seed=1)
    ds.set_epoch(3)
    before = ds.state_dict()
    with pytest.raises(StateError, match=match):
        ds.load_state_dict({**state, **change})
    assert ds.state_dict() == before and ds.epoch == 3


def test_a_state_of_every_rank_names_the_rank(shards, state):
    ranks = [dict(state, rank=r, world_size=2) for r in range(2)]
    ranks[1]["stages"] = [[2, [4, 99]]]
    with pytest.raises(StateError, match=r"rank state 1: stages\[0\] .*logical worker 1 consumed 99"):
        ShardedDataset(shards, seed=1).load_state_dict(ranks)


def test_a_good_state_loads_and_gives_itself_back(shards, state):
    ds = ShardedDataset(shards, seed=1)
    ds.load_state_dict(state)
    assert ds.state_dict() == state
