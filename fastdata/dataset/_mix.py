"""How one worker mixes its samples when shuffling (:class:`ShuffleOptions`), on integer indices.

Each shard piece is read in a seeded random order (``within_shard``), ``open_shards`` pieces are
interleaved at random, then a ``buffer_size`` shuffle buffer is simulated. The steps are vectorised
forms of sequential reference loops (kept in tests/dataset/test_split.py, which checks them sample for
sample): the order is part of the resume contract. See docs/design/split.md.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastdata._rng import (
    GOLDEN,
    keys_u64,
    mix_u64,
    permutation,
    random_floats,
    rng_key,
)

__all__ = ["Segment", "ShuffleOptions", "mix_segments"]

Segment = tuple[int, int, int]  # (shard, start, stop): sample positions inside one shard


@dataclass(frozen=True)
class ShuffleOptions:
    """How a worker mixes its samples when shuffling.

    Args:
        open_shards: shard pieces interleaved at random at any time. More mixes better across
            shards written in a sorted order; each open piece is one more file being read.
        buffer_size: size of the simulated shuffle buffer after interleaving (0: none).
        within_shard: read each shard piece in a random order (random access) instead of in
            file order. Set False for slow random access (e.g. HDF5 with large chunks).
    """

    open_shards: int = 8  # 8 x 256 MB shards keeps the page-cache working set ~2 GB
    buffer_size: int = 1000
    within_shard: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.open_shards, int) or isinstance(self.open_shards, bool) or self.open_shards < 1:
            raise ValueError(f"open_shards must be an int >= 1, got {self.open_shards!r}")
        if not isinstance(self.buffer_size, int) or isinstance(self.buffer_size, bool) or self.buffer_size < 0:
            raise ValueError(f"buffer_size must be an int >= 0, got {self.buffer_size!r}")
        if not isinstance(self.within_shard, bool):  # "no" would be read as True
            raise ValueError(f"within_shard must be True or False, got {self.within_shard!r}")


def _stable_order(slots: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of small non-negative ints below ``bound`` (a radix sort for 16-bit keys)."""
    if bound <= 1 << 16:
        slots = slots.astype(np.uint16)
    return np.argsort(slots, kind="stable")


def _interleave(pieces: list[np.ndarray], open_count: int, key: int) -> np.ndarray:
    """Interleave ``pieces``: ``open_count`` of them are open at a time; each step takes the next
    sample of an open piece drawn at random (``random_floats(key)``); an exhausted piece is replaced
    by the next unopened one in the same slot, and once none is left, by the last open one.

    Vectorised form of that sequential process (the order is part of the resume contract; a
    reference loop in tests/dataset/test_split.py checks it sample for sample): while ``k`` pieces
    are open the slot of every step is known up front, so only the piece hand-outs (one per piece)
    are simulated, in the order the slots run dry; the tail after the first slot closes (at most
    ``open_count`` pieces) runs as the loop (docs/design/split.md).
    """
    total = sum(len(p) for p in pieces)
    if len(pieces) <= 1 or open_count <= 1:
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    rand = random_floats(key, total)
    k = min(open_count, len(pieces))
    lens = [len(p) for p in pieces]
    js = (rand * k).astype(np.int64)  # the slot of each step while k pieces are open
    # pick times of each slot, in time order
    order = _stable_order(js, k)
    counts = np.bincount(js, minlength=k)
    starts = np.concatenate([[0], np.cumsum(counts)])
    times = [order[starts[s]:starts[s + 1]] for s in range(k)]
    # simulate piece hand-outs: slot s exhausts its piece at its (used + len)-th pick
    used = [0] * k
    assigned = [[s] for s in range(k)]
    nxt = k
    heap = []
    for s in range(k):
        c = lens[s]
        if c <= len(times[s]):
            heapq.heappush(heap, (int(times[s][c - 1]), s))
        used[s] = c
    t_end = total  # first step at which a slot is dropped (k changes); total: never in phase 1
    drop_slot = -1
    while heap:
        t, s = heapq.heappop(heap)
        if nxt < len(pieces):
            assigned[s].append(nxt)
            c = used[s] + lens[nxt]
            used[s] = c
            nxt += 1
            if c <= len(times[s]):
                heapq.heappush(heap, (int(times[s][c - 1]), s))
        else:
            t_end, drop_slot = t, s
            break
    # phase 1 output: steps < t_end, plus step t_end itself (chosen with k slots)
    out = np.empty(total, dtype=np.int64)
    pos = [0] * k  # position inside the current piece of each slot after phase 1
    cur = [0] * k
    for s in range(k):
        n_s = int(np.searchsorted(times[s], t_end, side="right"))  # picks at times <= t_end
        cat = np.concatenate([pieces[i] for i in assigned[s]])
        out[times[s][:n_s]] = cat[:n_s]
        # state after n_s picks
        acc = 0
        for i in assigned[s]:
            if n_s < acc + lens[i] or i == assigned[s][-1]:
                cur[s], pos[s] = i, n_s - acc
                break
            acc += lens[i]
    if t_end >= total:
        return out
    # phase 2: sequential, with the reference loop's state after step t_end
    live = [[pieces[cur[s]].tolist(), pos[s]] for s in range(k)]
    # step t_end exhausted drop_slot's piece with no piece left: the reference swaps in the last and pops
    live[drop_slot] = live[-1]
    live.pop()
    r = rand.tolist()
    for t in range(t_end + 1, total):
        j = int(r[t] * len(live))
        c = live[j]
        lst, p = c
        out[t] = lst[p]
        p += 1
        if p < len(lst):
            c[1] = p
        else:
            live[j] = live[-1]
            live.pop()
    return out


def _buffer_shuffle(seq: np.ndarray, size: int, key: int) -> np.ndarray:
    """A simulated shuffle buffer of ``size`` over ``seq``: each later sample replaces the sample
    drawn from a random slot (``random_floats(key)``), the buffer's rest comes last in a seeded
    permutation. Vectorised: the sample drawn at step ``t`` is the one put into that slot at its
    previous draw (or the slot's initial one), so one sort by (slot, time) gives every draw.
    """
    n = len(seq)
    if size <= 1 or n <= 1:
        return seq
    items = np.asarray(seq, dtype=np.int64)
    b = min(size, n)
    rand = random_floats(key, n)
    ts = np.arange(b, n, dtype=np.int64)
    js = (rand[b:] * b).astype(np.int64)  # int(rand[t] * len(buf)): truncation of the same double product
    order = _stable_order(js, b)  # by slot, then time
    js_s, ts_s = js[order], ts[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = js_s[1:] != js_s[:-1]
    # what slot j holds when picked at time t: the item put there at its previous pick, else items[j]
    src = np.where(first, js_s, np.concatenate([[0], ts_s[:-1]]))
    out = np.empty(n, dtype=np.int64)
    out[: n - b][order] = items[src]
    final = items[:b].copy()
    last = np.ones(len(order), dtype=bool)
    last[:-1] = js_s[1:] != js_s[:-1]
    final[js_s[last]] = items[ts_s[last]]
    out[n - b:] = final[permutation(key ^ 0x5DEECE66D, b)]
    return out


def _piece_permutations(lengths: np.ndarray, starts: np.ndarray, piece: np.ndarray, rank: np.ndarray,
                        keys: np.ndarray) -> np.ndarray:
    """``concatenate([permutation(keys[j], lengths[j]) for j])``, vectorised (``piece``/``rank``: the
    piece of every position and its place in it; ``starts``: where each piece begins): one
    counter-based stream per piece, then one row-wise stable argsort per distinct piece length
    (shard pieces mostly share a length), the same order as the stable per-piece argsort."""
    x = mix_u64((rank + 1).astype(np.uint64) * np.uint64(GOLDEN) + keys[piece])  # counters 1..n per piece
    out = np.empty(len(rank), dtype=np.int64)
    for n in np.unique(lengths).tolist():
        if n == 0:
            continue
        rows = starts[lengths == n][:, None] + np.arange(n, dtype=np.int64)  # (pieces of length n, n)
        out[rows] = np.argsort(x[rows], axis=1, kind="stable")
    return out


def mix_segments(
    segments: Sequence[Segment], offsets: np.ndarray, options: ShuffleOptions | None, key: int
) -> np.ndarray:
    """Global sample indices of ``segments``, mixed by ``options`` (None: in order)."""
    if not len(segments):
        return np.zeros(0, dtype=np.int64)
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    lengths = np.maximum(seg[:, 2] - seg[:, 1], 0)
    first = np.asarray(offsets, dtype=np.int64)[seg[:, 0]] + seg[:, 1]  # global index of each piece's start
    piece = np.repeat(np.arange(len(seg), dtype=np.int64), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    rank = np.arange(len(piece), dtype=np.int64) - starts[piece]  # place inside its piece
    if options is not None and options.within_shard:  # each piece in its own seeded order
        keys = keys_u64(rng_key(key, 1), np.arange(len(seg), dtype=np.int64))
        rank = _piece_permutations(lengths, starts, piece, rank, keys)
    flat = first[piece] + rank
    if options is None:
        return flat
    pieces = np.split(flat, starts[1:]) if len(seg) > 1 else [flat]
    seq = _interleave(pieces, options.open_shards, rng_key(key, 2))
    return _buffer_shuffle(seq, options.buffer_size, rng_key(key, 3))
