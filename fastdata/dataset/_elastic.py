"""Elastic resume: the rest of an epoch at another world size, split for equal batch counts per rank.

An epoch is read in *eras*, one per world size. Era 0 is the plain split. When a job is resumed at
another world size, the states of all ranks of the ending era give each rank's unconsumed samples;
these are concatenated in rank order (each rank's in worker order, each worker's in its own order)
and cut into contiguous parts, one per new rank, with worker sample counts chosen by
:func:`elastic_split` so that every new rank yields the same number of batches. Everything is index
math again: the parts are recomputed, never stored. See docs/design/resume.md.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from fastdata.dataset._split import (
    SplitPlan,
    Stage,
    check_consumed,
    iteration_stages,
    last_stage_counts,
    resplit,
    split_sizes,
)

__all__ = ["ElasticPlan", "Era", "elastic_parts", "elastic_remaining", "elastic_split", "rest_counts"]


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
        check_consumed(seqs, consumed, n_prev)
        rest = np.concatenate([s[c:] for s, c in zip(seqs, consumed)])
        seqs = _split_by(rest, split_sizes(len(rest), n_next))
    n, consumed = stages[-1]
    check_consumed(seqs, consumed, n)
    return np.concatenate([s[c:] for s, c in zip(seqs, consumed)]) if seqs else np.zeros(0, np.int64)


def rest_counts(first: Sequence[int], stages: Sequence[Stage], num_workers: int) -> list[int]:
    """Per worker, the samples a rank still yields when it resumes its ``stages`` with ``num_workers``
    (``first``: its workers' counts at the start of the era, as its plan gives them for stage 0)."""
    stages = iteration_stages(stages, num_workers)
    counts = last_stage_counts(resplit(first, stages[0][0]), stages)
    return [c - k for c, k in zip(counts, stages[-1][1])]


def _rank_remaining_count(counts: list[int], stages: Sequence[Stage]) -> int:
    stages = list(stages) or [(len(counts), (0,) * len(counts))]
    counts = last_stage_counts(counts, stages)
    n, consumed = stages[-1]
    if len(consumed) != len(counts) or any(not 0 <= k <= c for c, k in zip(counts, consumed)):
        raise ValueError(f"resume state: consumed {list(consumed)} does not fit worker counts {counts}")
    return sum(c - k for c, k in zip(counts, consumed))


def _era0_plan(plan: SplitPlan, world_size: int, rank: int) -> SplitPlan:
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
            first = replace(_era0_plan(self.base, self.eras[0].world_size, 0), origin=self.era_origin)
            cached = elastic_parts(first, self.epoch, self.eras, self.split)[self.rank]
            object.__setattr__(self, "_part", cached)
        return cached

    @property
    def per_rank(self) -> int:
        return sum(self.split[self.rank])

    def worker_counts(self, num_workers: int) -> list[int]:
        return resplit(self.split[self.rank], num_workers)

    def worker_indices(self, epoch: int, worker: int, num_workers: int) -> np.ndarray:
        if epoch != self.epoch:
            return self.base.worker_indices(epoch, worker, num_workers)
        return _split_by(self.part, self.worker_counts(num_workers))[worker]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.base.locate(indices)
