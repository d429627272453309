"""The vectorised shuffle steps of ``fastdata.dataset._split`` give exactly the order of the
sequential reference loops below (the order is part of the resume contract: a state saved by an
older version must resume to the same samples)."""
from __future__ import annotations

import numpy as np
import pytest

from fastdata.dataset._mix import _buffer_shuffle, _interleave
from fastdata._rng import permutation, random_floats


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
        assert keys_u64(key, 1, js).tolist() == [rng_key(key, 1, int(j)) for j in js]
