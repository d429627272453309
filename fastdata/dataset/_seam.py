"""LoaderSeam: the protocol between a ShardedDataset and the loader stage.

Everything a loader needs from a dataset that a user does not goes through this one object,
``dataset.loader_seam``: where an iteration of an epoch starts (:class:`EpochStart`), the walks of its
(possibly virtual) workers (:class:`Cursor`: index sequences, positions, one sample's load), the
positions a loader's ``state_dict()`` records, the cache store, and the skip records and markers that
travel with batches. ``fastdata.DataLoader`` (worker, thread and cached paths), the cache filler and the
next-epoch preload of persistent workers use nothing else. The seam is a view: it holds only the
dataset, and every call acts on the dataset's state (copies in worker processes included).
See docs/design/loader-paths.md.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fastdata.cache import Store  # at run time too: typing.get_type_hints resolves the hints
from fastdata.dataset._cursor import Cursor, EpochStart
from fastdata.dataset._dist import in_worker
from fastdata.dataset._resume import check_resume_dist, load_state, state_of
from fastdata.dataset._schedule import BatchSchedule
from fastdata.dataset._split import (
    Stage,
    check_consumed,
    iteration_stages,
    split_sizes,
    stage_counts,
    stage_sequences,
    worker_sequence,
)
from fastdata.dataset._stream import check_stream_stages, iter_stream

__all__ = ["LoaderSeam"]

_LOCATE_CHUNK = 1024  # samples whose shards are located at once (bounded memory for long epochs)


class LoaderSeam:
    """The loader's view of one :class:`~fastdata.ShardedDataset` (see the module docstring)."""

    __slots__ = ("dataset",)

    def __init__(self, dataset: Any):  # a ShardedDataset (whose module imports this one)
        self.dataset = dataset

    # ----- identity and sizes ------------------------------------------------------------------
    @property
    def token(self) -> str:
        """Identifies the dataset object (and its copies in worker processes) in cursors."""
        return self.dataset._token

    @property
    def has_cache(self) -> bool:
        """True when the dataset was created with ``cache=``."""
        return self.dataset._samples.cache is not None

    def resolve_dist(self) -> None:
        """Rank and world size now: explicit, else torch.distributed (main process only)."""
        self.dataset._resolve_dist(stacklevel=4)

    def worker_counts(self, num_workers: int) -> list[int]:
        """Samples each of ``num_workers`` DataLoader workers yields in a full epoch (the rest of an
        epoch resumed at another world size: as its elastic split gives them)."""
        ds = self.dataset
        if not ds.source.streaming:
            if not in_worker():
                ds._resolve_dist()
                ds._warn_unsplit()
            return list(ds._plan().worker_counts(num_workers))
        return split_sizes(ds._per_rank(), max(1, num_workers))

    def batches_per_epoch(self, batch_size: int | None, *, num_workers: int = 0, drop_last: bool = False) -> int:
        """Batches a DataLoader yields per full epoch (every worker yields its own last partial batch)."""
        return BatchSchedule(num_workers, batch_size, drop_last).total(self.worker_counts(num_workers))

    # ----- where an iteration starts, and its walks ----------------------------------------------
    def epoch_start(self, num_workers: int, epoch: int | None = None) -> EpochStart:
        """Where the next iteration of ``epoch`` (default: the current one) with ``num_workers`` begins.

        Applies a loaded resume state without consuming it (see :meth:`consume_resume`).
        """
        ds = self.dataset
        epoch = ds.epoch if epoch is None else epoch
        stages: list[Stage] = []
        first = 0
        check_resume_dist(ds)
        if not in_worker():
            ds._warn_unsplit()
        point = ds._resume.point
        if point is not None and point[0] == epoch:
            stages, first = list(point[1]), point[2]
        out = iteration_stages(stages, num_workers)
        if ds.source.streaming:  # in the main process, before any worker starts
            check_stream_stages(ds, out)
        return EpochStart(epoch, tuple(out), first if len(out) == len(stages) else 0,
                          resumed=point is not None and point[0] == epoch)

    def resume_pending(self) -> bool:
        """A state loaded with ``load_state_dict`` waits for the next iteration of the current epoch."""
        point = self.dataset._resume.point
        return point is not None and point[0] == self.dataset.epoch

    def consume_resume(self) -> None:
        """The resume state was handed to an iteration (workers hold copies): apply it only once."""
        self.dataset._resume = replace(self.dataset._resume, point=None)

    def cursor(self, start: EpochStart, worker: int, *, seq: Any = None, live: bool = False) -> Cursor:
        """The walk of ``worker`` through its part of ``start``'s epoch (``seq``: its index
        sequence, if the caller computed it with :meth:`sequences_at`). ``live``: the dataset's
        ``state_dict()`` in this process follows it."""
        cursor = Cursor(self, start, worker, seq)
        self.dataset._samples.track(cursor)
        if live:
            self.dataset._live = cursor
        return cursor

    def counts_at(self, start: EpochStart) -> list[int]:
        """Samples each worker of ``start``'s last stage yields in the whole stage (no sequences built)."""
        return stage_counts(self.dataset._plan(), start.stages)

    def sequences_at(self, start: EpochStart) -> list[np.ndarray]:
        """Index sequences of every worker of ``start``'s last stage."""
        seqs = stage_sequences(self.dataset._plan(), start.epoch, start.stages)
        check_consumed(seqs, start.consumed, start.num_workers)
        return seqs

    def worker_sequence(self, cursor: Cursor) -> np.ndarray:
        """Index sequence of ``cursor``'s worker."""
        return worker_sequence(self.dataset._plan(), cursor.epoch, cursor.stages, cursor.worker)[0]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shards, positions in their shards) of global sample indices."""
        return self.dataset._plan().locate(indices)

    def state_at(self, epoch: int, stages: Sequence[Stage], next_worker: int = 0) -> dict[str, Any]:
        """The ``state_dict()`` of a position: ``stages`` consumed of ``epoch``, ``next_worker`` yields next."""
        return state_of(self.dataset, epoch, stages, next_worker)

    def check_state(self, state: Any, batch_size: int | None, num_workers: int, drop_last: bool) -> None:
        """StateError if ``dataset.load_state_dict(state, batch_size=..., num_workers=..., drop_last=...)``
        would raise one; changes nothing (a loader checks a state before it changes anything of its own)."""
        load_state(self.dataset, state, batch_size, num_workers, drop_last, apply=False)

    def iterate(self, cursor: Cursor) -> Iterator[Any]:
        """The samples of ``cursor`` from its position on, advancing it (``iter(cursor)``)."""
        if self.dataset.source.streaming:
            return iter_stream(self.dataset, cursor)
        return _iter_indexed(self.dataset, cursor)

    # ----- samples ------------------------------------------------------------------------------
    def cache_store(self) -> Store | None:
        """The cache store the dataset reads and fills (None without ``cache=``), open in this process."""
        return self.dataset._samples.cache_store(self.dataset)

    def load_sample(self, shard: int, i: int, g: int, cursor: Cursor) -> Any:
        """Sample ``i`` of ``shard`` (global index ``g``) decoded, preprocessed (cache hit or fill) and
        transformed; None when ``on_error`` skipped it (recorded on ``cursor``)."""
        return self.dataset._samples.load(self.dataset, shard, i, g, cursor)

    def load_uncached(self, shard: int, i: int, g: int, cursor: Cursor) -> dict[str, Any] | None:
        """The fields of a sample the cache store does not hold, under the error policy (None: skipped)."""
        return self.dataset._samples.load_uncached(self.dataset, shard, i, g, cursor)

    def transform_cached(self, fields: dict[str, Any], g: int, epoch: int) -> dict[str, Any]:
        """``transform=`` on the cached (image) ``fields`` of sample ``g`` in ``epoch``, as a worker applies it
        to them (with the sample's generator when the transform takes one): the cached fast path's rows."""
        ds, samples = self.dataset, self.dataset._samples
        seeded = (ds.seed, epoch, g) if samples._takes_generator(ds.transform) else None
        return samples.apply(ds.transform, fields, seeded)

    # ----- skip records and worker behaviour ------------------------------------------------------
    def begin_skip_budget(self) -> None:
        """A pass over an epoch starts in this process: ``max_skips`` counts from zero again."""
        self.dataset._skips.begin_budget(self.dataset)

    def record_skips(self, records: Sequence[dict[str, Any]]) -> None:
        """Skip records that reached this process from a worker: warned (``on_error="warn"``) in batch
        order, added to ``skipped`` and counted (tar members left out are only listed)."""
        self.dataset._skips.receive(self.dataset, records)

    # Skip records a walk collected ahead of the consumer (``Cursor.defer_skips``), now that the consumer
    # reaches their batch: handled as a worker's (an alias: the warnings' stack level stays the caller's)
    record_deferred_skips = record_skips

    def report_skips_inline(self, schedule: BatchSchedule) -> None:
        """Set by ``fastdata.DataLoader`` while it starts its workers (then :meth:`stop_skip_reports`):
        their copies of the dataset end a walk that skipped samples since its last yield with
        :class:`~fastdata.dataset.SkipReport` markers (``schedule.end_markers()`` of them), which the
        loader's collate turns into a report-only result, so skips after a worker's last batch (or of a
        worker that yields nothing) reach the main process through the ordinary result queue."""
        self.dataset._skips.inline = schedule

    def stop_skip_reports(self) -> None:
        """Plain torch loaders over the dataset get samples only (see :meth:`report_skips_inline`)."""
        self.dataset._skips.inline = None

    def preload_next_epoch(self, samples: int) -> None:
        """Set by ``fastdata.DataLoader`` while it starts persistent workers (0 after): their copies
        load the first ``samples`` positions of their walk of the next epoch while they wait for it
        (see :mod:`fastdata.dataset._preload`)."""
        self.dataset._preload_samples = max(0, int(samples))


def _iter_indexed(ds: Any, cursor: Cursor) -> Iterator[Any]:
    """The walk of an indexed source: samples read by position, shards located per chunk."""
    seq = cursor.seq
    samples = ds._samples
    if ds.source.node_cache is not None:  # remote manifest: prefetch order and eviction plan
        ds.source.plan_reads(ds._plan(), cursor.epoch, seq[cursor.pos:], cursor.stages[-1][0],
                             cursor.pos / max(1, len(seq)))
    for lo in range(cursor.pos, len(seq), _LOCATE_CHUNK):  # shards located per chunk, not per sample
        part = seq[lo : lo + _LOCATE_CHUNK]
        shards, local = ds._plan().locate(part)
        for pos, g, shard, i in zip(range(lo + 1, lo + len(part) + 1), part.tolist(), shards.tolist(),
                                    local.tolist()):
            sample = samples.load(ds, shard, i, g, cursor)
            cursor.pos = pos
            if sample is None:
                continue
            cursor.mark_current()
            yield sample
    yield from ds._skips.end_of_walk(cursor)
