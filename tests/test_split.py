"""Index math of ShardedDataset: exactly-once, equal counts, determinism, resume (no I/O)."""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from fastdata.dataset._schedule import num_batches
from fastdata.dataset._split import (
    ShuffleOptions,
    SplitPlan,
    iteration_stages,
    permutation,
    rng_key,
    stage_counts,
    stage_sequences,
    worker_sequence,
)

SHARD_LAYOUTS = [(10,), (4, 0, 9), (3, 3, 3, 3, 3, 3, 3), (1, 17, 2, 5, 8), (50, 1)]
MIX = ShuffleOptions(open_shards=3, buffer_size=4)


def _epoch(sizes, world, workers, *, epoch=0, **kw) -> dict[tuple[int, int], list[int]]:
    out = {}
    for rank in range(world):
        plan = SplitPlan(sizes, world_size=world, rank=rank, **kw)
        for w in range(max(1, workers)):
            out[rank, w] = plan.worker_indices(epoch, w, workers).tolist()
    return out


@pytest.mark.parametrize("sizes", SHARD_LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [0, 2, 5])
@pytest.mark.parametrize("shuffle", [None, MIX])
def test_pad_exactly_once_and_equal_counts(sizes, world, workers, shuffle):
    n = sum(sizes)
    parts = _epoch(sizes, world, workers, seed=3, shuffle=shuffle, epoch=1)
    per_rank = -(-n // world)
    for rank in range(world):
        assert sum(len(parts[rank, w]) for w in range(max(1, workers))) == per_rank
    # per-worker counts identical on every rank -> identical batch counts
    for w in range(max(1, workers)):
        assert len({len(parts[r, w]) for r in range(world)}) == 1
    counts = Counter(i for seq in parts.values() for i in seq)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) == per_rank * world
    assert sum(c - 1 for c in counts.values()) == per_rank * world - n  # padding only


@pytest.mark.parametrize("sizes", SHARD_LAYOUTS)
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("workers", [0, 3])
def test_drop_never_repeats(sizes, world, workers):
    n = sum(sizes)
    parts = _epoch(sizes, world, workers, shuffle=MIX, even="drop")
    all_idx = [i for seq in parts.values() for i in seq]
    assert len(all_idx) == len(set(all_idx)) == (n // world) * world


def test_padding_repeats_the_start_of_the_epoch():
    sizes = (5, 5)
    plan_last = SplitPlan(sizes, world_size=3, rank=2)
    assert plan_last.worker_indices(0, 0, 1).tolist() == [8, 9, 0, 1]


def test_more_slots_than_samples_wraps_around():
    parts = _epoch((2, 1), 4, 2)  # 3 samples for 8 slots
    counts = Counter(i for seq in parts.values() for i in seq)
    assert set(counts) == {0, 1, 2}
    assert {len(s) for s in parts.values()} == {0, 1}


def test_no_shuffle_is_manifest_order():
    parts = _epoch((3, 4, 2), 1, 0)
    assert parts[0, 0] == list(range(9))
    parts = _epoch((3, 4, 2), 2, 2)
    assert [parts[k] for k in sorted(parts)] == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 0]]


def test_fewer_shards_than_slots_split_inside_shards():
    plan = SplitPlan((12,), world_size=2, rank=1)
    assert plan.worker_segments(0, 0, 3) == [(0, 6, 8)]
    assert plan.worker_segments(0, 2, 3) == [(0, 10, 12)]


def test_deterministic_by_seed_and_different_per_epoch():
    sizes = (30, 30, 30, 30)
    a = _epoch(sizes, 2, 2, seed=7, shuffle=ShuffleOptions(), epoch=0)
    b = _epoch(sizes, 2, 2, seed=7, shuffle=ShuffleOptions(), epoch=0)
    c = _epoch(sizes, 2, 2, seed=8, shuffle=ShuffleOptions(), epoch=0)
    d = _epoch(sizes, 2, 2, seed=7, shuffle=ShuffleOptions(), epoch=1)
    assert a == b
    assert a != c and a != d


def test_pinned_order_is_stable():
    # the same seed gives the same order on every machine and numpy version (splitmix64 counters)
    assert hex(rng_key(0)) == "0x276cf164237ca616"
    assert permutation(rng_key(1, 2, 3), 8).tolist() == [6, 7, 1, 3, 2, 4, 0, 5]
    plan = SplitPlan((4, 4), seed=0, shuffle=ShuffleOptions(open_shards=2, buffer_size=2))
    assert plan.worker_indices(0, 0, 1).tolist() == [1, 2, 3, 0, 6, 7, 5, 4]
    assert plan.worker_indices(1, 0, 1).tolist() == [0, 3, 1, 4, 2, 7, 6, 5]


def test_shuffle_mixes_shards():
    # 20 class-sorted shards: the first 64 samples of a shuffled epoch come from many shards
    plan = SplitPlan((100,) * 20, shuffle=ShuffleOptions(open_shards=8, buffer_size=256), seed=1)
    first = plan.worker_indices(0, 0, 1)[:64]
    assert len({int(i) // 100 for i in first}) >= 6


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_samples_per_epoch_walks_passes_without_repetition(even):
    sizes = (5, 4, 3)  # 12 samples
    world, workers = 2, 2
    seen: list[int] = []
    for epoch in range(3):  # 3 epochs x 8 = 24 = 2 passes
        parts = _epoch(sizes, world, workers, epoch=epoch, seed=2, shuffle=MIX, samples_per_epoch=8, even=even)
        assert all(len(s) == 2 for s in parts.values())
        seen += [i for s in parts.values() for i in s]
    assert Counter(seen) == {i: 2 for i in range(12)}


def test_samples_per_epoch_rounds_to_world_size():
    assert SplitPlan((10,), world_size=4, samples_per_epoch=10).per_rank == 3
    assert SplitPlan((10,), world_size=4, samples_per_epoch=10, even="drop").per_rank == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size must be"),
        ({"world_size": 2, "rank": 2}, r"rank must be in \[0, world_size=2\), got 2"),
        ({"even": "wrap"}, "even must be one of"),
        ({"samples_per_epoch": 0}, "samples_per_epoch must be"),
        ({"world_size": 20, "even": "drop"}, "leaves no samples per rank"),
    ],
)
def test_plan_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SplitPlan((5, 5), **kwargs)


def test_shuffle_options_validation():
    with pytest.raises(ValueError, match="open_shards must be an int >= 1, got 0"):
        ShuffleOptions(open_shards=0)
    with pytest.raises(ValueError, match="buffer_size must be"):
        ShuffleOptions(buffer_size=-1)


def test_batch_counts():
    assert num_batches([5, 5], 4, False) == 4
    assert num_batches([5, 5], 4, True) == 2
    assert num_batches([5, 5], None, False) == 10


@pytest.mark.parametrize("old_workers", [1, 2, 3])
@pytest.mark.parametrize("new_workers", [1, 2, 4])
def test_resume_with_other_worker_count_is_exactly_once(old_workers, new_workers):
    plan = SplitPlan((7, 9, 4), seed=5, shuffle=MIX, world_size=2, rank=1)
    first = iteration_stages([], old_workers)
    seqs = stage_sequences(plan, 0, first)
    consumed = tuple(min(len(s), 2 + w) for w, s in enumerate(seqs))
    done = [i for s, c in zip(seqs, consumed) for i in s[:c].tolist()]
    stages = iteration_stages([(old_workers, consumed)], new_workers)
    rest = []
    for w in range(new_workers):
        seq, start = worker_sequence(plan, 0, stages, w)
        rest += seq[start:].tolist()
    all_idx = sorted(done + rest)
    assert all_idx == sorted(i for s in seqs for i in s.tolist())
    assert stage_counts(plan, stages) == [len(s) for s in stage_sequences(plan, 0, stages)]


def test_resume_same_worker_count_continues_in_order():
    plan = SplitPlan((7, 9, 4), seed=5, shuffle=MIX)
    stages = iteration_stages([(2, (3, 1))], 2)
    assert len(stages) == 1
    for w in range(2):
        seq, start = worker_sequence(plan, 0, stages, w)
        assert seq.tolist() == plan.worker_indices(0, w, 2).tolist()
        assert start == (3, 1)[w]


def test_resume_chain_of_worker_changes():
    plan = SplitPlan(tuple(range(1, 9)), seed=1, shuffle=MIX)
    full = sorted(i for w in range(3) for i in plan.worker_indices(0, w, 3).tolist())
    stages = iteration_stages([], 3)
    done: list[int] = []
    for nw in (2, 5, 1):
        seqs = stage_sequences(plan, 0, stages)
        consumed = tuple(len(s) // 3 for s in seqs)
        done += [i for s, c in zip(seqs, consumed) for i in s[:c].tolist()]
        stages = iteration_stages([*stages[:-1], (stages[-1][0], consumed)], nw)
    last = stage_sequences(plan, 0, stages)
    assert sorted(done + [i for s in last for i in s.tolist()]) == full


def test_bad_resume_counts():
    plan = SplitPlan((4,))
    with pytest.raises(ValueError, match="worker 0 consumed 9 of 4"):
        worker_sequence(plan, 0, [(1, (9,))], 0)


def test_large_plan_is_fast_enough():
    plan = SplitPlan((1000,) * 200, shuffle=ShuffleOptions())
    seq = plan.worker_indices(0, 0, 2)
    assert len(np.unique(seq)) == len(seq) == 100_000


def test_grid_of_ranks_workers_shards_is_exactly_once_with_padding_minimal():
    for nshards, world, workers in itertools.product([1, 2, 5], [1, 2, 3], [0, 1, 4]):
        sizes = tuple(3 + (i % 4) for i in range(nshards))
        parts = _epoch(sizes, world, workers, shuffle=MIX, seed=nshards)
        counts = Counter(i for s in parts.values() for i in s)
        assert set(counts) == set(range(sum(sizes)))
        assert max(counts.values()) <= 2
