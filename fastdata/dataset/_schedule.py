"""BatchSchedule: how a DataLoader over a ShardedDataset deals batches (the one statement of it).

Every loader path (worker processes, the thread decoder, the cached fast path) yields the same
batches because each follows this schedule:

* each (possibly virtual) worker batches its own walk: ``batch_size`` samples that load (a sample
  skipped under ``on_error`` does not count); its last batch is partial, or dropped by ``drop_last``;
* batches are dealt round-robin over the workers from the one that yields first, skipping the
  exhausted ones (torch's order for an IterableDataset): a turn that loads less than a full batch
  ends its worker's walk;
* a worker whose walk ends in skipped samples after its last batch (or in a partial batch that
  ``drop_last`` drops) reports its end position without a batch, so a resume does not read them again.

Pure arithmetic (no torch, no I/O). See docs/design/loader-paths.md.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BatchSchedule", "Dealing", "Turn"]


class Turn(enum.Enum):
    """What one worker's turn gives the consumer."""

    BATCH = "batch"  # a batch to yield
    END = "end"  # no batch; the walk ended in skipped samples: its end position is reported
    NOTHING = "nothing"  # no batch and nothing to report


@dataclass(frozen=True)
class BatchSchedule:
    """The batches of an iteration with ``num_workers`` workers (0 and 1: one walk).

    ``batch_size`` None is torch's "no automatic batching": every sample is its own batch.
    """

    num_workers: int
    batch_size: int | None
    drop_last: bool = False

    @property
    def size(self) -> int:
        """Samples of a full batch."""
        return self.batch_size or 1

    @property
    def workers(self) -> int:
        """Walks of the iteration (at least one)."""
        return max(1, self.num_workers)

    @property
    def shape(self) -> tuple[int, int, bool]:
        """What decides the batch counts: (batch size, walks, drop_last), normalised: None and 1 are single
        samples, 0 and 1 workers one walk, and drop_last of single samples drops nothing."""
        size = max(1, int(self.size))
        return (size, max(1, int(self.num_workers)), bool(self.drop_last) and size > 1)

    def batches(self, samples: int) -> int:
        """Batches a worker yields from ``samples`` samples that load."""
        b = self.size
        return samples // b if self.drop_last else -(-samples // b)

    def total(self, counts: Sequence[int]) -> int:
        """Batches of an iteration whose workers load ``counts[w]`` samples each."""
        return sum(self.batches(c) for c in counts)

    def yields(self, samples: int) -> bool:
        """Whether a turn that loaded ``samples`` samples yields a batch (partial only without ``drop_last``)."""
        return samples == self.size or (samples > 0 and not self.drop_last)

    def end_markers(self) -> int:
        """End-of-walk markers a worker process sends after skipped samples: enough for torch's fetch to
        make a batch of them (a whole batch with ``drop_last``, which drops a partial one)."""
        return self.size if self.drop_last else 1

    def next_worker(self, last: int | None, first: int, left: Sequence[int] | None) -> int:
        """The worker of the batch after ``last`` (None: none yet, so ``first``); ``left[w]``: samples
        worker ``w`` has left (None when unknown: plain round-robin)."""
        if last is None:
            return first
        n = self.workers
        if left is None or n == 1:
            return 0 if n == 1 else (last + 1) % n
        for d in range(1, n + 1):
            w = (last + d) % n
            if self.batches(left[w]) > 0:
                return w
        return (last + 1) % n

    def deal(self, first: int) -> Dealing:
        """The turns of one iteration whose first batch comes from worker ``first``."""
        return Dealing(self, first)


class Dealing:
    """The round-robin turns of one iteration: :meth:`next` names the worker whose turn it is,
    :meth:`settle` says what its turn gives and retires it when its walk ended."""

    __slots__ = ("_w", "active", "schedule")

    def __init__(self, schedule: BatchSchedule, first: int):
        self.schedule = schedule
        self.active = [True] * schedule.workers  # workers not yet exhausted
        self._w = first

    def next(self) -> int | None:
        """The next worker that is not exhausted (None: the iteration is over)."""
        n = len(self.active)
        for _ in range(n):
            w = self._w
            self._w = (w + 1) % n
            if self.active[w]:
                return w
        return None

    def settle(self, worker: int, samples: int, skipped: bool) -> Turn:
        """The outcome of ``worker``'s turn, which loaded ``samples`` samples (``skipped``: samples were
        skipped on the way); a turn short of a full batch ends the worker's walk."""
        self.active[worker] = samples == self.schedule.size
        if self.schedule.yields(samples):
            return Turn.BATCH
        return Turn.END if skipped else Turn.NOTHING
