"""The cached fast path of :class:`fastdata.DataLoader`: batches gathered from a complete cache store.

When a cache store holds every sample an epoch reads (all but :data:`MISSING_FRACTION`, loaded here)
and nothing per sample needs a worker process (no ``sample_transform=``; no ``transform=`` unless
``cached_fast_path=True`` and it takes a seeded ``generator``: then it runs here, per row), the
batches are made in the calling process: one gather per batch for the cached (image) fields
(``_gather.FastGather``: numpy row copies into reused, optionally page-locked buffers), a per-sample
read of the others, memoized across epochs (:class:`MetaMemo`), collated by the loader's
``collate_fn``. The virtual workers' sequences are those worker processes would read, and batches are
dealt by :class:`~fastdata.dataset.BatchSchedule`, so content, order, partial batches, skips and
resume state are the worker path's. It runs in the calling thread, without read-ahead.
See docs/design/loader-paths.md.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from fastdata.dataset import BatchSchedule, Cursor, EpochStart, LoaderSeam, ShardedDataset, Turn
from fastdata.errors import CacheError
from fastdata.loader._gather import FastGather
from fastdata.transforms import accepts_generator

__all__ = [
    "FAST_PATH_MODES",
    "MISSING_FRACTION",
    "FastBatch",
    "cached_batches",
    "check_mode",
    "pin_device",
    "plan_fast_epoch",
    "static_reason",
]

FAST_PATH_MODES = ("auto", True, False)
# Samples of an epoch that may be missing from the store on the fast path: they are read, decoded
# and filled in the calling process (those that fail to decode are never filled, so a dataset
# with a few bad samples and on_error="skip" would otherwise never take the fast path).
MISSING_FRACTION = 0.001


def check_mode(value: Any) -> str | bool:
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"cached_fast_path must be 'auto', True or False, got {value!r}")


def static_reason(ds: Any, *, batch_size: int | None, collate_fn: Callable[[Any], Any],
                  worker_init_fn: Any, forced: bool) -> str | None:
    """Why the fast path cannot serve this loader whatever the store holds (None: it can)."""
    if not isinstance(ds, ShardedDataset):
        return f"the dataset is a {type(ds).__name__}, not a fastdata.ShardedDataset"
    if not ds.loader_seam.has_cache:
        return "the dataset has no cache= store"
    if ds.transform is not None and not (forced and accepts_generator(ds.transform)):
        return ("transform= runs per sample (in the workers; cached_fast_path=True runs one that has a generator "
                "parameter in this process)")
    if ds.sample_transform is not None:
        return "sample_transform= runs per sample (in the workers)"
    if batch_size is None:
        return "batch_size=None (no automatic batching)"
    if not forced:
        if collate_fn is not default_collate:
            return "a custom collate_fn is set (cached_fast_path=True runs it in this process)"
        if worker_init_fn is not None:
            return "worker_init_fn= is set (cached_fast_path=True skips it: no workers are started)"
    return None


def plan_fast_epoch(ds: ShardedDataset, store: Any, start: EpochStart) -> tuple[list[np.ndarray], frozenset[int]] | str:
    """(per-virtual-worker index sequences, samples to compute in this process), or why the
    store cannot serve the rest of the epoch."""
    epoch = start.epoch
    seam = ds.loader_seam
    counts = seam.counts_at(start)
    need = sum(c - k for c, k in zip(counts, start.consumed))
    allowed = int(need * MISSING_FRACTION)
    have = store.num_valid()
    # distinct samples needed >= need - (world_size - 1) padded repeats, without samples_per_epoch
    if have < store.num_samples and ds.samples_per_epoch is None and have < need - ds.world_size + 1 - allowed:
        return (f"cache store {store.path} has {have} of {store.num_samples} samples filled; rank {ds.rank} reads "
                f"{need} in epoch {epoch} (at most {allowed} may be missing)")
    seqs = seam.sequences_at(start)
    missing: frozenset[int] = frozenset()
    if have < store.num_samples:
        missing = frozenset(store.missing(np.concatenate([s[c:] for s, c in zip(seqs, start.consumed)])).tolist())
        if len(missing) > allowed:
            return (f"cache store {store.path} lacks {len(missing)} of the samples rank {ds.rank} reads in epoch "
                    f"{epoch} (e.g. sample {min(missing)}; at most {allowed} may be missing)")
    return seqs, missing


def pin_device() -> str | None:
    """The device torch's DataLoader would pin for (None: no pinning), with torch's warning."""
    if not torch.accelerator.is_available():
        warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                      "then device pinned memory won't be used.", stacklevel=4)
        return None
    acc = torch.accelerator.current_accelerator()
    return None if acc is None or acc.type == "mps" else acc.type


# Samples whose uncached fields (``__key__``, labels, ...) the fast path keeps in memory after their
# first read, per loader: reading them from the shards is Python work per sample, which capped the
# cached epoch far below what the row gather delivers (GIL-held Python per batch of 128: 3440 vs 259
# microseconds, ``cached_first`` vs ``cached_steady`` in benchmarks/results/producer_overhead_cpu2.json).
# Only small, immutable values are kept (about 300 bytes per sample: at most ~300 MB at the limit).
META_MEMO_MAX = 1_000_000
_SCALARS = (int, float, bool, type(None))
# Column kinds: exact value type -> (numpy dtype of the column, how default_collate turns a list of them
# into the batch value). Strings and bytes stay Python objects; default_collate returns their list.
_INT64 = (-(1 << 63), (1 << 63) - 1)
_KINDS: dict[type, Any] = {int: np.int64, float: np.float64, bool: np.bool_, str: object, bytes: object}


def _memoizable(meta: dict[str, Any]) -> bool:
    for v in meta.values():
        if isinstance(v, _SCALARS):
            continue
        if isinstance(v, (str, bytes)) and len(v) <= 256:
            continue
        return False
    return True


class MetaMemo:
    """The small uncached fields of samples read before, by global index, kept as columns.

    While every memoized sample has the same fields (same order) and each field one exact type
    (``int`` within int64, ``float``, ``bool``, ``str`` or ``bytes``), the memo is *regular*:
    :meth:`collate` then builds a batch's fields with one NumPy take per field, exactly what
    ``default_collate`` makes of the samples' dicts (int64/float64/bool tensors, lists of str/bytes),
    with no Python loop over the samples (GIL-held Python per batch of 128: 259 vs 828 microseconds
    with the per-sample loop, ``cached_steady`` vs ``cached_per_sample`` in
    benchmarks/results/producer_overhead_cpu2.json). Any other sample makes it irregular for good
    (``get`` still serves every memoized sample; batches then go through the per-sample path).
    """

    def __init__(self, limit: int = META_MEMO_MAX) -> None:
        self.limit = limit
        self.count = 0
        self.regular = True
        self._fields: tuple[str, ...] | None = None
        self._types: tuple[type, ...] = ()
        self._have = np.zeros(0, dtype=bool)
        self._cols: list[np.ndarray] = []
        self._dicts: dict[int, dict[str, Any]] = {}  # irregular: plain dict copies

    def __len__(self) -> int:
        return self.count

    def get(self, g: int) -> dict[str, Any] | None:
        """A new dict of sample ``g``'s memoized fields (a collate_fn may change it), or None."""
        if not self.regular:
            meta = self._dicts.get(g)
            return None if meta is None else dict(meta)
        if g >= len(self._have) or not self._have[g]:
            return None
        return {f: col[g].item() if t is not str and t is not bytes else col[g]
                for f, t, col in zip(self._fields, self._types, self._cols)}  # type: ignore[arg-type]

    def put(self, g: int, meta: dict[str, Any]) -> None:
        """Keep ``meta`` (when small and immutable and the memo is not full)."""
        if self.count >= self.limit:
            return
        if self.regular and self._fields is not None:
            if g < len(self._have) and self._have[g]:
                return
            values = tuple(meta.values())
            fits = len(values) == len(self._types) and tuple(meta) == self._fields
            if fits:  # one pass: exact types, string lengths, int range
                for t, v in zip(self._types, values):
                    if type(v) is not t:
                        fits = False
                        break
                    if t is str or t is bytes:
                        if len(v) > 256:
                            return  # too long to keep: this sample is read each epoch
                    elif t is int and not _INT64[0] <= v <= _INT64[1]:
                        fits = False
                        break
            if fits:
                self._store(g, values)
                return
        if not _memoizable(meta):
            return
        values = tuple(meta.values())
        types = tuple(map(type, values))
        if self.regular and self._fields is None and self._fits(types, values):
            self._fields, self._types = tuple(meta), types
            self._cols = [np.empty(0, dtype=_KINDS[t]) for t in types]
            self._store(g, values)
            return
        if self.regular:
            self._to_dicts()  # a sample with other fields or types: plain dicts from now on
        if g not in self._dicts:
            self._dicts[g] = dict(meta)
            self.count += 1

    def _store(self, g: int, values: tuple[Any, ...]) -> None:
        if g >= len(self._have):
            size = max(g + 1, 2 * len(self._have), 1024)
            self._have = np.concatenate([self._have, np.zeros(size - len(self._have), dtype=bool)])
            self._cols = [np.concatenate([c, np.zeros(size - len(c), dtype=c.dtype)]) if c.dtype != object
                          else np.concatenate([c, np.full(size - len(c), None, dtype=object)]) for c in self._cols]
        for col, v in zip(self._cols, values):
            col[g] = v
        self._have[g] = True
        self.count += 1

    @staticmethod
    def _fits(types: tuple[type, ...], values: tuple[Any, ...]) -> bool:
        """Whether values of these exact types can live in columns (ints within int64)."""
        for t, v in zip(types, values):
            if t not in _KINDS or (t is int and not _INT64[0] <= v <= _INT64[1]):
                return False
        return True

    def _to_dicts(self) -> None:
        if self._fields is not None:
            for g in np.flatnonzero(self._have).tolist():
                self._dicts[g] = self.get(g)  # type: ignore[assignment]
        self.regular = False
        self._fields, self._types, self._cols, self._have = None, (), [], np.zeros(0, dtype=bool)

    def has_all(self, rows: np.ndarray) -> bool:
        """Whether every sample of ``rows`` is memoized in the regular columns."""
        if not self.regular or self._fields is None or not len(rows):
            return False
        if int(rows.max()) >= len(self._have):
            return False
        return bool(self._have[rows].all())

    def collate(self, rows: np.ndarray) -> dict[str, Any]:
        """``default_collate`` of the memoized dicts of ``rows`` (all present: see :meth:`has_all`)."""
        out: dict[str, Any] = {}
        for f, t, col in zip(self._fields, self._types, self._cols):  # type: ignore[arg-type]
            part = col[rows]
            out[f] = part.tolist() if part.dtype == object else torch.from_numpy(part)
        return out


class _Columns:
    """The uncached fields of a whole batch, collated from the memo's columns (see ``MetaMemo``)."""

    __slots__ = ("batch",)

    def __init__(self, batch: dict[str, Any]) -> None:
        self.batch = batch


class FastBatch:
    """A batch of the fast path with the virtual worker that yields it and its position after it."""

    __slots__ = ("batch", "worker", "pos")

    def __init__(self, batch: Any, worker: int, pos: int):
        self.batch, self.worker, self.pos = batch, worker, pos


class _VirtualWorker:
    """What one DataLoader worker would read: its cursor, with the whole sequence located in the shards."""

    def __init__(self, cursor: Cursor):
        self.cursor = cursor
        self.seq = cursor.seq
        self.shard, self.local = cursor.locate(0, len(self.seq))

    def take(self, batch_size: int, missing: frozenset[int], cached_fields: frozenset[str],
             memo: MetaMemo, columns: bool) -> tuple[list[dict[str, Any]] | _Columns, Any, int]:
        """(uncached fields, global indices, position after) of the next ``batch_size`` samples
        that load; fewer at the end of the sequence. Samples skipped by ``on_error`` do not count,
        exactly as in a worker's fetch loop. ``memo`` keeps the small uncached fields of samples read
        in an earlier epoch; with ``columns`` (default collate) a batch whose samples are all in its
        columns comes back collated already (``_Columns``), without a per-sample loop."""
        prog = self.cursor
        p = prog.pos
        if columns and memo.regular:
            hi = min(len(self.seq), p + batch_size)
            part = self.seq[p:hi]
            # memoized samples loaded before, so none of them is skipped now; missing ones are computed here
            if memo.has_all(part) and (not missing or missing.isdisjoint(part.tolist())):
                prog.pos = hi
                return _Columns(memo.collate(part)), part, hi
        metas: list[dict[str, Any]] = []
        rows: list[int] = []
        while len(rows) < batch_size and p < len(self.seq):
            hi = min(len(self.seq), p + batch_size - len(rows))
            for g, shard, i in zip(self.seq[p:hi].tolist(), self.shard[p:hi].tolist(), self.local[p:hi].tolist()):
                if g in missing:  # decode, preprocess and fill it here, as a worker would
                    meta = prog.load(shard, i, g)
                    if meta is not None:
                        meta = {k: v for k, v in meta.items() if k not in cached_fields}
                else:
                    meta = memo.get(g)  # a new dict: a collate_fn may change the dict it gets
                    if meta is None:
                        meta = prog.load_uncached(shard, i, g)
                        if meta is not None:
                            memo.put(g, meta)
                if meta is not None:
                    metas.append(meta)
                    rows.append(g)
            p = hi
        prog.drain_skips()  # the error policy recorded them in ds.skipped already
        prog.pos = p
        return metas, rows, p


def cached_batches(
    ds: ShardedDataset, store: Any, seqs: list[np.ndarray], *, missing: frozenset[int], start: EpochStart,
    batch_size: int, drop_last: bool, collate_fn: Callable[[Any], Any], pin: str | None, gather: FastGather,
    pinned: bool = False, positions: list[int] | None = None,
) -> Iterator[FastBatch]:
    """The batches of one epoch, in the worker path's order (see the module docstring).

    ``positions``: the loader's position per virtual worker (with ``num_workers > 0``). A walk that
    yields no more batches after skipping samples (all its last ones, or a partial batch ``drop_last``
    drops) moves its position to its end there, as a worker process's report-only result does.
    """
    n = len(seqs)
    # one live cursor per virtual worker: the dataset keeps every one's open shards open;
    # with one worker ds.state_dict() follows, as with num_workers=0 on the worker path
    seam = ds.loader_seam
    workers = [_VirtualWorker(seam.cursor(start, w, seq=seq, live=n == 1)) for w, seq in enumerate(seqs)]
    fast_collate = collate_fn is default_collate
    if gather.metas is None:  # one per loader, kept across epochs (see MetaMemo)
        gather.metas = MetaMemo()
    cached_fields = frozenset(f.name for f in store.fields or ())
    deal = BatchSchedule(n, batch_size, drop_last).deal(start.first)
    while (w := deal.next()) is not None:
        before = workers[w].cursor.pos
        metas, rows, pos = workers[w].take(batch_size, missing, cached_fields, gather.metas, fast_collate)
        turn = deal.settle(w, len(rows), pos - before > len(rows))
        if turn is Turn.BATCH:
            yield FastBatch(_assemble(store, metas, rows, collate_fn, fast_collate, pin, gather,
                                      (seam, start.epoch) if ds.transform is not None else None,
                                      pinned or pin is not None), w, pos)
        elif turn is Turn.END and positions is not None:  # ended in skipped samples
            positions[w] = pos


def _assemble(store: Any, metas: list[dict[str, Any]] | _Columns, rows: Any, collate_fn: Callable[[Any], Any],
              fast_collate: bool, pin: str | None, gather: FastGather, transform: tuple[LoaderSeam, int] | None,
              pinned: bool) -> Any:
    """One batch of the store's ``rows``. ``transform``: (the dataset's seam, the epoch): its ``transform=``
    replaces the gathered rows, which are read once and never handed out, so they are gathered unpinned."""
    cached = gather.batch(store, rows, pinned=pinned and transform is None)
    if cached is None:
        raise CacheError(f"cache store {store.path}: samples of this batch are no longer filled ({list(rows[:8])}...)")
    if transform is not None:  # each row as a worker transforms its sample
        seam, epoch = transform
        out = [seam.transform_cached({k: v[j] for k, v in cached.items()}, int(g), epoch) for j, g in enumerate(rows)]
        cached = {k: torch.stack([o[k] for o in out]) for k in cached}
    if isinstance(metas, _Columns):
        batch = metas.batch
        batch.update(cached)
    elif fast_collate:
        batch = collate_fn(metas)
        batch.update(cached)  # cached fields come last, as in the samples of the worker path
    else:
        batch = collate_fn([{**m, **{k: v[j] for k, v in cached.items()}} for j, m in enumerate(metas)])
    return _pin_memory(batch, pin) if pin is not None else batch
