"""The two objects a loader walks a dataset's epoch with (from :class:`~fastdata.dataset._seam.LoaderSeam`).

* :class:`EpochStart`: where the next iteration of an epoch begins (the resume stages and the
  worker that yields first), from ``dataset.loader_seam.epoch_start(num_workers)``;
* :class:`Cursor`: one (possibly virtual) worker's walk through its index sequence of that epoch,
  from ``dataset.loader_seam.cursor(start, worker)``: its global sample indices (``seq``), the
  position reached (``pos``), reading one sample under the error policy (``load``), the samples
  skipped since the last look (``drain_skips``) and iteration (``iter(cursor)``).

:func:`take_cursor` gives the cursor that yielded the last sample in this thread: torch's
DataLoader collates in the thread that pulled the batch from the dataset (a worker's, or the
loading thread with ``num_workers=0``) right after pulling it, so a collate function reads the exact
position from it. Per thread: two in-process loaders read in two threads at once (a prefetcher's
thread and a validation loop) each see their own. See docs/design/loader-paths.md.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdata.dataset._split import Stage

__all__ = ["Cursor", "EpochStart", "take_cursor"]


@dataclass(frozen=True)
class EpochStart:
    """Where the next iteration of ``epoch`` begins: resume ``stages`` and the worker that yields ``first``."""

    epoch: int
    stages: tuple[Stage, ...]
    first: int
    resumed: bool = field(default=False, compare=False)  # it starts at a state loaded with load_state_dict

    @property
    def num_workers(self) -> int:
        """Workers of this iteration (1 for an in-process iteration)."""
        return self.stages[-1][0]

    @property
    def consumed(self) -> tuple[int, ...]:
        """Samples each worker consumed before this iteration (resume), per worker."""
        return self.stages[-1][1]


_CURRENT = threading.local()  # .cursor: the cursor that yielded last in this thread


def take_cursor() -> Cursor | None:
    """The cursor that yielded the last sample in this thread (None if none since the last call),
    forgotten here so that it (and its dataset) is not kept alive past its batch's collate."""
    cursor = getattr(_CURRENT, "cursor", None)
    _CURRENT.cursor = None
    return cursor


class Cursor:
    """One worker's walk through its index sequence of one epoch (see the module docstring).

    ``seq`` holds the global sample indices the worker reads in the epoch's last stage and
    ``pos`` how many of them were consumed; samples skipped under ``on_error`` are recorded in
    the dataset's ``skipped`` list and collected here until :meth:`drain_skips`.
    """

    def __init__(self, seam: Any, start: EpochStart, worker: int, seq: np.ndarray | None = None):
        n = start.num_workers
        if not 0 <= worker < n:
            raise ValueError(f"worker must be in [0, {n}), got {worker!r}")
        self.seam = seam  # the dataset's LoaderSeam
        self.token: str = seam.token
        self.epoch = start.epoch
        self.stages: list[Stage] = list(start.stages)
        self.worker = worker
        self.pos = start.consumed[worker]
        self.skips: list[dict[str, Any]] = []
        # True for a walk loaded ahead of its consumer (the thread decoder): a skip is only collected
        # here (see pop_skip); the consumer records it in the dataset when it reaches the sample
        self.defer_skips = False
        self._seq = seq

    @property
    def seq(self) -> np.ndarray:
        """Global sample indices of this worker in the epoch (indexed sources only)."""
        if self._seq is None:
            self._seq = self.seam.worker_sequence(self)
        return self._seq

    def locate(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(shards, positions in their shards) of ``seq[lo:hi]``."""
        return self.seam.locate(self.seq[lo:hi])

    def load(self, shard: int, i: int, g: int) -> dict[str, Any] | None:
        """Sample ``i`` of ``shard`` (global index ``g``) decoded and transformed; None if skipped."""
        return self.seam.load_sample(shard, i, g, self)

    def load_uncached(self, shard: int, i: int, g: int) -> dict[str, Any] | None:
        """The fields of a sample that the cache store does not hold; None if skipped."""
        return self.seam.load_uncached(shard, i, g, self)

    def drain_skips(self) -> list[dict[str, Any]]:
        """Skip records since the last call (each also in ``dataset.skipped`` of this process)."""
        out, self.skips = self.skips, []
        return out

    def pop_skip(self, g: int) -> dict[str, Any] | None:
        """The skip record of sample ``g`` collected here (``defer_skips``), removed; None if none.
        Safe while other threads load samples of this walk."""
        for record in list(self.skips):
            if record["index"] == g:
                self.skips.remove(record)
                return record
        return None

    def state_stages(self) -> list[Stage]:
        """The resume stages after the samples consumed so far."""
        n, consumed = self.stages[-1]
        now = list(consumed)
        now[self.worker] = self.pos
        return [*self.stages[:-1], (n, tuple(now))]

    def mark_current(self) -> None:
        """Record this cursor as the one that yielded last in this thread (see :func:`take_cursor`)."""
        _CURRENT.cursor = self

    def __iter__(self) -> Iterator[Any]:
        return self.seam.iterate(self)
