"""SkipLog: where a ShardedDataset's skip records go, and its failure budget (``max_skips``).

A sample skipped under ``on_error``/``on_missing`` becomes one record ``{"shard", "key", "index",
"epoch", "reason"}`` (a tar member that gives no data also has ``member`` and is never counted). Records
are listed in the dataset's ``skipped`` of the process the consumer runs in: a ``fastdata.DataLoader``
worker's ride to the main process with its batches (a walk ending in skips sends :class:`SkipReport`
markers so that they arrive too), and a walk loaded ahead of its consumer (``Cursor.defer_skips``) hands
them over when the consumer reaches their batch. The budget counts the samples skipped in one pass over
an epoch in that process; one more than ``max_skips`` raises ``SkipBudgetError``.
See docs/design/loader-paths.md.
"""
from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fastdata.dataset._dist import in_worker
from fastdata.dataset._schedule import BatchSchedule
from fastdata.errors import SkipBudgetError

__all__ = ["SkipLog", "SkipReport", "SkippedSampleWarning"]


class SkipReport:
    """End-of-walk marker of a DataLoader worker that skipped samples after its last yield.

    Yielded only to ``fastdata.DataLoader`` workers (never to plain torch loaders); its collate
    function drops it and sends the worker's pending skip records and final position instead.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "SkipReport()"


class SkippedSampleWarning(UserWarning):
    """A sample could not be read or decoded and was skipped (``on_error="warn"``)."""


def _warn_skip(record: Mapping[str, Any], stacklevel: int) -> None:
    """``on_error="warn"``: the SkippedSampleWarning of a skip record (``stacklevel`` counted from the caller)."""
    warnings.warn(f"skipped sample {record['key']!r} of shard {record['shard']}: {record['reason']}",
                  SkippedSampleWarning, stacklevel=stacklevel)


class SkipLog:
    """The skip reports and the budget of one dataset in this process. The dataset's ``skipped``,
    ``on_error`` and ``max_skips`` are read at each call (``ds``): changing them takes effect.

    A copy made for another process (or by ``copy.copy``) counts from zero.
    """

    def __init__(self, skipped: list[dict[str, Any]], inline: BatchSchedule | None = None):
        # set by the loader while it starts worker processes: their walks end in SkipReport markers
        self.inline = inline
        self._lock = threading.Lock()
        self._count = 0  # skips counted against max_skips since begin_budget() (this process)
        self._first = len(skipped)  # where this pass's records start in the dataset's ``skipped``

    def __reduce__(self) -> tuple[Any, ...]:
        return (SkipLog, ([], self.inline))  # another process's log counts from zero (see ShardedDataset)

    def begin_budget(self, ds: Any) -> None:
        """A pass over an epoch of ``ds`` starts in this process: ``max_skips`` counts from zero again."""
        with self._lock:
            self._count = 0
            self._first = len(ds.skipped)

    def rides_to_main(self) -> bool:
        """True in a fastdata.DataLoader worker: its skip records reach the main process with its batches."""
        return self.inline is not None and in_worker()

    def add(self, ds: Any, record: dict[str, Any], cursor: Any) -> None:
        """Record a sample ``cursor``'s walk skipped (``ds.skipped``, the cursor's report, the budget)."""
        # Deferred ones are listed and warned in receive() when the consumer reaches the sample, and so
        # are a fastdata.DataLoader worker's when they reach the main process: kept in the worker too, nothing
        # would read them and a persistent worker's copy would grow by every skip of the run, and a warning
        # emitted in the worker never reaches the job's filters or logging.
        here = not cursor.defer_skips and not self.rides_to_main()
        if here:
            with self._lock:
                ds.skipped.append(record)
        cursor.skips.append(record)
        if ds.on_error == "warn" and here:
            _warn_skip(record, stacklevel=6)
        if not in_worker() and not cursor.defer_skips:  # a worker's are counted when they reach the main process
            self.count(ds, 1)

    def add_left_out(self, ds: Any, records: list[dict[str, Any]], cursor: Any) -> None:
        """Tar members a streamed shard left out (with ``member``; never counted)."""
        if self.rides_to_main():
            cursor.skips.extend(records)
        else:
            with self._lock:
                ds.skipped.extend(records)

    def receive(self, ds: Any, records: Sequence[dict[str, Any]]) -> None:
        """Skip records that reached this process from a worker or a walk loaded ahead: warn
        (``on_error="warn"``), in batch order, list them, count them (tar members left out are only listed)."""
        samples = [r for r in records if "member" not in r]
        if ds.on_error == "warn":
            for r in samples:
                _warn_skip(r, stacklevel=4)
        if records:
            with self._lock:
                ds.skipped.extend(records)
            if samples:
                self.count(ds, len(samples))

    def count(self, ds: Any, n: int) -> None:
        """Count ``n`` skipped samples of ``ds``'s current pass; SkipBudgetError past ``max_skips``."""
        max_skips = ds.max_skips
        if max_skips is None:
            return
        if isinstance(max_skips, float):
            per_rank = ds._per_rank()
            limit, what = math.floor(max_skips * per_rank), f"{max_skips:g} of the {per_rank} samples"
        else:
            limit, what = max_skips, "samples"
        with self._lock:
            self._count += n
            count = self._count
            # the records only for the error: copied at every skip, they made an epoch's skips cost quadratic time
            records = ([r for r in ds.skipped[self._first:] if "member" not in r]  # samples, not tar members
                       if count > limit else [])
        if count > limit:
            shown = "; ".join(f"{r['shard']}: {r['key']!r}: {r['reason']}" for r in records[:3])
            more = f" (and {len(records) - 3} more)" if len(records) > 3 else ""
            raise SkipBudgetError(f"{count} samples skipped in this pass over epoch {ds.epoch}: more than "
                                  f"max_skips={max_skips!r} allows ({limit} {what}); skipped: {shown}{more} "
                                  "(all in SkipBudgetError.skipped)", records)

    def end_of_walk(self, cursor: Any) -> Iterator[SkipReport]:
        """The markers a DataLoader worker's walk ends with when it skipped samples since its last yield."""
        if self.inline is not None and cursor.skips and in_worker():
            cursor.mark_current()
            for _ in range(self.inline.end_markers()):
                yield SkipReport()
