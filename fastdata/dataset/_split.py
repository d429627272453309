"""Pure index math behind :class:`fastdata.ShardedDataset`: which samples a (rank, worker) reads, in which order.

Everything is computed from ``(shard sizes, seed, epoch, rank, world_size, worker, num_workers)``
(no I/O, no torch): the stream of passes over the data (shard order shuffled per pass), its cut
into equal contiguous parts per rank (``even="pad"`` repeats from the epoch's start, ``"drop"`` drops
the tail) and per worker (sizes depend only on the part size, so every rank has the same batch
counts), each worker's mixing (:mod:`._mix`), and resume stages: a worker's order is a pure function
of the above, so resuming regenerates it and skips the consumed prefix; another worker count splits
the workers' remaining indices again. Elastic resume is :mod:`._elastic`; random numbers :mod:`fastdata._rng`.
See docs/design/split.md.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
# np.unique imports numpy.ma on its first call. A fork while another thread is in that import (a thread
# decoder's split) leaves the module's import lock held in the child forever: the worker hung at its own
# first np.unique. Imported here, before any thread or fork of ours.
import numpy.ma  # noqa: F401

from fastdata.dataset._mix import Segment, ShuffleOptions, mix_segments
from fastdata._rng import permutation, rng_key

__all__ = ["EVEN_POLICIES", "ShuffleOptions", "SplitPlan", "Stage", "check_consumed", "iteration_stages",
           "last_stage_counts", "read_order", "resplit", "shard_schedule", "split_sizes", "stage_counts",
           "stage_sequences", "stage_walk", "worker_sequence"]

EVEN_POLICIES = ("pad", "drop")


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
        # (a Python sum over every shard size, hundreds of times per epoch start)
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
        check_consumed(seqs, consumed, n_prev)
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
    check_consumed([seq], (consumed[worker],), n)
    return seq, consumed[worker]


def resplit(counts: Sequence[int], num_workers: int) -> list[int]:
    """A rank's worker sample counts ``counts`` for ``num_workers`` workers: the same for as many workers,
    else the rank's samples split evenly again (the first stage of the rest of an elastic resume)."""
    n = max(1, num_workers)
    return list(counts) if len(counts) == n else split_sizes(sum(counts), n)


def stage_walk(first: Sequence[int], stages: Sequence[Stage]) -> Iterator[tuple[int, list[int], tuple[int, ...]]]:
    """``(k, sample counts of stage k's workers, their consumed positions)`` for every stage of ``stages``:
    stage 0's counts are ``first``, each later stage splits what the one before left (a lazy walk: a
    consumer that checks a stage's positions does so before the next stage's counts are made of them)."""
    counts = list(first)
    for k, (n, consumed) in enumerate(stages):
        if k:
            counts = split_sizes(sum(c - p for c, p in zip(counts, stages[k - 1][1])), n)
        yield k, counts, consumed


def last_stage_counts(first: Sequence[int], stages: Sequence[Stage]) -> list[int]:
    """Sample counts of the last stage's workers (``first``: stage 0's; see :func:`stage_walk`)."""
    counts = list(first)
    for _, counts, _ in stage_walk(first, stages):
        pass
    return counts


def stage_counts(plan: SplitPlan, stages: Sequence[Stage]) -> list[int]:
    """Sample counts per worker of the last stage, without building sequences."""
    return last_stage_counts(plan.worker_counts(stages[0][0]), stages)


def check_consumed(seqs: Sequence[np.ndarray], consumed: Sequence[int], n: int) -> None:
    if len(consumed) != len(seqs):
        raise ValueError(f"resume state has {len(consumed)} worker counts for {n} workers")
    for w, (s, c) in enumerate(zip(seqs, consumed)):
        if not 0 <= c <= len(s):
            raise ValueError(f"resume state: worker {w} consumed {c} of {len(s)} samples")


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
