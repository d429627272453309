"""Index math of ShardedDataset: exactly-once, equal counts, determinism, resume (no I/O); the
vectorised shuffle steps give exactly the order of the sequential reference loops (the order is
part of the resume contract: a state saved by an older version must resume to the same samples)."""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from fastdata._rng import random_floats
from fastdata.dataset._mix import _buffer_shuffle, _interleave
from fastdata.dataset._schedule import BatchSchedule
from fastdata.dataset._split import (ShuffleOptions, SplitPlan, iteration_stages, permutation, rng_key,
                                     stage_counts, stage_sequences, worker_sequence)


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


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
    assert BatchSchedule(2, 4, False).total([5, 5]) == 4
    assert BatchSchedule(2, 4, True).total([5, 5]) == 2
    assert BatchSchedule(2, None, False).total([5, 5]) == 10


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


def ref_interleave(pieces: list[np.ndarray], open_count: int, key: int) -> np.ndarray:
    total = sum(len(p) for p in pieces)
    if len(pieces) <= 1 or open_count <= 1:
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    rand = random_floats(key, total).tolist()
    lists = [p.tolist() for p in pieces]
    nxt = min(open_count, len(lists))
    live = [[lst, 0] for lst in lists[:nxt]]
    out = [0] * total
    for t in range(total):
        j = int(rand[t] * len(live))
        cur = live[j]
        lst, pos = cur
        out[t] = lst[pos]
        pos += 1
        if pos < len(lst):
            cur[1] = pos
        elif nxt < len(lists):
            live[j] = [lists[nxt], 0]
            nxt += 1
        else:
            live[j] = live[-1]
            live.pop()
    return np.asarray(out, dtype=np.int64)


def ref_buffer_shuffle(seq: np.ndarray, size: int, key: int) -> np.ndarray:
    n = len(seq)
    if size <= 1 or n <= 1:
        return seq
    rand = random_floats(key, n).tolist()
    items = seq.tolist()
    buf = items[: min(size, n)]
    out: list[int] = []
    for t in range(len(buf), n):
        j = int(rand[t] * len(buf))
        out.append(buf[j])
        buf[j] = items[t]
    tail = [buf[i] for i in permutation(key ^ 0x5DEECE66D, len(buf)).tolist()]
    out.extend(tail)
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_interleave_equals_the_sequential_loop(seed):
    rng = np.random.default_rng(seed)
    for _ in range(400):
        pieces = [rng.integers(0, 10**9, int(rng.integers(1, 40)), dtype=np.int64)
                  for _ in range(int(rng.integers(0, 14)))]
        open_count, key = int(rng.integers(1, 11)), int(rng.integers(0, 2**63))
        want, got = ref_interleave(pieces, open_count, key), _interleave(pieces, open_count, key)
        assert got.dtype == np.int64 and np.array_equal(got, want), ([len(p) for p in pieces], open_count, key)


def test_interleave_large_and_uneven():
    rng = np.random.default_rng(9)
    pieces = [np.arange(i * 1000, i * 1000 + int(rng.integers(1, 400)), dtype=np.int64) for i in range(300)]
    for open_count in (2, 8, 64, 299, 300, 1000):
        assert np.array_equal(_interleave(pieces, open_count, 77), ref_interleave(pieces, open_count, 77))


@pytest.mark.parametrize("seed", range(4))
def test_buffer_shuffle_equals_the_sequential_loop(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(400):
        seq = rng.integers(0, 10**9, int(rng.integers(0, 120)), dtype=np.int64)
        size, key = int(rng.integers(0, 150)), int(rng.integers(0, 2**63))
        want, got = ref_buffer_shuffle(seq, size, key), _buffer_shuffle(seq, size, key)
        assert np.array_equal(got, want), (len(seq), size, key)
    seq = np.arange(20_000, dtype=np.int64)
    assert np.array_equal(_buffer_shuffle(seq, 1000, 5), ref_buffer_shuffle(seq, 1000, 5))


def ref_mix_segments(segments, offsets, options, key):
    from fastdata.dataset._split import rng_key

    pieces = []
    for j, (shard, start, stop) in enumerate(segments):
        idx = np.arange(start, stop, dtype=np.int64) + int(offsets[shard])
        if options is not None and options.within_shard and len(idx) > 1:
            idx = idx[permutation(rng_key(key, 1, j), len(idx))]
        pieces.append(idx)
    if options is None:
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    seq = ref_interleave(pieces, options.open_shards, rng_key(key, 2))
    return ref_buffer_shuffle(seq, options.buffer_size, rng_key(key, 3))


@pytest.mark.parametrize("seed", range(3))
def test_mix_segments_equals_the_per_piece_loop(seed):
    from fastdata.dataset._split import ShuffleOptions, mix_segments

    rng = np.random.default_rng(200 + seed)
    for _ in range(150):
        sizes = rng.integers(0, 50, int(rng.integers(1, 20)))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        segments = []
        for _ in range(int(rng.integers(0, 15))):
            shard = int(rng.integers(0, len(sizes)))
            if sizes[shard] == 0:
                continue
            a = int(rng.integers(0, sizes[shard]))
            b = int(rng.integers(a + 1, sizes[shard] + 1))
            segments.append((shard, a, b))  # one-sample pieces included (splits never make empty ones)
        key = int(rng.integers(0, 2**63))
        options = [None, ShuffleOptions(open_shards=int(rng.integers(1, 6)), buffer_size=int(rng.integers(0, 40))),
                   ShuffleOptions(open_shards=3, buffer_size=0, within_shard=False)][int(rng.integers(0, 3))]
        want, got = ref_mix_segments(segments, offsets, options, key), mix_segments(segments, offsets, options, key)
        assert got.dtype == np.int64 and np.array_equal(got, want), (segments, options, key)


def test_vectorised_keys_equal_rng_key():
    from fastdata._rng import keys_u64, rng_key

    for key in (0, 1, 2**63 - 1, 2**64 - 1, 123456789):
        js = np.array([0, 1, 2, 7, 10**6, 2**40], dtype=np.int64)
        assert keys_u64(rng_key(key, 1), js).tolist() == [rng_key(key, 1, int(j)) for j in js]


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
