"""Pure index math behind :class:`fastdata.ShardedDataset` (no I/O, no torch).

Everything a data-loading process needs to know about "which samples, in which order" is
computed here from ``(shard sizes, seed, epoch, rank, world_size, worker, num_workers)``:

1. **Stream.** Pass ``p`` over the data is the concatenation of all shards in an order that
   is the manifest order, or (``shuffle``) a permutation seeded by ``(seed, p)``.
   Epoch ``e`` is pass ``e``; with ``samples_per_epoch`` the passes form one endless stream
   and epoch ``e`` is the ``e``-th window of it (no sample repeats before all were seen).
2. **Ranks.** The epoch's positions are cut into ``world_size`` equal contiguous parts.
   ``even="pad"`` repeats positions from the start of the epoch to fill the last part
   (like ``DistributedSampler``); ``even="drop"`` drops the tail.
3. **Workers.** A rank's part is cut into ``num_workers`` contiguous parts whose sizes depend
   only on the part size, so every rank has the same per-worker counts (hence batch counts).
   Parts are position ranges, so shards are split by index ranges when there are fewer
   shards than ranks x workers.
4. **Mixing** (``shuffle``), per worker: each shard piece is read in a seeded random order,
   ``open_shards`` pieces are interleaved at random, then a ``buffer_size`` shuffle buffer is
   simulated. All of it on integer indices; data is then read by position.
5. **Resume.** A worker's order is a pure function of the above, so resuming means
   regenerating it and skipping the consumed prefix. Resuming with another worker count
   splits the union of the workers' remaining indices into new contiguous parts.
6. **Elastic resume** (another world size mid-epoch): from every rank's state, the samples no
   rank consumed are cut into contiguous parts per new rank and worker with equal batch counts
   per rank (:func:`elastic_split`, :class:`ElasticPlan`).

Random numbers come from a counter-based splitmix64 hash, so orders are identical on every
machine and numpy version.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
# np.unique imports numpy.ma on its first call. A fork while another thread is in that import (a thread
# decoder's split) leaves the module's import lock held in the child forever: the worker hung at its own
# first np.unique. Imported here, before any thread or fork of ours.
import numpy.ma  # noqa: F401

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
EVEN_POLICIES = ("pad", "drop")

Segment = tuple[int, int, int]  # (shard, start, stop): sample positions inside one shard


# ---------------------------------------------------------------------------------------------
# Counter-based random numbers (stable across machines and numpy versions)


def _mix64(x: int) -> int:
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def rng_key(*words: int) -> int:
    """Fold integers (seed, epoch, ...) into one 64-bit stream key."""
    key = 0x6A09E667F3BCC908
    for w in words:
        key = _mix64(key ^ _mix64((int(w) + _GOLDEN) & _MASK))
    return key


def _mix_u64(x: np.ndarray) -> np.ndarray:
    """:func:`_mix64` of every element of a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def random_u64(key: int, n: int) -> np.ndarray:
    """``n`` pseudo-random uint64 values of the stream ``key`` (splitmix64 of a counter)."""
    return _mix_u64(np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key))


def random_floats(key: int, n: int) -> np.ndarray:
    """``n`` floats uniform in [0, 1)."""
    return (random_u64(key, n) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def permutation(key: int, n: int) -> np.ndarray:
    """A seeded permutation of ``range(n)`` (int64)."""
    return np.argsort(random_u64(key, n), kind="stable").astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Options


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


# ---------------------------------------------------------------------------------------------
# Mixing inside one worker


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
    reference loop in tests/test_split_vector.py checks it sample for sample): while ``k`` pieces
    are open the slot of every step is known up front, so only the piece hand-outs (one per piece)
    are simulated, in the order the slots run dry; the tail after the first slot closes (at most
    ``open_count`` pieces) runs as the loop. ~5x faster than the loop; at epoch start it held the
    GIL ~0.5 us per sample.
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


def _keys_u64(key: int, prefix: int, idx: np.ndarray) -> np.ndarray:
    """``rng_key(key, prefix, j)`` for every ``j`` of ``idx`` (uint64), vectorised."""
    head = rng_key(key, prefix)  # the fold over the common words; the last word varies
    words = idx.astype(np.uint64) + np.uint64(_GOLDEN)  # (j + golden) mod 2^64
    return _mix_u64(np.uint64(head) ^ _mix_u64(words))


def _piece_permutations(lengths: np.ndarray, starts: np.ndarray, piece: np.ndarray, rank: np.ndarray,
                        keys: np.ndarray) -> np.ndarray:
    """``concatenate([permutation(keys[j], lengths[j]) for j])``, vectorised (``piece``/``rank``: the
    piece of every position and its place in it; ``starts``: where each piece begins): one
    counter-based stream per piece, then one row-wise stable argsort per distinct piece length
    (shard pieces mostly share a length), the same order as the stable per-piece argsort."""
    x = _mix_u64((rank + 1).astype(np.uint64) * np.uint64(_GOLDEN) + keys[piece])  # counters 1..n per piece
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
        keys = _keys_u64(key, 1, np.arange(len(seg), dtype=np.int64))
        rank = _piece_permutations(lengths, starts, piece, rank, keys)
    flat = first[piece] + rank
    if options is None:
        return flat
    pieces = np.split(flat, starts[1:]) if len(seg) > 1 else [flat]
    seq = _interleave(pieces, options.open_shards, rng_key(key, 2))
    return _buffer_shuffle(seq, options.buffer_size, rng_key(key, 3))


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous parts of ``total`` (the first ``total % parts`` get one more)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# ---------------------------------------------------------------------------------------------
# The plan of a rank


@dataclass(frozen=True)
class SplitPlan:
    """Which global sample indices a (rank, worker) reads in each epoch, and in which order.

    Global sample index = offset of its shard (manifest order) + position inside the shard.
    """

    shard_sizes: tuple[int, ...]
    world_size: int = 1
    rank: int = 0
    seed: int = 0
    shuffle: ShuffleOptions | None = None
    even: str = "pad"
    samples_per_epoch: int | None = None
    # (epoch, stream position) where that epoch's window starts (samples_per_epoch): epochs after a
    # resize continue the stream where the last epoch at the old world size ended
    origin: tuple[int, int] = (0, 0)
    offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if any((not isinstance(s, (int, np.integer))) or s < 0 for s in self.shard_sizes):
            raise ValueError(f"shard sizes must be ints >= 0, got {self.shard_sizes!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank!r}")
        if self.even not in EVEN_POLICIES:
            raise ValueError(f"even must be one of {EVEN_POLICIES}, got {self.even!r}")
        if self.samples_per_epoch is not None and (
            not isinstance(self.samples_per_epoch, int) or self.samples_per_epoch < 1
        ):
            raise ValueError(f"samples_per_epoch must be an int >= 1 or None, got {self.samples_per_epoch!r}")
        if (not isinstance(self.origin, tuple) or len(self.origin) != 2
                or any(not isinstance(x, int) or x < 0 for x in self.origin)):
            raise ValueError(f"origin must be a pair of ints >= 0 (epoch, stream position), got {self.origin!r}")
        offsets = np.zeros(len(self.shard_sizes) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self.shard_sizes, dtype=np.int64), out=offsets[1:])
        object.__setattr__(self, "offsets", offsets)
        # computed once: total and per_rank are read for every worker's walk and every shard_schedule
        # (a Python sum over 100,000 shard sizes took 20 ms, hundreds of times per epoch start)
        object.__setattr__(self, "_total", int(offsets[-1]))
        object.__setattr__(self, "_layouts", {})  # pass -> (shard order, ends): see _pass_layout
        if self.total == 0:
            raise ValueError("the dataset has no samples (every shard is empty)")
        if self.per_rank == 0:
            raise ValueError(
                f"even='drop' leaves no samples per rank: {self._epoch_len} samples for world_size={self.world_size}"
            )

    @property
    def total(self) -> int:
        """Samples in one pass over all shards."""
        return self._total  # type: ignore[attr-defined, no-any-return]

    @property
    def _epoch_len(self) -> int:
        return self.total if self.samples_per_epoch is None else self.samples_per_epoch

    @property
    def per_rank(self) -> int:
        """Samples each rank yields per epoch (same for every rank)."""
        n, w = self._epoch_len, self.world_size
        return -(-n // w) if self.even == "pad" else n // w

    def worker_counts(self, num_workers: int) -> list[int]:
        """Samples each worker of a rank yields per epoch (``num_workers=0`` counts as 1)."""
        return split_sizes(self.per_rank, max(1, num_workers))

    def shard_order(self, pass_index: int) -> np.ndarray:
        """Shard order of one pass over the data."""
        return self._pass_layout(pass_index)[0]

    def _pass_layout(self, pass_index: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, end position of each shard in that order) of a pass, kept for the last few passes:
        an argsort and a cumsum of every shard, once per pass rather than once per worker and rank."""
        layouts: dict[int, tuple[np.ndarray, np.ndarray]] = self._layouts  # type: ignore[attr-defined]
        layout = layouts.get(pass_index)
        if layout is None:
            n = len(self.shard_sizes)
            if self.shuffle is None:
                order = np.arange(n, dtype=np.int64)
            else:
                order = permutation(rng_key(self.seed, 0, pass_index), n)
            ends = np.cumsum(np.diff(self.offsets)[order])
            order.setflags(write=False)
            ends.setflags(write=False)
            layout = (order, ends)
            if len(layouts) >= 4:
                layouts.clear()
            layouts[pass_index] = layout
        return layout

    def _pass_segments(self, pass_index: int, lo: int, hi: int) -> list[Segment]:
        """Segments of positions [lo, hi) of pass ``pass_index`` (0 <= lo <= hi <= total)."""
        order, ends = self._pass_layout(pass_index)
        sizes = np.diff(self.offsets)
        out: list[Segment] = []
        j = int(np.searchsorted(ends, lo, side="right"))
        while lo < hi and j < len(order):
            start_of_shard = int(ends[j] - sizes[order[j]])
            stop = min(hi, int(ends[j]))
            if stop > lo:
                out.append((int(order[j]), lo - start_of_shard, stop - start_of_shard))
            lo = stop
            j += 1
        return out

    def _range_segments(self, epoch: int, lo: int, hi: int) -> list[Segment]:
        """Segments for positions [lo, hi) of epoch ``epoch`` (padded positions wrap around)."""
        n = self.total
        out: list[Segment] = []
        if self.samples_per_epoch is None:
            base, stream_pass = 0, None
        else:
            base, stream_pass = self.window_start(epoch), True
        q, end = base + lo, base + hi
        while q < end:
            chunk_end = min(end, (q // n + 1) * n)
            pass_index = q // n if stream_pass else epoch
            out.extend(self._pass_segments(pass_index, q % n, q % n + (chunk_end - q)))
            q = chunk_end
        return out

    def window_start(self, epoch: int) -> int:
        """Stream position where ``epoch``'s window starts (``samples_per_epoch``; windows of
        ``per_rank * world_size`` positions, from ``origin`` on)."""
        return max(0, self.origin[1] + (epoch - self.origin[0]) * self.per_rank * self.world_size)

    def worker_segments(self, epoch: int, worker: int, num_workers: int) -> list[Segment]:
        """Shard pieces of ``worker`` (out of ``num_workers``) of this rank, in stream order."""
        nw = max(1, num_workers)
        if not 0 <= worker < nw:
            raise ValueError(f"worker must be in [0, {nw}), got {worker!r}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch!r}")
        sizes = split_sizes(self.per_rank, nw)
        lo = self.rank * self.per_rank + sum(sizes[:worker])
        return self._range_segments(epoch, lo, lo + sizes[worker])

    def worker_indices(self, epoch: int, worker: int, num_workers: int) -> np.ndarray:
        """Global sample indices ``worker`` yields in ``epoch``, in order (int64 array)."""
        segs = self.worker_segments(epoch, worker, num_workers)
        key = rng_key(self.seed, 1, epoch, self.rank, max(1, num_workers), worker)
        return mix_segments(segs, self.offsets, self.shuffle, key)

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shards, positions in their shards) of global sample indices (int64 arrays)."""
        shards = np.searchsorted(self.offsets, indices, side="right") - 1
        return shards, indices - self.offsets[shards]


# ---------------------------------------------------------------------------------------------
# Resume


Stage = tuple[int, tuple[int, ...]]  # (num_workers, consumed positions per worker)


def iteration_stages(resume: Sequence[Stage], num_workers: int) -> list[Stage]:
    """Stages of an iteration with ``num_workers`` that starts from the ``resume`` stages.

    Stage 0 is the plain split of the epoch; stage k+1 splits the samples that stage k left
    unconsumed into ``num_workers`` contiguous parts. A new stage is appended only when the
    worker count changes, so the same worker count continues in exactly the same order.
    """
    nw = max(1, num_workers)
    stages = [(int(n), tuple(int(c) for c in cons)) for n, cons in resume]
    if not stages or stages[-1][0] != nw:
        stages.append((nw, (0,) * nw))
    return stages


def stage_sequences(plan: SplitPlan, epoch: int, stages: Sequence[Stage]) -> list[np.ndarray]:
    """Per-worker sequences of the last stage (all workers)."""
    n0 = stages[0][0]
    seqs = [plan.worker_indices(epoch, w, n0) for w in range(n0)]
    for (n_prev, consumed), (n_next, _) in zip(stages[:-1], stages[1:]):
        _check_consumed(seqs, consumed, n_prev)
        rest = np.concatenate([s[c:] for s, c in zip(seqs, consumed)])
        bounds = np.cumsum([0, *split_sizes(len(rest), n_next)])
        seqs = [rest[bounds[i] : bounds[i + 1]] for i in range(n_next)]
    return seqs


def worker_sequence(plan: SplitPlan, epoch: int, stages: Sequence[Stage], worker: int) -> tuple[np.ndarray, int]:
    """(sequence of ``worker`` in the last stage, positions of it already consumed)."""
    n, consumed = stages[-1]
    if len(stages) == 1:
        seq = plan.worker_indices(epoch, worker, n)
    else:
        seq = stage_sequences(plan, epoch, stages)[worker]
    _check_consumed([seq], (consumed[worker],), n)
    return seq, consumed[worker]


def stage_counts(plan: SplitPlan, stages: Sequence[Stage]) -> list[int]:
    """Sample counts per worker of the last stage, without building sequences."""
    counts = plan.worker_counts(stages[0][0])
    for (_, consumed), (n_next, _) in zip(stages[:-1], stages[1:]):
        counts = split_sizes(sum(c - k for c, k in zip(counts, consumed)), n_next)
    return counts


def _check_consumed(seqs: Sequence[np.ndarray], consumed: Sequence[int], n: int) -> None:
    if len(consumed) != len(seqs):
        raise ValueError(f"resume state has {len(consumed)} worker counts for {n} workers")
    for w, (s, c) in enumerate(zip(seqs, consumed)):
        if not 0 <= c <= len(s):
            raise ValueError(f"resume state: worker {w} consumed {c} of {len(s)} samples")


# ---------------------------------------------------------------------------------------------
# When shards are needed (node-local shard cache: prefetch order and eviction)


def shard_schedule(plan: SplitPlan, epoch: int, ranks: Sequence[int], num_workers: int) -> dict[int, float]:
    """``{shard: time of first need}`` in ``epoch`` for the workers of ``ranks``.

    Time is ``epoch + f`` where ``f`` is the fraction of a worker's samples read before the
    shard's piece starts (every worker advances at about the same rate). Segments only: no index
    sequences are built, so this is cheap for any epoch length.
    """
    nw = max(1, num_workers)
    out: dict[int, float] = {}
    per_rank = plan.per_rank  # the same for every rank
    counts = split_sizes(per_rank, nw)
    for r in ranks:
        if not 0 <= int(r) < plan.world_size:
            raise ValueError(f"rank must be in [0, world_size={plan.world_size}), got {r!r}")
        lo = int(r) * per_rank
        for w in range(nw):
            pos, n = 0, max(1, counts[w])
            # worker_segments of rank r, without a plan per rank (each recomputed the shard order)
            for shard, a, b in plan._range_segments(epoch, lo, lo + counts[w]):
                t = epoch + pos / n
                if t < out.get(shard, math.inf):
                    out[shard] = t
                pos += b - a
            lo += counts[w]
    return out


def read_order(plan: SplitPlan, seq: np.ndarray) -> list[int]:
    """Shards in the order a worker first touches them while reading global indices ``seq``."""
    if len(seq) == 0:
        return []
    shards, _ = plan.locate(np.asarray(seq, dtype=np.int64))
    _, first = np.unique(shards, return_index=True)
    return [int(shards[j]) for j in np.sort(first)]


# ---------------------------------------------------------------------------------------------
# Elastic resume: the rest of an epoch at another world size
#
# An epoch is read in *eras*, one per world size. Era 0 is the plain split above. When a job
# is resumed at another world size, the states of all ranks of the ending era give each rank's
# unconsumed samples; these are concatenated in rank order (each rank's in worker order, each
# worker's in its own order) and cut into contiguous parts, one per new rank, with worker sample
# counts chosen by :func:`elastic_split` so that every new rank yields the same number of
# batches. Everything is index math again: the parts are recomputed, never stored.


@dataclass(frozen=True)
class Era:
    """A stretch of an epoch read at one world size, ended by a resize.

    ``workers``: per rank, its workers' sample counts at the era's start (None for era 0, the
    plain split). ``stages``: per rank, its resume stages when the era ended.
    """

    world_size: int
    workers: tuple[tuple[int, ...], ...] | None
    stages: tuple[tuple[Stage, ...], ...]

    def to_json(self) -> dict:
        return {"world_size": self.world_size,
                "workers": None if self.workers is None else [list(c) for c in self.workers],
                "stages": [[[n, list(c)] for n, c in st] for st in self.stages]}

    @classmethod
    def from_json(cls, data: dict) -> Era:
        try:
            w = int(data["world_size"])
            workers = None if data["workers"] is None else tuple(tuple(int(x) for x in c) for c in data["workers"])
            stages = tuple(tuple((int(n), tuple(int(x) for x in c)) for n, c in st) for st in data["stages"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"resume state: malformed era {data!r:.200}: {e}") from e
        if len(stages) != w or (workers is not None and len(workers) != w):
            raise ValueError(f"resume state: era with world_size={w} lists {len(stages)} ranks")
        return cls(w, workers, stages)


def _split_by(seq: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    bounds = np.cumsum([0, *counts])
    return [seq[bounds[i] : bounds[i + 1]] for i in range(len(counts))]


def _rank_remaining(seqs: list[np.ndarray], stages: Sequence[Stage]) -> np.ndarray:
    """A rank's unconsumed samples after ``stages`` whose stage 0 splits into ``seqs``."""
    stages = list(stages) or [(len(seqs), (0,) * len(seqs))]
    if stages[0][0] != len(seqs):
        raise ValueError(f"resume state: stage 0 has {stages[0][0]} workers, the era split has {len(seqs)}")
    for (n_prev, consumed), (n_next, _) in zip(stages[:-1], stages[1:]):
        _check_consumed(seqs, consumed, n_prev)
        rest = np.concatenate([s[c:] for s, c in zip(seqs, consumed)])
        seqs = _split_by(rest, split_sizes(len(rest), n_next))
    n, consumed = stages[-1]
    _check_consumed(seqs, consumed, n)
    return np.concatenate([s[c:] for s, c in zip(seqs, consumed)]) if seqs else np.zeros(0, np.int64)


def rest_counts(first: Sequence[int], stages: Sequence[Stage], num_workers: int) -> list[int]:
    """Per worker, the samples a rank still yields when it resumes its ``stages`` with ``num_workers``
    (``first``: its workers' counts at the start of the era, as its plan gives them for stage 0)."""
    stages = iteration_stages(stages, num_workers)
    n0 = stages[0][0]
    counts = list(first) if n0 == len(first) else split_sizes(sum(first), n0)
    for (_, consumed), (n_next, _) in zip(stages[:-1], stages[1:]):
        counts = split_sizes(sum(c - k for c, k in zip(counts, consumed)), n_next)
    return [c - k for c, k in zip(counts, stages[-1][1])]


def _rank_remaining_count(counts: list[int], stages: Sequence[Stage]) -> int:
    stages = list(stages) or [(len(counts), (0,) * len(counts))]
    for (_, consumed), (n_next, _) in zip(stages[:-1], stages[1:]):
        counts = split_sizes(sum(c - k for c, k in zip(counts, consumed)), n_next)
    n, consumed = stages[-1]
    if len(consumed) != len(counts) or any(not 0 <= k <= c for c, k in zip(counts, consumed)):
        raise ValueError(f"resume state: consumed {list(consumed)} does not fit worker counts {counts}")
    return sum(c - k for c, k in zip(counts, consumed))


def _era0_plan(plan: SplitPlan, world_size: int, rank: int) -> SplitPlan:
    from dataclasses import replace

    return replace(plan, world_size=world_size, rank=rank)


def elastic_remaining(plan: SplitPlan, eras: Sequence[Era], splits: Sequence[Sequence[Sequence[int]]]) -> int:
    """Samples left after the last of ``eras`` (counts only; ``splits[k]`` = ``eras[k+1].workers``)."""
    left = 0
    for k, era in enumerate(eras):
        left = 0
        for r in range(era.world_size):
            if k == 0:
                n0 = era.stages[r][0][0] if era.stages[r] else 1
                counts = _era0_plan(plan, era.world_size, r).worker_counts(n0)
            else:
                counts = list(era.workers[r])  # type: ignore[index]
            left += _rank_remaining_count(counts, era.stages[r])
    return left


def elastic_parts(plan: SplitPlan, epoch: int, eras: Sequence[Era], split: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Index sequences of each rank of the era that follows ``eras`` (split by ``split``)."""
    parts: list[np.ndarray] = []
    for k, era in enumerate(eras):
        rest = []
        for r in range(era.world_size):
            if k == 0:
                n0 = era.stages[r][0][0] if era.stages[r] else 1
                p = _era0_plan(plan, era.world_size, r)
                seqs = [p.worker_indices(epoch, w, n0) for w in range(n0)]
            else:
                seqs = _split_by(parts[r], era.workers[r])  # type: ignore[index]
            rest.append(_rank_remaining(seqs, era.stages[r]))
        everything = np.concatenate(rest) if rest else np.zeros(0, np.int64)
        nxt = eras[k + 1].workers if k + 1 < len(eras) else split
        sizes = [sum(c) for c in nxt]  # type: ignore[union-attr]
        if sum(sizes) > len(everything):  # even="pad" when no exact split exists: repeat from the start
            if len(everything) == 0:
                raise ValueError(f"resume state: the split needs {sum(sizes)} samples, none remain")
            everything = np.resize(everything, sum(sizes))
        parts = _split_by(everything[: sum(sizes)], sizes)
    return parts


def elastic_split(remaining: int, world_size: int, num_workers: int, batch_size: int | None,
                  drop_last: bool = False, even: str | None = None) -> list[tuple[int, ...]]:
    """Per new rank, its workers' sample counts for ``remaining`` samples: every sample once,
    every rank the same number of batches (``batch_size`` None: single samples).

    Without ``drop_last`` each rank gets ``B = ceil(remaining / (world_size * batch_size))``
    batches; a worker's last batch may be partial. With ``drop_last`` each rank gets
    ``remaining // (world_size * batch_size)`` full batches and the samples left over go into
    partial batches that drop_last discards (as it does in any epoch).

    Such a split exists unless a rank has a single worker (``num_workers`` <= 1) and the last
    round of batches has fewer samples than ranks, or fewer samples than ranks remain. Then
    ``even`` decides: ``"pad"`` repeats the first ``k < world_size`` remaining samples (the counts
    sum to ``remaining + k``), ``"drop"`` leaves the last ``k < world_size`` out (they sum to
    ``remaining - k``), None raises ValueError.
    """
    n, bs, w = max(1, num_workers), max(1, batch_size or 1), world_size
    if drop_last:
        full = remaining // (w * bs)  # 0 (e.g. a state saved at the end of the epoch): no rank yields a batch
        batches = split_sizes(full, n)
        tails = split_sizes(min(remaining - w * full * bs, w * n * (bs - 1)), w)
        return [tuple(b * bs + t for b, t in zip(batches, split_sizes(tails[r], n))) for r in range(w)]
    if remaining == 0:
        return [(0,) * n for _ in range(w)]
    total_b = -(-remaining // (w * bs))
    k = min(n, total_b)
    least = (total_b - k) * bs + k  # fewest samples that make total_b batches on k workers
    if remaining < w * least and even == "pad":
        return elastic_split(w * least, w, num_workers, batch_size)
    if remaining < w * least and even == "drop":  # total_b == 1: fewer than w samples remain, all left out
        return elastic_split(w * (total_b - 1) * bs, w, num_workers, batch_size)
    if remaining < w * least:
        raise ValueError(
            f"elastic resume: {remaining} samples remain; {w} ranks cannot each yield the same number of "
            f"batches of {bs} from them with {n} worker(s) per rank without repeating or dropping samples "
            f"(it needs at least {w * least}). Resume with num_workers >= 2, drop_last=True, another "
            "world size, or at the next epoch")
    extra = split_sizes(remaining - w * least, w)
    per_worker_b = split_sizes(total_b, k)
    out = []
    for r in range(w):
        more = split_sizes(extra[r], k)
        counts = [(b - 1) * bs + 1 + m for b, m in zip(per_worker_b, more)]
        out.append(tuple(counts + [0] * (n - k)))
    return out


@dataclass(frozen=True, eq=False)
class ElasticPlan:
    """The plan of a rank for the rest of an epoch after resizes: like :class:`SplitPlan`, but
    stage 0 is this rank's part of the remaining samples split by ``workers``."""

    base: SplitPlan  # the plan at the current world size (offsets, next epochs)
    epoch: int
    eras: tuple[Era, ...]
    split: tuple[tuple[int, ...], ...]  # per rank of the current era: worker counts
    era_origin: tuple[int, int] = (0, 0)  # the stream origin at the first era's world size (samples_per_epoch)

    @property
    def rank(self) -> int:
        return self.base.rank

    @property
    def world_size(self) -> int:
        return self.base.world_size

    @property
    def offsets(self) -> np.ndarray:
        return self.base.offsets

    @property
    def part(self) -> np.ndarray:
        cached = self.__dict__.get("_part")
        if cached is None:
            from dataclasses import replace

            first = replace(_era0_plan(self.base, self.eras[0].world_size, 0), origin=self.era_origin)
            cached = elastic_parts(first, self.epoch, self.eras, self.split)[self.rank]
            object.__setattr__(self, "_part", cached)
        return cached

    @property
    def per_rank(self) -> int:
        return sum(self.split[self.rank])

    def worker_counts(self, num_workers: int) -> list[int]:
        mine = list(self.split[self.rank])
        return mine if max(1, num_workers) == len(mine) else split_sizes(sum(mine), max(1, num_workers))

    def worker_indices(self, epoch: int, worker: int, num_workers: int) -> np.ndarray:
        if epoch != self.epoch:
            return self.base.worker_indices(epoch, worker, num_workers)
        return _split_by(self.part, self.worker_counts(num_workers))[worker]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.base.locate(indices)
