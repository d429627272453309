"""ShardedDataset: a torch IterableDataset over shards with exact splitting, shuffling and resume.

The order of samples is pure index math (:mod:`fastdata.dataset._split`): shard order shuffled per
epoch, the epoch cut into equal parts per rank and per DataLoader worker, mixing simulated on
indices; samples are then read by position with the shard readers' random access. Resuming
regenerates the order and skips the consumed prefix without reading data.
"""
from __future__ import annotations

import hashlib
import math
import os
import threading
import types
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from fastdata.dataset._cursor import Cursor, EpochStart
from fastdata.dataset._options import ON_ERROR, ON_MISSING, DatasetOptions
from fastdata.dataset._source import Source, resolve_source
from fastdata.dataset._split import (
    ElasticPlan,
    Era,
    ShuffleOptions,
    SplitPlan,
    Stage,
    _check_consumed,
    iteration_stages,
    permutation,
    rest_counts,
    random_floats,
    rng_key,
    elastic_remaining,
    elastic_split,
    split_sizes,
    stage_counts,
    stage_sequences,
    worker_sequence,
)
from fastdata.dataset._packed import EncodedImage, key_index
from fastdata.dataset._preload import NextEpoch
from fastdata.dataset._schedule import BatchSchedule
from fastdata.dataset._readers import ReaderCache, fork_count
from fastdata.decode import (Decoder, SampleDecoder, image_to_tensor,
                             is_image_field, suffix)
from fastdata.errors import CacheError, FastdataError, MissingFieldError, ShardError, SkipBudgetError, SourceError
from fastdata.shards import missing_fields, required_fields

from fastdata.cache import Store, StoreInfo  # at run time too: typing.get_type_hints resolves the hints

__all__ = ["ON_ERROR", "ON_MISSING", "ShardedDataset", "ShuffleOptions", "SkipReport", "SkippedSampleWarning"]

STATE_VERSION = 1
_LOCATE_CHUNK = 1024  # samples whose shards are located at once (bounded memory for long epochs)


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


def _image_decoders(decode: bool | Mapping[str, Any]) -> str:
    """What the cache key adds for image fields not decoded by the default decoder ("" for none): the
    store holds preprocess= of their output. A decoder is named by its ``fingerprint`` attribute, else
    by module and qualified name (as ``Deterministic`` keys on name and version, never on the code),
    plus a digest of its code for a lambda or a local function, whose names tell nothing apart."""
    if decode is True:
        return ""
    if decode is False:
        return "|decode=False"
    names = []
    for field, fn in sorted(decode.items()):
        if is_image_field(field):
            fp = getattr(fn, "fingerprint", None)
            name = "raw" if fn is None else fp if isinstance(fp, str) else (
                f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}")
            code = getattr(fn, "__code__", None)
            if not isinstance(fp, str) and "<" in name and isinstance(code, types.CodeType):
                name += f"#{_code_digest(code)}"  # every lambda is '<lambda>': its code tells them apart
            names.append(f"{field}={name}")
    return f"|decode {','.join(names)}" if names else ""


def _code_digest(code: types.CodeType) -> str:
    """A digest of a function's bytecode, names and constants (not its file or line numbers)."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames)).encode())
        for k in c.co_consts:
            if isinstance(k, types.CodeType):
                feed(k)
            else:
                h.update(repr(k).encode())

    feed(code)
    return h.hexdigest()[:16]


def _dataset_part(state: Any) -> Any:
    """The dataset's state inside a ``fastdata.DataLoader`` state (``{"dataset": ..., ...}``), else ``state``."""
    return state["dataset"] if isinstance(state, Mapping) and isinstance(state.get("dataset"), Mapping) else state


def _origin(value: Any) -> tuple[int, int]:
    """A state's ``stream_origin``/``era_origin`` (absent: the start of the stream)."""
    if value is None:
        return (0, 0)
    try:
        epoch, pos = (int(x) for x in value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"state_dict: malformed stream origin {value!r} (want [epoch, position])") from e
    return (epoch, pos)


def _loader_shape(batch_size: int | None, num_workers: int, drop_last: bool) -> tuple[int, int, bool]:
    """What decides a loader's batch counts: (batch size, workers per rank, drop_last), normalised
    (None and 1 are single samples, 0 and 1 workers are one walk, drop_last of single samples drops nothing)."""
    bs = max(1, int(batch_size or 1))
    return (bs, max(1, int(num_workers)), bool(drop_last) and bs > 1)


def _split_for(value: Any) -> tuple[int, int, bool] | None:
    """A state's ``split_for`` (absent in states saved before it existed: None)."""
    if value is None:
        return None
    try:
        bs, nw, drop = value
        return _loader_shape(int(bs), int(nw), bool(drop))
    except (TypeError, ValueError) as e:
        raise ValueError(f"state_dict: malformed split_for {value!r} (want [batch_size, num_workers, "
                         "drop_last])") from e


def _shape_text(shape: tuple[int, int, bool]) -> str:
    bs, nw, drop = shape
    return f"batch_size={bs}, num_workers={nw if nw > 1 else '0 or 1'}, drop_last={drop}"


def _state_field(name: str) -> str:
    """The argument a state field stands for, in messages."""
    return "shuffle" if name == "shuffle_options" else name


def _check_matches(state: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """ValueError naming the first field of a resume ``state`` that differs from this dataset's (``mine``):
    another order, or other data. States saved before ``shuffle_options`` existed are not checked for it."""
    for name in ("seed", "num_samples", "shuffle", "even", "samples_per_epoch", "fingerprint", "shuffle_options"):
        if (name in state or name != "shuffle_options") and state.get(name) != mine[name]:
            why = (" (the state was saved over other data: another manifest or other shards; tar files without "
                   "a manifest are identified by path, size and modification time)") if name == "fingerprint" else ""
            raise ValueError(f"state_dict does not match this dataset: {_state_field(name)}={state.get(name)!r} in "
                             f"the state, {mine[name]!r} here{why}")


def _warn_skip(record: Mapping[str, Any], stacklevel: int) -> None:
    """``on_error="warn"``: the SkippedSampleWarning of a skip record (``stacklevel`` counted from the caller)."""
    warnings.warn(f"skipped sample {record['key']!r} of shard {record['shard']}: {record['reason']}",
                  SkippedSampleWarning, stacklevel=stacklevel)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _in_worker() -> bool:
    return get_worker_info() is not None


class ShardedDataset(IterableDataset):
    """Samples of a sharded dataset, split exactly between ranks and DataLoader workers.

    Args:
        source: a folder with ``manifest.json`` (tar or HDF5 shards); or local ``.tar`` paths /
            brace patterns without a manifest (indexed by sidecar or header scan); or URLs
            (fsspec; streaming, whole shards per worker).
        shuffle: False (manifest order), True, or :class:`ShuffleOptions`. A shard's reader stays
            open while a walk of this process still reads from it (the shuffle buffer makes a walk
            interleave more shards than ``open_shards``), so each shard is opened once per walk, up
            to ``min(1024, RLIMIT_NOFILE // 4)`` readers per process (each holds a file descriptor;
            an HDF5 one also its chunk cache).
        seed: the order is a function of (seed, epoch, rank, worker) only.
        decode: True, False (raw bytes) or a mapping field/suffix -> decoder (see fastdata.decode).
        preprocess: deterministic transform of each image field (e.g. ``ResizeCenterCrop(224)``);
            its output is what ``cache`` stores.
        transform: random transform of each image field, applied after ``preprocess`` every time.
            The first of the two gets a PIL image if it declares ``accepts_pil = True``, else a
            uint8 (C, H, W) tensor (so ``transform`` gets ``preprocess``'s output when both are
            given); a PIL image either returns becomes such a tensor.
        sample_transform: function of the whole sample dict, applied last (e.g. to a tuple).
        fields: read only these fields (default: all).
        cache: a directory or :class:`fastdata.cache.Cache` for ``preprocess`` outputs. With a
            cache, a sample's keys are ordered ``__key__``, the other fields as read, then the
            image fields sorted by name, whether the sample was a hit or a miss.
        rank, world_size: explicit, or from ``torch.distributed`` when initialised.
        even: "pad" (default: repeat samples from the start of the epoch so every rank gets
            ``ceil(N / world_size)``) or "drop" (``floor``; the tail is not read).
        samples_per_epoch: fixed global samples per epoch (rounded to a multiple of
            world_size per ``even``); epochs walk an endless sequence of passes.
        on_error: "raise" (default), "skip" or "warn" for unreadable/undecodable samples.
            Every skip is recorded in ``skipped`` (``{"shard", "key", "index", "epoch", "reason"}``),
            with DataLoader workers too (see ``fastdata.DataLoader``).
        on_missing: a sample lacking a required field: "raise" (default: ``MissingFieldError``
            naming shard, key and fields, whatever ``on_error`` says), "skip" (recorded like an
            ``on_error`` skip) or "allow" (served as it is). Required: every field of ``fields``,
            else of the manifest (or of the tar indexes without one); image fields of one base
            name are alternatives (``jpg`` or ``png``). Streaming sources check only ``fields``.
        max_skips: failure budget per epoch (of this rank): an int (at most that many skipped
            samples) or a float in (0, 1) (that fraction of the epoch's samples); one more raises
            ``SkipBudgetError`` listing the epoch's skips. None (default): no limit.
        max_pixels: refuse images whose header claims more pixels (``DecodeError``, under
            ``on_error``); None: Pillow's ``MAX_IMAGE_PIXELS`` warning/error only.
        allow_pickle: decode pickle/torch members (runs code from the shards).
        image_decode: "cpu" (default: image fields are decoded in the workers) or "device": image
            fields without an explicit ``decode`` entry stay encoded, as
            :class:`~fastdata.dataset.EncodedImage` (bytes, shard, key, global index, epoch);
            ``fastdata.DataLoader`` packs them per batch into one
            :class:`~fastdata.dataset.PackedImages` and ``fastdata.gpu.DecodeImages`` decodes them
            (nvJPEG on CUDA) in ``CUDAPrefetcher(transform=...)``. Excludes ``preprocess``,
            ``transform`` and ``cache`` (they need decoded images).
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        shuffle: bool | ShuffleOptions = False,
        seed: int = 0,
        decode: bool | Mapping[str, Decoder | None] = True,
        preprocess: Callable[[Any], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        sample_transform: Callable[[dict[str, Any]], Any] | None = None,
        fields: Sequence[str] | None = None,
        cache: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        even: str = "pad",
        samples_per_epoch: int | None = None,
        on_error: str = "raise",
        allow_pickle: bool = False,
        image_decode: str = "cpu",
        on_missing: str = "raise",
        max_skips: int | float | None = None,
        max_pixels: int | None = None,
    ):
        o = DatasetOptions(
            shuffle=shuffle, seed=seed, decode=decode, preprocess=preprocess, transform=transform,
            sample_transform=sample_transform, fields=fields, cache=cache, rank=rank, world_size=world_size, even=even,
            samples_per_epoch=samples_per_epoch, on_error=on_error, allow_pickle=allow_pickle,
            image_decode=image_decode, on_missing=on_missing, max_skips=max_skips, max_pixels=max_pixels)
        self.source: Source = resolve_source(source)
        o.check_source(self.source)
        self.shuffle: ShuffleOptions | None = o.shuffle  # type: ignore[assignment]
        self.seed, self.even, self.samples_per_epoch, self.on_error = o.seed, o.even, o.samples_per_epoch, o.on_error
        self.image_decode, self.on_missing, self.max_skips = o.image_decode, o.on_missing, o.max_skips
        self.preprocess, self.transform, self.sample_transform = o.preprocess, o.transform, o.sample_transform
        self.fields = None if o.fields is None else frozenset(o.fields)
        known = self.fields if self.fields is not None else self.source.fields
        # groups of field names a sample needs one of each (image formats are alternatives)
        self._required = required_fields(known) if known is not None and on_missing != "allow" else ()
        # the groups without image fields: what a read of the uncached fields must find (a cache hit holds the rest)
        self._required_uncached = tuple(g for g in self._required if not any(is_image_field(f) for f in g))
        first = preprocess if preprocess is not None else transform
        # the first image transform declares accepts_pil: without preprocess= that is transform=,
        # which then gets the decoder's PIL images as they are (no tensor conversion before it)
        self._pil_to_transform = preprocess is None and bool(getattr(transform, "accepts_pil", False))
        self._decoder = SampleDecoder(
            decode, allow_pickle=allow_pickle, draft_size=getattr(first, "target_size", None),
            images_as_pil=bool(getattr(first, "accepts_pil", False)), max_pixels=max_pixels,
        )
        self._cache_arg = cache
        self._explicit_dist = None if o.rank is None else (o.rank, o.world_size)
        self.rank, self.world_size = 0, 1
        self._warned_uneven = False  # see resolve_dist
        self._warned_unsplit = False  # see _warn_unsplit
        # [epoch, rank, world_size], shared with DataLoader workers (persistent ones too), so set_epoch reaches
        # them, and so does the split of a torch.distributed initialised after they started (one tensor: each
        # shared tensor holds a file descriptor)
        self._epoch_shared = torch.tensor([0, 0, 1], dtype=torch.int64).share_memory_()
        self.resolve_dist()
        self._epoch = 0
        self._resume: tuple[int, list[Stage], int] | None = None  # (epoch, stages, next worker)
        self._resume_dist = (0, 1)  # (rank, world_size) when the resume state was loaded (see _check_resume_dist)
        # (epoch, ended eras, worker counts per rank): the rest of an epoch after a world-size change
        self._elastic: tuple[int, tuple[Era, ...], tuple[tuple[int, ...], ...], tuple[int, int]] | None = None
        # (batch_size, num_workers, drop_last) the elastic rest gives every rank equal batch counts with
        self._split_for: tuple[int, int, bool] | None = None
        # samples_per_epoch: (epoch, stream position) where that epoch's window starts; moved by a resize
        # (see _load_states) so that the epochs after it continue the stream where the last one ended
        self._origin: tuple[int, int] = (0, 0)
        self._token = uuid.uuid4().hex
        # tar members that give no data (found while indexing), then every skipped sample
        self.skipped: list[dict[str, Any]] = [{**r, "epoch": None} for r in self.source.skipped]
        self._inline_skips: BatchSchedule | None = None  # see report_skips_inline
        self._preload_samples = 0  # see preload_next_epoch
        self._reset_process_state()
        if not self.source.streaming:
            self._plan()  # validate now (empty dataset, drop leaving nothing)

    # ----- configuration ------------------------------------------------------------------
    def _reset_process_state(self) -> None:
        self._cursors: weakref.WeakSet[Cursor] = weakref.WeakSet()  # live walks reading through _readers
        self._readers = ReaderCache()
        self._store: Any = None
        self._store_pid: int | None = None
        self._live: Cursor | None = None
        self._plans: dict[tuple[int, int], SplitPlan] = {}
        self._uncached: tuple[Any, frozenset[str]] | None = None
        self._skip_lock = threading.Lock()
        self._skip_count = 0  # skips counted against max_skips since begin_skip_budget() (this process)
        self._skip_first = len(self.skipped)  # where this pass's records start in ``skipped``
        self._next_epoch: NextEpoch | None = None  # a persistent worker's next-epoch preload
        self._walked = False  # a DataLoader worker (this process) has begun a walk (see __iter__)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_readers", "_cursors", "_store", "_store_pid", "_live", "_plans", "_uncached", "_skip_lock",
                     "_skip_count", "_skip_first", "_next_epoch", "_walked"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def resolve_dist(self) -> None:
        """Rank and world size: explicit, else torch.distributed (main process only). Package-internal."""
        if self._explicit_dist is not None:
            self.rank, self.world_size = self._explicit_dist
            if not self._warned_unsplit and not _in_worker() and _dist_ready() \
                    and torch.distributed.get_world_size() == self.world_size != 1 \
                    and torch.distributed.get_rank() != self.rank:
                self._warned_unsplit = True  # once per dataset
                warnings.warn(
                    f"rank={self.rank} was passed, but torch.distributed says this process is rank "
                    f"{torch.distributed.get_rank()} of the same world_size={self.world_size}: two processes read "
                    "the same part and one part is never read (LOCAL_RANK passed as rank? on several nodes it "
                    "repeats on each); pass the global rank, or neither (taken from torch.distributed)",
                    UserWarning, stacklevel=3)
        elif _dist_ready():
            self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        shared = self._epoch_shared
        if not _in_worker() and (int(shared[1]), int(shared[2])) != (self.rank, self.world_size):
            shared[1], shared[2] = self.rank, self.world_size
        if (self.world_size > 1 and self.source.streaming and self.samples_per_epoch is None
                and not self._warned_uneven and not _in_worker()):
            self._warned_uneven = True  # once per dataset (workers get the flag with their copy)
            warnings.warn(
                f"a streaming (URL) source at world_size={self.world_size} without samples_per_epoch: whole shards "
                "are dealt to ranks, so ranks can get different sample and batch counts and a DDP job can hang "
                "at the epoch's end; pass samples_per_epoch= for equal work per rank", UserWarning, stacklevel=3)

    def _warn_unsplit(self) -> None:
        """Once per dataset, when an epoch is sized or started: torchrun's ``WORLD_SIZE`` says this process
        is one of several, but neither ``torch.distributed`` nor ``rank=``/``world_size=`` say which, so it
        reads every sample (as every other process does, or len() sizes a schedule for one rank)."""
        if self._warned_unsplit or self._explicit_dist is not None or _dist_ready():
            return
        world = os.environ.get("WORLD_SIZE", "").strip()
        if world in ("", "1"):
            return
        self._warned_unsplit = True
        warnings.warn(
            f"WORLD_SIZE={world!r} and RANK={os.environ.get('RANK')!r} are set (torchrun), but torch.distributed is "
            "not initialised and no rank=/world_size= were passed: this process reads every sample, as rank 0 of "
            "world_size=1 (len() too). Call torch.distributed.init_process_group() first, or pass rank= and "
            "world_size= (rank=0, world_size=1 to read everything on purpose)", UserWarning, stacklevel=3)

    def _plan(self) -> SplitPlan:
        key = (self.rank, self.world_size)
        plan = self._plans.get(key)
        if plan is None:
            plan = SplitPlan(
                tuple(self.source.sizes or ()), world_size=self.world_size, rank=self.rank, seed=self.seed,
                shuffle=self.shuffle, even=self.even, samples_per_epoch=self.samples_per_epoch,
                origin=self._origin if self.samples_per_epoch is not None else (0, 0),
            )
            self._plans[key] = plan
        el = self._elastic
        if el is not None and el[0] == self.epoch and len(el[2]) == self.world_size:
            ekey = (-1 - self.rank, self.world_size)  # the elastic plan of this rank (see load_state_dict)
            eplan = self._plans.get(ekey)
            if eplan is None:
                eplan = ElasticPlan(plan, *el)  # type: ignore[assignment]
                self._plans[ekey] = eplan  # type: ignore[assignment]
            return eplan  # type: ignore[return-value]
        return plan

    @property
    def num_samples(self) -> int | None:
        """Samples in one pass over all shards (None for streaming sources)."""
        return None if self.source.sizes is None else sum(self.source.sizes)

    @property
    def streaming(self) -> bool:
        """True for a streaming (URL) source: no random access, no index sequences."""
        return bool(self.source.streaming)

    @property
    def token(self) -> str:
        """Identifies this dataset object (and its copies in worker processes) in cursors."""
        return self._token

    @property
    def has_cache(self) -> bool:
        """True when created with ``cache=``."""
        return self._cache_arg is not None

    # ----- epochs and length ----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._epoch_shared[0]) if _in_worker() else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its order); keeps a loaded resume state only if it is for ``epoch``."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if not _in_worker():
            self.resolve_dist()
        self._epoch = int(epoch)
        self._epoch_shared[0] = int(epoch)
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None
        if self._elastic is not None and self._elastic[0] != epoch:
            self._elastic = None
            self._plans.clear()

    def _per_rank(self) -> int:
        if not self.source.streaming:
            return self._plan().per_rank
        if self.samples_per_epoch is None:
            raise TypeError("len() of a streaming (URL) source is unknown; pass samples_per_epoch=")
        n, w = self.samples_per_epoch, self.world_size
        return -(-n // w) if self.even == "pad" else n // w

    def __len__(self) -> int:
        """Samples this rank yields per epoch (before skipped samples)."""
        if not _in_worker():
            self.resolve_dist()
            self._warn_unsplit()
        return self._per_rank()

    def worker_counts(self, num_workers: int) -> list[int]:
        """Samples each of ``num_workers`` DataLoader workers yields in a full epoch (the rest of an
        epoch resumed at another world size: as its elastic split gives them)."""
        if not self.source.streaming:
            if not _in_worker():
                self.resolve_dist()
                self._warn_unsplit()
            return list(self._plan().worker_counts(num_workers))
        return split_sizes(self._per_rank(), max(1, num_workers))

    def batches_per_epoch(self, batch_size: int | None, *, num_workers: int = 0, drop_last: bool = False) -> int:
        """Batches a DataLoader yields per full epoch (every worker yields its own last partial batch)."""
        return BatchSchedule(num_workers, batch_size, drop_last).total(self.worker_counts(num_workers))

    # ----- state ----------------------------------------------------------------------------
    # ----- the cursor seam (package-internal: fastdata.loader and friends) ------------------
    def epoch_start(self, num_workers: int, epoch: int | None = None) -> EpochStart:
        """Where the next iteration of ``epoch`` (default: the current one) with ``num_workers`` begins.

        Applies a loaded resume state without consuming it (see :meth:`consume_resume`).
        """
        epoch = self.epoch if epoch is None else epoch
        stages: list[Stage] = []
        first = 0
        self._check_resume_dist()
        if not _in_worker():
            self._warn_unsplit()
        if self._resume is not None and self._resume[0] == epoch:
            stages, first = list(self._resume[1]), self._resume[2]
        out = iteration_stages(stages, num_workers)
        if self.source.streaming:  # in the main process, before any worker starts
            self._check_stream_stages(out)
        return EpochStart(epoch, tuple(out), first if len(out) == len(stages) else 0)

    def _check_resume_dist(self) -> None:
        """A resume state holds positions of the rank and world size it was loaded at: loaded before
        ``torch.distributed`` was initialised (rank 0 of 1), it would be applied to another rank's part
        (a list of every rank's state was even split for one rank): another epoch's worth read twice."""
        if self._resume is not None and self._resume_dist != (self.rank, self.world_size):
            r0, w0 = self._resume_dist
            raise ValueError(
                f"the resume state was loaded while this dataset was rank {r0} of world_size={w0}; it now runs as "
                f"rank {self.rank} of world_size={self.world_size} (torch.distributed initialised after "
                "load_state_dict?): load the state after init_process_group, or pass rank= and world_size=")

    def consume_resume(self) -> None:
        """The resume state was handed to an iteration (workers hold copies): apply it only once."""
        self._resume = None

    def cursor(self, start: EpochStart, worker: int, *, seq: Any = None, live: bool = False) -> Cursor:
        """The walk of ``worker`` through its part of ``start``'s epoch (``seq``: its index
        sequence, if the caller computed it with :meth:`sequences_at`). ``live``: this process's
        :meth:`state_dict` follows it."""
        cursor = Cursor(self, start, worker, seq)
        self._cursors.add(cursor)
        if live:
            self._live = cursor
        return cursor

    def counts_at(self, start: EpochStart) -> list[int]:
        """Samples each worker of ``start``'s last stage yields in the whole stage (no sequences built)."""
        return stage_counts(self._plan(), start.stages)

    def sequences_at(self, start: EpochStart) -> list[np.ndarray]:
        """Index sequences of every worker of ``start``'s last stage."""
        seqs = stage_sequences(self._plan(), start.epoch, start.stages)
        _check_consumed(seqs, start.consumed, start.num_workers)
        return seqs

    def worker_sequence(self, cursor: Cursor) -> np.ndarray:
        """Index sequence of ``cursor``'s worker."""
        return worker_sequence(self._plan(), cursor.epoch, cursor.stages, cursor.worker)[0]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shards, positions in their shards) of global sample indices."""
        return self._plan().locate(indices)

    def state_at(self, epoch: int, stages: Sequence[Stage], next_worker: int = 0) -> dict[str, Any]:
        """The ``state_dict()`` of a position: ``stages`` consumed of ``epoch``, ``next_worker`` yields next."""
        return self._state(epoch, stages, next_worker)

    def _state(self, epoch: int, stages: Sequence[Stage], next_worker: int = 0) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "epoch": epoch, "seed": self.seed, "rank": self.rank,
            "world_size": self.world_size, "num_samples": self.num_samples, "shuffle": self.shuffle is not None,
            "even": self.even, "samples_per_epoch": self.samples_per_epoch, "fingerprint": self.source.fingerprint,
            "shuffle_options": None if self.shuffle is None else {
                "open_shards": self.shuffle.open_shards, "buffer_size": self.shuffle.buffer_size,
                "within_shard": self.shuffle.within_shard},  # they fix the order as much as the seed does
            "stages": [[n, list(c)] for n, c in stages], "next_worker": next_worker,
            **({"stream_origin": list(self._origin)} if self._origin != (0, 0) else {}),
            **self._elastic_state(epoch),
        }

    def _elastic_state(self, epoch: int) -> dict[str, Any]:
        el = self._elastic
        if el is None or el[0] != epoch:
            return {}
        return {"eras": [e.to_json() for e in el[1]], "split": [list(c) for c in el[2]],
                **({"split_for": list(self._split_for)} if self._split_for is not None else {}),
                **({"era_origin": list(el[3])} if el[3] != (0, 0) else {})}

    def state_dict(self) -> dict[str, Any]:
        """Position in the current epoch, for loops that iterate the dataset in this process.

        With DataLoader workers the progress lives in the workers: use
        ``fastdata.DataLoader.state_dict()`` instead.
        """
        self.resolve_dist()
        self._check_resume_dist()
        epoch = self._epoch
        live = self._live
        if live is not None and live.epoch == epoch:
            return self._state(epoch, live.state_stages())
        if self._resume is not None and self._resume[0] == epoch:
            return self._state(epoch, self._resume[1], self._resume[2])
        return self._state(epoch, [])

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
                        batch_size: int | None = None, num_workers: int = 0, drop_last: bool = False) -> None:
        """Resume: the next iteration of ``state["epoch"]`` yields exactly the rest of that epoch.

        ``state``: this rank's ``state_dict()``, or the list of every rank's (rank order, e.g.
        gathered with ``torch.distributed.all_gather_object``). A list saved at another world size
        resumes elastically: the samples no rank consumed are cut into equal-batch parts for the
        new ranks (``batch_size``, ``num_workers`` and ``drop_last`` of the loader that will read
        them; fastdata.DataLoader passes its own), each read exactly once. A ``fastdata.DataLoader``
        state (or list of them) is taken too: its dataset part.
        """
        if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
            self._load_states([_dataset_part(s) for s in state], batch_size, num_workers, drop_last)
            return
        self._load_one(_dataset_part(state), _loader_shape(batch_size, num_workers, drop_last), lockstep=False)

    def _load_one(self, state: Any, shape: tuple[int, int, bool], *, lockstep: bool) -> None:
        """:meth:`load_state_dict` of this rank's state, read by a loader of ``shape`` (see
        :func:`_loader_shape`); ``lockstep``: every rank's state was seen to give equal batch counts."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a ShardedDataset state (version {STATE_VERSION}): {state!r:.200}")
        self.resolve_dist()
        mine = self._state(0, [])
        if state.get("world_size") != self.world_size:
            unset = "" if self._explicit_dist is not None or _dist_ready() else (
                " (torch.distributed is not initialised and no rank=/world_size= were passed: load the state after "
                "init_process_group)")
            raise ValueError(f"state_dict does not match this dataset: world_size={state.get('world_size')!r} in the "
                             f"state, {self.world_size} here{unset}; pass the states of all ranks as a list (gathered "
                             "with torch.distributed.all_gather_object) to resume at another world size")
        _check_matches(state, mine)
        if state.get("rank") != self.rank:
            if state.get("eras") or not isinstance(state.get("rank"), int):  # an elastic rest: ranks' counts differ
                raise ValueError(f"state_dict is rank {state.get('rank')!r}'s state (world_size={self.world_size}), "
                                 f"this is rank {self.rank}, and after an elastic resume each rank's position is its "
                                 "own: each rank loads its own state, or the list of every rank's")
            # every rank has the same per-worker counts and DDP keeps them in lockstep, so another rank's
            # positions are this rank's, unless samples were skipped on one of them (a checkpoint saved by
            # rank 0 alone, loaded everywhere)
            warnings.warn(f"state_dict is rank {state['rank']}'s state, loaded on rank {self.rank}: its positions "
                          "are used as this rank's, exact only if every rank read the same samples per worker (no "
                          "samples skipped); save the list of every rank's state (all_gather_object) to be sure",
                          RuntimeWarning, stacklevel=2)
        stages = [(int(n), tuple(int(c) for c in cons)) for n, cons in state["stages"]]
        next_worker = int(state.get("next_worker", 0))
        if stages and not 0 <= next_worker < stages[-1][0]:
            raise ValueError(f"state_dict: next_worker={next_worker} out of range for {stages[-1][0]} workers")
        elastic = None
        if state.get("eras"):
            split = tuple(tuple(int(x) for x in c) for c in state["split"])
            if len(split) != self.world_size:
                raise ValueError(f"state_dict: elastic split for {len(split)} ranks, world_size={self.world_size}")
            elastic = (int(state["epoch"]), tuple(Era.from_json(e) for e in state["eras"]), split,
                       _origin(state.get("era_origin")))
        split_for = _split_for(state.get("split_for")) if elastic is not None else None
        if elastic is not None and not lockstep and split_for is not None and split_for != shape \
                and len(set(elastic[2])) > 1 and sum(rest_counts(elastic[2][self.rank], stages, shape[1])):
            # The rest of an elastic resume gives the ranks different sample counts, cut so that each yields
            # the same number of batches with the loader it was split for; with these, a rank that cannot
            # see the others' states cannot know their counts (states saved before split_for: as before)
            raise ValueError(
                f"state_dict is rank {self.rank}'s rest of epoch {state['epoch']} after an elastic resume: the "
                f"ranks hold {[sum(c) for c in elastic[2]]} samples, split for equal batch counts with "
                f"{_shape_text(split_for)}; with {_shape_text(shape)} their batch counts can differ (a DDP job "
                "then hangs at the epoch's end), and one rank's state cannot tell. Load the list of every rank's "
                "state (it splits the rest again for this loader), or resume with the settings it was split for")
        if lockstep and elastic is not None:
            split_for = shape  # every rank's rest was seen to give equal batch counts with this loader
        origin = _origin(state.get("stream_origin"))
        self.set_epoch(int(state["epoch"]))
        self._elastic = elastic
        self._split_for = split_for
        self._origin = origin
        self._plans.clear()
        self._resume = (int(state["epoch"]), stages, next_worker)
        self._resume_dist = (self.rank, self.world_size)
        self._live = None

    def _lockstep(self, states: Sequence[Mapping[str, Any]], batch_size: int | None, num_workers: int,
                  drop_last: bool) -> bool:
        """Whether every rank, continuing its own state (same world size) with ``num_workers``,
        ``batch_size`` and ``drop_last``, yields the same number of batches. After an elastic resume the
        ranks' sample counts differ (equal batch counts for the loader it was split for): another
        batch size or worker count then needs a new split of the rest."""
        split = states[0].get("split") if states[0].get("eras") else None
        plan = self._plan()
        plan = getattr(plan, "base", plan)  # the plain split (an elastic state loaded before is replaced)
        batches = set()
        schedule = BatchSchedule(num_workers, batch_size, drop_last)
        try:
            for r, st in enumerate(states):
                stages = [(int(n), tuple(int(c) for c in cons)) for n, cons in st["stages"]]
                if split is not None:
                    first = [int(x) for x in split[r]]
                else:
                    first = plan.worker_counts(stages[0][0] if stages else num_workers)
                batches.add(schedule.total(rest_counts(first, stages, num_workers)))
        except (KeyError, TypeError, ValueError, IndexError):
            return True  # malformed: load_state_dict says what is wrong
        return len(batches) <= 1

    def _load_states(self, states: list[Mapping[str, Any]], batch_size: int | None, num_workers: int,
                     drop_last: bool) -> None:
        """:meth:`load_state_dict` from every rank's state (see there)."""
        self.resolve_dist()
        if not states:
            raise ValueError("load_state_dict: empty list of rank states")
        w1 = len(states)
        for r, st in enumerate(states):
            if not isinstance(st, Mapping) or st.get("version") != STATE_VERSION:
                raise ValueError(f"rank state {r} is not a ShardedDataset state (version {STATE_VERSION}): {st!r:.200}")
            if st.get("world_size") != w1 or st.get("rank") != r:
                raise ValueError(f"rank states must be the {w1} states of one job in rank order; entry {r} is rank "
                                 f"{st.get('rank')!r} of world_size={st.get('world_size')!r}")
        mine = self._state(0, [])
        for name in ("epoch", "seed", "num_samples", "shuffle", "even", "samples_per_epoch", "fingerprint",
                     "shuffle_options", "eras", "split", "split_for", "stream_origin", "era_origin"):
            values = {repr(st.get(name)) for st in states}
            if len(values) > 1:
                raise ValueError(f"rank states disagree on {_state_field(name)}: {sorted(values)}")
        _check_matches(states[0], mine)
        if w1 == self.world_size and (self.source.streaming  # no eras: every rank continues its own stream
                                      or self._lockstep(states, batch_size, num_workers, drop_last)):
            # same world size: continue in exactly the same order
            self._load_one(states[self.rank], _loader_shape(batch_size, num_workers, drop_last), lockstep=True)
            return
        epoch = int(states[0]["epoch"])
        if self.source.streaming:
            raise ValueError(
                f"a streaming (URL) source cannot resume at world_size={self.world_size} from a state saved at "
                f"world_size={w1}: it has no sample counts, so the rest of the epoch cannot be cut into equal "
                "batch counts per rank. Resume at the same world size, at the next epoch, or read the shard "
                "folder's manifest (RemoteShards / a folder URL), which resumes elastically")
        eras = tuple(Era.from_json(e) for e in states[0].get("eras") or ())
        prev_split = states[0].get("split")
        ended = Era(w1, None if prev_split is None else tuple(tuple(int(x) for x in c) for c in prev_split),
                    tuple(tuple((int(n), tuple(int(x) for x in c)) for n, c in st["stages"]) for st in states))
        eras = (*eras, ended)
        base = self._plans.get((self.rank, self.world_size)) or self._plan()
        base = base if isinstance(base, SplitPlan) else base.base
        left = elastic_remaining(base, eras, ())
        # the stream origin of the first era's world size: epoch's window there, and where the next epoch starts
        era_origin = _origin(states[0].get("era_origin") if states[0].get("eras") else states[0].get("stream_origin"))
        origin = (0, 0)
        if self.samples_per_epoch is not None:
            first = replace(base, world_size=eras[0].world_size, rank=0, origin=era_origin)
            origin = (epoch + 1, first.window_start(epoch + 1))
        split = elastic_split(left, self.world_size, num_workers, batch_size, drop_last, self.even)
        got = sum(map(sum, split))
        if got != left and not drop_last:
            warnings.warn(
                f"elastic resume: the {left} remaining samples of epoch {epoch} cannot give {self.world_size} ranks "
                f"equal batch counts with num_workers={num_workers} and batch_size={batch_size}; even={self.even!r} "
                + (f"repeats {got - left} of them" if got > left else f"leaves {left - got} of them out")
                + " (num_workers >= 2 avoids this)", stacklevel=3)
        self.set_epoch(epoch)
        self._elastic = (epoch, eras, tuple(split), era_origin)
        self._split_for = _loader_shape(batch_size, num_workers, drop_last)
        self._origin = origin
        self._plans.clear()
        self._resume = (epoch, [], 0)
        self._resume_dist = (self.rank, self.world_size)
        self._live = None

    # ----- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        epoch = None
        if info is None:
            self.resolve_dist()
        else:  # the main process's (see _epoch_shared); the same as this copy's unless they changed since
            self.rank, self.world_size = int(self._epoch_shared[1]), int(self._epoch_shared[2])
        if info is not None and not self._walked:
            # a worker's first walk: the epoch of the iter() that started the worker (its copy of the
            # dataset was made then), not the one a set_epoch right after iter() put in shared memory
            # before the worker got here; later walks (persistent workers, resumed within iter()): shared
            epoch, self._walked = self._epoch, True
        worker, nw = (info.id, info.num_workers) if info is not None else (0, 0)
        start = self.epoch_start(nw, epoch)
        # Physical worker 0 serves the worker that yields first, so that torch's round-robin
        # over workers reproduces the interrupted run's batch order.
        worker = (worker + start.first) % max(1, nw)
        self.consume_resume()  # a resume state is applied once per copy of the dataset
        if info is None:
            self.begin_skip_budget()
        elif self._preload_samples > 0 and not self.source.streaming:
            if self._next_epoch is None:
                self._next_epoch = NextEpoch(self._preload_samples)
            return self._next_epoch.walk(self, start, worker, info.id)
        return iter(self.cursor(start, worker, live=info is None))

    def iterate(self, cursor: Cursor) -> Iterator[Any]:
        """The samples of ``cursor`` from its position on, advancing it (``iter(cursor)``)."""
        if self.source.streaming:
            return self._iter_stream(cursor)
        return self._iter_indexed(cursor)

    def _iter_indexed(self, cursor: Cursor) -> Iterator[Any]:
        seq = cursor.seq
        if self.source.node_cache is not None:  # remote manifest: prefetch order and eviction plan
            self.source.plan_reads(self._plan(), cursor.epoch, seq[cursor.pos:], cursor.stages[-1][0],
                                   cursor.pos / max(1, len(seq)))
        for lo in range(cursor.pos, len(seq), _LOCATE_CHUNK):  # shards located per chunk, not per sample
            part = seq[lo : lo + _LOCATE_CHUNK]
            shards, local = self.locate(part)
            for pos, g, shard, i in zip(range(lo + 1, lo + len(part) + 1), part.tolist(), shards.tolist(),
                                        local.tolist()):
                sample = self.load_sample(shard, i, g, cursor)
                cursor.pos = pos
                if sample is None:
                    continue
                cursor.mark_current()
                yield sample
        yield from self._end_of_walk(cursor)

    def _reader_cache(self) -> ReaderCache:
        """This process's shard readers (a forked child starts with none: the parent's stay the parent's)."""
        cache = self._readers
        if cache.forks != fork_count():
            cache = self._readers = ReaderCache()
        return cache

    def _reader_floor(self) -> int:
        """Readers kept open at least: the shard pieces one walk interleaves, times the walks live
        in this process (e.g. the virtual workers of an in-process loader), plus slack at piece ends."""
        return (self.shuffle.open_shards if self.shuffle else 1) * max(1, len(self._cursors)) + 2

    def _read(self, shard: int, i: int, fields: Any, cursor: Cursor | None) -> dict[str, Any]:
        """Sample ``i`` of ``shard`` read raw under a lease on its reader (``cursor``: the walk it is part of)."""
        cache = self._readers
        if cache.forks != fork_count():
            cache = self._reader_cache()
        lease = cache.acquire(shard, cursor, self)
        try:
            return lease.reader.read(i, fields=fields)
        finally:
            cache.release(lease)

    def cache_store(self) -> Store | None:
        """The cache store this dataset reads and fills (None without ``cache=``).

        Opened once per process and held open: a store open in some process is never evicted,
        so the main process keeps it safe between epochs even when workers are not persistent.
        """
        if self._cache_arg is None:
            return None
        if self._store is None or self._store_pid != os.getpid():
            from fastdata.cache import Cache

            cache = self._cache_arg if isinstance(self._cache_arg, Cache) else Cache(self._cache_arg)
            fingerprint = f"{self.source.fingerprint}|{self.preprocess.fingerprint}"  # type: ignore[union-attr]
            # the store holds the image fields read: fields= selecting fewer than the source has
            # needs a store of its own (a store holding other fields would miss or add one on hits)
            images = sorted(f for f in self.fields or () if is_image_field(f))
            if self.fields is not None and images != sorted(f for f in self.source.fields or () if is_image_field(f)):
                fingerprint += f"|image fields {','.join(images)}"
            fingerprint += _image_decoders(self._decoder.decode)
            self._store = cache.open_store(fingerprint=fingerprint, num_samples=self.num_samples)
            self._store_pid = os.getpid()
        return self._store

    def build_cache(self, *, num_workers: int = 0, progress: bool = False) -> StoreInfo:
        """Fill the cache store ahead of time by reading one epoch of this dataset; returns its info.

        One epoch is what this object reads: with ``rank``/``world_size`` only this rank's share (call it
        on every rank, or build from a dataset made without them), with ``samples_per_epoch`` only that
        many samples. ``num_workers`` DataLoader processes fill in parallel; check ``fill_ratio`` of the
        result (samples skipped by ``on_error`` stay unfilled).
        """
        from fastdata.dataset._fill import build_dataset

        return build_dataset(self, num_workers=num_workers, progress=progress)

    def load_sample(self, shard: int, i: int, g: int, cursor: Cursor) -> Any:
        """Sample ``i`` of ``shard`` (global index ``g``) decoded, preprocessed (cache hit or fill) and
        transformed; None when ``on_error`` skipped it (recorded on ``cursor``)."""
        try:
            store = self.cache_store()
            hit = store.get(g) if store is not None else None
            if hit is not None:
                sample = self._read_uncached(shard, i, g, cursor)
                if sample is None:
                    return None  # lacks a required field: skipped under on_missing="skip"
                sample.update(hit)
            else:
                raw = self._read(shard, i, self.fields, cursor)
                if self._required and self._lacks(raw, self._required, shard, i, g, cursor):
                    return None
                sample = self._decode_fields(raw, shard, g, cursor.epoch)
                if not self._pil_to_transform:
                    sample = self._apply(self.preprocess, sample)
                if store is not None:
                    # the order a hit gives: uncached fields as read, then cached ones in store order
                    outputs = {k: sample.pop(k) for k in sorted(k for k in sample if is_image_field(k))}
                    if outputs:
                        store.put(g, outputs)
                    sample.update(outputs)
        except (CacheError, MissingFieldError, SkipBudgetError):
            raise  # the store failed (e.g. disk full), on_missing="raise", the budget: on_error does not apply
        except (FastdataError, OSError, IndexError) as e:
            self._handle_error(self._wrap_error(e, shard, i), e, shard, i, g, cursor)
            return None
        sample = self._apply(self.transform, sample)
        return self._sample_transform(sample, shard) if self.sample_transform is not None else sample

    def _sample_transform(self, sample: Any, shard: int) -> Any:
        """``sample_transform(sample)``; None is refused: a sample dropped there would be counted nowhere,
        and a rank yielding fewer samples than ``len()`` breaks equal batch counts (DDP)."""
        out = self.sample_transform(sample)  # type: ignore[misc]
        if out is None:
            key = sample.get("__key__", "?") if isinstance(sample, Mapping) else "?"
            raise TypeError(f"sample_transform returned None for sample {key!r} of shard {self.source.names[shard]}: "
                            "return the sample; samples cannot be filtered out there (fastdata counts every "
                            "sample: len(), exact resume, equal batches per rank). Use on_error='skip' for "
                            "unreadable samples, or a collate_fn that drops what you do not want")
        return out

    def _decode_fields(self, raw: dict[str, Any], shard: int, g: int, epoch: int) -> dict[str, Any]:
        """Decode a raw sample; with ``image_decode="device"`` image fields become EncodedImage
        (``g < 0``: a streaming source, the sample's identity is a hash of shard and key)."""
        name = self.source.names[shard]
        if self.image_decode != "device":
            return self._decoder(raw, shard=name)
        key = str(raw.get("__key__", "?"))
        explicit = self._decoder.decode if isinstance(self._decoder.decode, Mapping) else {}
        encoded = {}
        for field_name, value in raw.items():
            if is_image_field(field_name) and field_name not in explicit and suffix(field_name) not in explicit:
                data = value.tobytes() if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1 \
                    else value
                if isinstance(data, (bytes, bytearray, memoryview)):
                    encoded[field_name] = EncodedImage(data, shard=name, key=key, epoch=epoch,
                                                       index=g if g >= 0 else key_index(name, key))
        rest = self._decoder({k: v for k, v in raw.items() if k not in encoded}, shard=name)
        return {k: encoded[k] if k in encoded else rest[k] for k in raw}

    def _read_uncached(self, shard: int, i: int, g: int, cursor: Cursor) -> dict[str, Any] | None:
        """``__key__`` and the decoded fields of sample ``i`` of ``shard`` that the cache does not hold
        (None: it lacks a required one and ``on_missing="skip"`` skipped it)."""
        raw = self._read(shard, i, self._uncached_fields(), cursor)
        if self._required and self._lacks(raw, self._required_uncached, shard, i, g, cursor):
            return None
        return self._decoder({k: v for k, v in raw.items() if not is_image_field(k)}, shard=self.source.names[shard])

    def load_uncached(self, shard: int, i: int, g: int, cursor: Cursor) -> dict[str, Any] | None:
        """:meth:`_read_uncached` under the error policy (None: skipped). The cached fast path's read."""
        try:
            return self._read_uncached(shard, i, g, cursor)
        except (CacheError, MissingFieldError, SkipBudgetError):  # CacheError: a node cache that cannot store
            raise
        except (FastdataError, OSError, IndexError) as e:
            self._handle_error(self._wrap_error(e, shard, i), e, shard, i, g, cursor)
            return None

    def _lacks(self, raw: Mapping[str, Any], required: Sequence[frozenset[str]], shard: int, i: int, g: int,
               cursor: Cursor) -> bool:
        """Apply ``on_missing`` to a raw sample: False if it has every required field, True if it
        was skipped; MissingFieldError naming shard, key and fields for ``on_missing="raise"``."""
        missing = missing_fields(raw, required)
        if not missing:
            return False
        name, key = self.source.names[shard], str(raw.get("__key__", "?"))
        have = sorted(k for k in raw if not k.startswith("__"))
        err = MissingFieldError(f"{name}: sample {key!r} lacks field(s) {missing} (it has {have})")
        if self.on_missing == "raise":
            raise MissingFieldError(f"{err}; pass on_missing='skip' or 'allow', or fields=[...] to read fewer")
        self._record_skip(err, shard, g, cursor, key)
        return True

    def _key(self, shard: int, i: int) -> str:
        """Key of sample ``i`` of ``shard`` for error reports (``#i`` when the shard's index is unreadable)."""
        try:
            cache = self._reader_cache()
            lease = cache.acquire(shard, None, self)
            try:
                return str(lease.reader.keys[i])
            finally:
                cache.release(lease)
        except Exception:  # noqa: BLE001 - the key is best effort for the report
            return f"#{i}"

    def _wrap_error(self, e: BaseException, shard: int, i: int) -> FastdataError:
        if isinstance(e, FastdataError):
            return e
        return ShardError(f"{self.source.names[shard]}: sample {self._key(shard, i)!r} (#{i}): "
                          f"{type(e).__name__}: {e}")

    def _uncached_fields(self) -> frozenset[str] | None:
        known = self.fields if self.fields is not None else self.source.fields
        if known is None:
            return None  # unknown field names: read all, image fields are dropped undecoded
        if self._uncached is None or self._uncached[0] is not known:
            self._uncached = (known, frozenset(f for f in known if not is_image_field(f)))
        return self._uncached[1]

    @staticmethod
    def _apply(fn: Callable[[Any], Any] | None, sample: dict[str, Any]) -> dict[str, Any]:
        """``fn`` on each image field; images still PIL after it become uint8 (C, H, W) tensors."""
        for k, v in sample.items():
            if is_image_field(k):
                if fn is not None:
                    v = fn(v)
                if hasattr(v, "getbands"):  # still a PIL image
                    v = image_to_tensor(v)
                sample[k] = v
        return sample

    def _handle_error(self, err: FastdataError, cause: BaseException, shard: int, i: int, g: int,
                      cursor: Cursor, *, key: str | None = None) -> None:
        """Apply ``on_error`` to a failed sample: ``i`` of ``shard`` (``-1`` and ``key`` when streaming)."""
        if self.on_error == "raise":
            if err is cause:
                raise err
            raise err from cause
        self._record_skip(err, shard, g, cursor, self._key(shard, i) if key is None else key)

    def _record_skip(self, err: FastdataError, shard: int, g: int, cursor: Cursor, key: str) -> None:
        """Record a skipped sample (``skipped``, the cursor's report, the budget of this process)."""
        name = self.source.names[shard]
        record = {"shard": name, "key": key, "index": g, "epoch": cursor.epoch, "reason": str(err)}
        # Deferred ones are listed and warned in record_skips() when the consumer reaches the sample, and so
        # are a fastdata.DataLoader worker's when they reach the main process: kept in the worker too, nothing
        # would read them and a persistent worker's copy would grow by every skip of the run, and a warning
        # emitted in the worker never reaches the job's filters or logging.
        here = not cursor.defer_skips and not self._skips_ride_to_main()
        if here:
            with self._skip_lock:
                self.skipped.append(record)
        cursor.skips.append(record)
        if self.on_error == "warn" and here:
            _warn_skip(record, stacklevel=5)
        if not _in_worker() and not cursor.defer_skips:  # a worker's are counted when they reach the main process
            self._count_skips(1)

    def _skips_ride_to_main(self) -> bool:
        """True in a fastdata.DataLoader worker: its skip records reach the main process with its batches."""
        return self._inline_skips is not None and _in_worker()

    # ----- skip reports and the failure budget (package-internal: fastdata.loader) ---------------
    def begin_skip_budget(self) -> None:
        """A pass over an epoch starts in this process: ``max_skips`` counts from zero again."""
        with self._skip_lock:
            self._skip_count = 0
            self._skip_first = len(self.skipped)

    def record_skips(self, records: Sequence[dict[str, Any]]) -> None:
        """Skip records that reached this process from a worker: warn (``on_error="warn"``), in batch order,
        add them to ``skipped``, count them (tar members left out, records with a ``member``, are only listed)."""
        samples = [r for r in records if "member" not in r]
        if self.on_error == "warn":
            for r in samples:
                _warn_skip(r, stacklevel=3)
        if records:
            with self._skip_lock:
                self.skipped.extend(records)
            if samples:
                self._count_skips(len(samples))

    # Skip records a walk collected ahead of the consumer (``Cursor.defer_skips``), now that the consumer
    # reaches their batch: handled as a worker's (an alias: the warnings' stack level stays the caller's)
    record_deferred_skips = record_skips

    def _count_skips(self, n: int) -> None:
        if self.max_skips is None:
            return
        if isinstance(self.max_skips, float):
            per_rank = self._per_rank()
            limit, what = math.floor(self.max_skips * per_rank), f"{self.max_skips:g} of the {per_rank} samples"
        else:
            limit, what = self.max_skips, "samples"
        with self._skip_lock:
            self._skip_count += n
            count = self._skip_count
            # the records only for the error: copied at every skip, they made an epoch's skips cost quadratic time
            records = ([r for r in self.skipped[self._skip_first:] if "member" not in r]  # samples, not tar members
                       if count > limit else [])
        if count > limit:
            shown = "; ".join(f"{r['shard']}: {r['key']!r}: {r['reason']}" for r in records[:3])
            more = f" (and {len(records) - 3} more)" if len(records) > 3 else ""
            raise SkipBudgetError(f"{count} samples skipped in this pass over epoch {self.epoch}: more than "
                                  f"max_skips={self.max_skips!r} allows ({limit} {what}); skipped: {shown}{more} "
                                  "(all in SkipBudgetError.skipped)", records)

    def report_skips_inline(self, schedule: BatchSchedule) -> None:
        """Set by ``fastdata.DataLoader`` while it starts its workers (then :meth:`stop_skip_reports`):
        their copies of the dataset end a walk that skipped samples since its last yield with
        :class:`SkipReport` markers (as many as ``schedule.end_markers()``), which the loader's
        collate turns into a report-only result, so skips after a worker's last batch (or of a
        worker that yields nothing) reach the main process through the ordinary result queue."""
        self._inline_skips = schedule

    def preload_next_epoch(self, samples: int) -> None:
        """Set by ``fastdata.DataLoader`` while it starts persistent workers (0 after): their copies
        load the first ``samples`` positions of their walk of the next epoch while they wait for it
        (see :mod:`fastdata.dataset._preload`). Package-internal."""
        self._preload_samples = max(0, int(samples))

    def stop_skip_reports(self) -> None:
        """Plain torch loaders over this dataset get samples only (see :meth:`report_skips_inline`)."""
        self._inline_skips = None

    def _end_of_walk(self, cursor: Cursor) -> Iterator[SkipReport]:
        if self._inline_skips is not None and cursor.skips and _in_worker():
            cursor.mark_current()
            for _ in range(self._inline_skips.end_markers()):
                yield SkipReport()

    # ----- streaming sources (URLs) -----------------------------------------------------------
    def _check_stream_stages(self, stages: Sequence[Stage]) -> None:
        if len(stages) > 1:
            raise ValueError("a streaming (URL) source resumes only with the num_workers it was saved with")
        slots = self.world_size * stages[-1][0]
        if len(self.source.names) < slots:
            raise ValueError(f"a streaming source needs at least world_size x num_workers = {slots} shards, "
                             f"got {len(self.source.names)}")

    def _iter_stream(self, cursor: Cursor) -> Iterator[Any]:
        self._check_stream_stages(cursor.stages)
        nwe = cursor.stages[-1][0]
        slots, slot = self.world_size * nwe, self.rank * nwe + cursor.worker
        quota = None if self.samples_per_epoch is None else split_sizes(self._per_rank(), nwe)[cursor.worker]
        key = rng_key(self.seed, 2, cursor.epoch, self.rank, nwe, cursor.worker)
        # members a shard leaves out are listed when it is read (outside the shuffle buffer: no stream position)
        raw = self._stream_raw(cursor.epoch, slot, slots, quota is not None,
                               lambda shard, members: self._list_left_out(members, shard, cursor))
        if self.shuffle is not None and self.shuffle.buffer_size > 1:
            raw = _shuffle_buffer(raw, self.shuffle.buffer_size, key)
        pos = 0
        for shard, item in raw:
            if quota is not None and pos >= quota:
                break
            pos += 1
            if pos <= cursor.pos:  # resume: consumed before, skipped without decoding
                if isinstance(item, _ShardCut):  # unreadable now: the positions after it would shift and
                    self._stream_cut(item, shard, cursor)  # lose samples in silence
                continue
            if isinstance(item, _ShardCut):
                self._stream_cut(item, shard, cursor)
                cursor.pos = pos
                continue
            if self.fields is not None:  # as a reader's read(i, fields=) does for indexed sources
                item = {k: v for k, v in item.items() if k in self.fields or k.startswith("__")}
            if self._required and self._lacks(item, self._required, shard, -1, -1, cursor):
                cursor.pos = pos
                continue
            try:
                sample = self._decode_fields(item, shard, -1, cursor.epoch)
                if not self._pil_to_transform:
                    sample = self._apply(self.preprocess, sample)
            except FastdataError as e:
                self._handle_error(e, e, shard, -1, -1, cursor, key=str(item.get("__key__", "?")))
                cursor.pos = pos
                continue
            sample = self._apply(self.transform, sample)
            cursor.pos = pos
            cursor.mark_current()
            yield self._sample_transform(sample, shard) if self.sample_transform is not None else sample
        yield from self._end_of_walk(cursor)

    def _list_left_out(self, members: list[tuple[str, str]], shard: int, cursor: Cursor) -> None:
        """Tar members a streamed shard left out (a symlink out of the archive, a name that is no key.field), in
        ``skipped`` as those of local tars are (with ``member``; not sample skips: ``max_skips`` does not count
        them). A DataLoader worker's ride to the main process with its skip records."""
        from fastdata.shards import split_member_name

        name = self.source.names[shard]
        records = []
        for member, reason in members:
            parts = split_member_name(member)
            records.append({"shard": name, "key": None if parts is None else parts[0], "member": member,
                            "index": None, "epoch": cursor.epoch, "reason": reason})
        if self._skips_ride_to_main():
            cursor.skips.extend(records)
        else:
            with self._skip_lock:
                self.skipped.extend(records)

    def _stream_cut(self, cut: _ShardCut, shard: int, cursor: Cursor) -> None:
        """Apply ``on_error`` to a streamed shard that failed after ``cut.read`` samples. A skip is one record
        (key ``'?'``) for all the samples behind the failure: a tar URL has no manifest to count them."""
        if self.on_error == "raise":
            raise cut.error
        lost = (f"the rest of the shard is lost after its first {cut.read} samples" if cut.read else
                "no sample of the shard could be read")
        reason = ShardError(f"{cut.error}; {lost} (count unknown: a streamed tar has no manifest; this one "
                            "record stands for all of them)")
        self._record_skip(reason, shard, -1, cursor, "?")

    def _stream_raw(self, epoch: int, slot: int, slots: int, endless: bool,
                    left_out: Callable[[int, list[tuple[str, str]]], None]) -> Iterator[tuple[int, Any]]:
        n = len(self.source.names)
        p = epoch
        empty: set[int] = set()  # shards that gave nothing (no sample, no error): not fetched again this walk
        while True:
            order = permutation(rng_key(self.seed, 0, p), n) if self.shuffle is not None else np.arange(n)
            dealt = [s for s in order[slot::slots].tolist() if s not in empty]
            for shard in dealt:
                items = 0
                members: list[tuple[str, str]] = []  # members that give no data (iter_tar_stream warns too)
                try:
                    for sample in self.source.stream(shard, members):
                        items += 1
                        yield shard, sample
                except (FastdataError, OSError) as e:  # the rest of this shard is lost
                    err = e if isinstance(e, FastdataError) else ShardError(f"{self.source.names[shard]}: {e}")
                    yield shard, _ShardCut(err, items)
                    items += 1
                if members:
                    left_out(shard, members)
                if not items:
                    empty.add(shard)
            if not endless:
                return
            if len(empty) == n or (self.shuffle is None and not dealt):
                # samples_per_epoch asks for more, but every shard this slot is dealt holds nothing (without
                # shuffling each pass deals the same ones): it looped over them for good, a GET each time
                names = [self.source.names[s] for s in sorted(empty)][:3]
                raise SourceError(
                    f"rank {self.rank} of world_size={self.world_size}, worker slot {slot} of {slots}: every shard "
                    f"it is dealt is empty ({', '.join(names)}{', ...' if len(empty) > 3 else ''}), so "
                    "samples_per_epoch= cannot be filled: remove the empty tar files from the list"
                    + ("" if self.shuffle is not None else ", or shuffle (each pass then deals other shards)"))
            p += 1


class _ShardCut(NamedTuple):
    """A streamed shard that failed after ``read`` samples: the rest of it is lost (one stream position)."""

    error: FastdataError
    read: int


def _shuffle_buffer(items: Iterator[tuple[int, Any]], size: int, key: int) -> Iterator[tuple[int, Any]]:
    buf: list[tuple[int, Any]] = []
    rand = iter(())
    block = 0
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        r = next(rand, None)
        if r is None:
            rand = iter(random_floats(rng_key(key, block), 4096).tolist())
            block += 1
            r = next(rand)
        j = int(r * len(buf))
        out, buf[j] = buf[j], item
        yield out
    order = permutation(rng_key(key, -1), len(buf)).tolist()
    for j in order:
        yield buf[j]
