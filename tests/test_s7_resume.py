"""Session 7, resume: defects found by fuzzing exactly-once epochs, exact resume and elastic resume."""
from __future__ import annotations

import warnings

import pytest

from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.loader import DataLoader
from fastdata.shards.tar import write_tar_shard

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _ids(samples) -> list[int]:
    return [int(s["cls"]) for s in samples]


def _loader(shards, rank, world, *, batch_size, num_workers=0, **kw) -> DataLoader:
    ds = ShardedDataset(shards, rank=rank, world_size=world, **kw)
    return DataLoader(ds, batch_size=batch_size, num_workers=num_workers, collate_fn=_ids)


def test_a_state_saved_with_other_shuffle_options_is_refused(seven):
    """The shuffle options fix the order: resuming under other ones skipped the wrong samples
    (the consumed prefix of the old order), silently losing some and repeating others."""
    a = ShardedDataset(seven, shuffle=ShuffleOptions(buffer_size=4))
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    for other in (True, ShuffleOptions(buffer_size=5), ShuffleOptions(buffer_size=4, open_shards=2),
                  ShuffleOptions(buffer_size=4, within_shard=False)):
        with pytest.raises(ValueError, match="state_dict does not match this dataset: shuffle="):
            ShardedDataset(seven, shuffle=other).load_state_dict(state)
        with pytest.raises(ValueError, match="state_dict does not match this dataset: shuffle="):
            ShardedDataset(seven, shuffle=other).load_state_dict([state])
    b = ShardedDataset(seven, shuffle=ShuffleOptions(buffer_size=4))
    b.load_state_dict(state)  # the same options: accepted, the rest comes out
    assert len(list(b)) == 4


def test_a_state_of_another_rank_is_refused_after_an_elastic_resume_and_warned_about_otherwise(seven):
    """Another rank's state was taken without a word. Ranks have the same per-worker counts and run in
    lockstep, so a checkpoint saved by rank 0 alone resumes every rank exactly unless samples were
    skipped: it is used, with a warning (refusing it would make such checkpoints unusable). After an
    elastic resume the ranks' positions differ: refused."""
    whole = _ids(ShardedDataset(seven, rank=1, world_size=2, shuffle=True))
    a = ShardedDataset(seven, rank=0, world_size=2, shuffle=True)
    it = iter(a)
    next(it)
    b = ShardedDataset(seven, rank=1, world_size=2, shuffle=True)
    with pytest.warns(RuntimeWarning, match="rank 0's state, loaded on rank 1"):
        b.load_state_dict(a.state_dict())
    assert _ids(b) == whole[1:]
    first = _loader(seven, 0, 1, batch_size=1)
    resized = _loader(seven, 0, 2, batch_size=1)
    with pytest.warns(UserWarning, match="repeats 1 of them"):  # 7 samples, 2 ranks, one worker each
        resized.load_state_dict([first.state_dict()])  # elastic: 1 rank -> 2
    next(iter(resized))
    with pytest.raises(ValueError, match="rank 0's state.*this is rank 1.*elastic"):
        ShardedDataset(seven, rank=1, world_size=2).load_state_dict(resized.state_dict())


def test_same_world_size_after_an_elastic_resume_keeps_equal_batch_counts(seven):
    """An elastic rest gives ranks unequal sample counts (equal batch counts for the batch size it
    was split for); resuming it at the same world size with another batch size (or num_workers)
    continued each rank's own rest, so ranks yielded different batch counts: a DDP hang."""
    first = _loader(seven, 0, 1, batch_size=1)
    states = [first.state_dict()]  # saved before any batch: all 7 samples remain
    resized = [_loader(seven, r, 4, batch_size=2) for r in range(4)]
    for dl in resized:
        dl.load_state_dict(states)
    assert [len(list(dl)) for dl in resized] == [1, 1, 1, 1]  # the elastic rest: 2+2+2+1 samples
    for dl in resized:
        dl.load_state_dict(states)
    states = [dl.state_dict() for dl in resized]  # the elastic era, nothing consumed yet
    for batch_size in (2, 1):  # 2: the split's own batch size, continued exactly; 1: a new split
        again = [_loader(seven, r, 4, batch_size=batch_size) for r in range(4)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for dl in again:
                dl.load_state_dict(states)
        got = [list(dl) for dl in again]
        counts = [len(b) for b in got]
        assert len(set(counts)) == 1, (batch_size, counts)  # was [2, 2, 2, 1] with batch_size=1
        assert [len(dl) for dl in again] == counts
        ids = sorted(x for b in got for batch in b for x in batch)
        if batch_size == 2:
            assert ids == list(range(7)) and not caught
        else:  # one worker per rank, 7 samples, 4 ranks: README's exception 5, even="pad" repeats one
            assert sorted(set(ids)) == list(range(7)) and len(ids) == 8
            assert any("repeats 1 of them" in str(w.message) for w in caught)


def test_elastic_resume_with_even_drop_and_fewer_samples_left_than_ranks(seven):
    """README, elastic exception 5: with one worker per rank and fewer than W2 samples left,
    even="drop" leaves them out with a warning (it raised ValueError)."""
    first = _loader(seven, 0, 1, batch_size=1, even="drop")
    it = iter(first)
    for _ in range(6):
        next(it)
    states = [first.state_dict()]  # 1 sample left
    resized = [_loader(seven, r, 4, batch_size=2, even="drop") for r in range(4)]
    for dl in resized:
        with pytest.warns(UserWarning, match="leaves 1 of them out"):
            dl.load_state_dict(states)
    assert [list(dl) for dl in resized] == [[], [], [], []]


def test_a_state_of_other_data_says_so_and_older_states_still_load(seven, tmp_path):
    state = ShardedDataset(seven, shuffle=True).state_dict()
    other = tmp_path / "o.tar"
    write_tar_shard(other, [{"__key__": f"o{k}", "cls": b"1"} for k in range(7)])
    with pytest.raises(ValueError, match="fingerprint=.*saved over other data"):
        ShardedDataset([str(other)], shuffle=True).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "shuffle_options"}  # saved before the key existed
    ShardedDataset(seven, shuffle=True).load_state_dict(older)
    with pytest.raises(ValueError, match=r"lacks \['seed'\]"):  # a missing field is no match
        ShardedDataset(seven, shuffle=True).load_state_dict({k: v for k, v in state.items() if k != "seed"})


def test_samples_per_epoch_windows_continue_the_stream_after_a_resize(seven):
    """samples_per_epoch=5 rounds to 6 positions per epoch at 2 ranks and 8 at 4: the epochs after a
    resize started at e*8, so stream positions 6 and 7 were never read and 14, 15 were read early."""
    def loaders(world):
        return [_loader(seven, r, world, batch_size=2, samples_per_epoch=5) for r in range(world)]

    def epoch(dls, e):
        for dl in dls:
            dl.set_epoch(e)
        return [x for dl in dls for batch in dl for x in batch]

    two = loaders(2)
    seen = epoch(two, 0)  # stream positions 0-5
    four = loaders(4)
    for dl in four:
        dl.load_state_dict([dl2.state_dict() for dl2 in two])  # saved at the end of epoch 0
    seen += epoch(four, 1)  # positions 6-13: the rest of pass 0 and all of pass 1
    assert sorted(seen) == sorted([*range(7), *range(7)])
    assert four[0].state_dict()["dataset"]["stream_origin"] == [1, 6]
    again = loaders(4)  # a restarted job at the new world size keeps the stream where it was
    for dl, old in zip(again, four):
        dl.load_state_dict(old.state_dict())
    assert epoch(again, 2) == epoch(four, 2)
