"""ShardedDataset: a torch IterableDataset over shards with exact splitting, shuffling and resume.

The class is the user's API (options, epochs, length, state dict, cache building, skip records). The
order of samples is index math (:mod:`fastdata.dataset._split`); the walks a loader drives, one sample's
loading, the state dict, streaming sources and skip records live in their own modules, and the loader
stage reaches them through one seam object, :class:`~fastdata.dataset._seam.LoaderSeam`
(``dataset.loader_seam``). A copy of a dataset (pickled to a worker, or ``copy.copy``) shares its
configuration and skip records and keeps its own readers, cache store and resume point.
See docs/design/loader-paths.md (the seam), split.md (the order) and resume.md (state dicts).
"""
from __future__ import annotations

import copy
import os
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from fastdata.cache import StoreInfo  # at run time too: typing.get_type_hints resolves the hints
from fastdata.dataset._cursor import Cursor
from fastdata.dataset._dist import dist_ready, in_worker
from fastdata.dataset._elastic import ElasticPlan
from fastdata.dataset._options import ON_ERROR, ON_MISSING, DatasetOptions
from fastdata.dataset._preload import NextEpoch
from fastdata.dataset._resume import Resume, check_resume_dist, load_state, state_of
from fastdata.dataset._samples import SampleLoader
from fastdata.dataset._seam import LoaderSeam
from fastdata.dataset._skips import SkipLog, SkippedSampleWarning, SkipReport
from fastdata.dataset._source import Source, resolve_source
from fastdata.dataset._split import ShuffleOptions, SplitPlan
from fastdata.decode import Decoder

__all__ = ["ON_ERROR", "ON_MISSING", "ShardedDataset", "ShuffleOptions", "SkipReport", "SkippedSampleWarning"]


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

    What a loader needs beyond this (walks, positions, skip reports) is :attr:`loader_seam`.
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
        # tar members that give no data (found while indexing), then every skipped sample
        self.skipped: list[dict[str, Any]] = [{**r, "epoch": None} for r in self.source.skipped]
        self._skips = SkipLog(self.skipped)
        self._samples = SampleLoader(o, self.source)
        self._explicit_dist = None if o.rank is None else (o.rank, o.world_size)
        self.rank, self.world_size = 0, 1
        self._warned_uneven = self._warned_unsplit = False  # see _resolve_dist, _warn_unsplit (once per dataset)
        # [epoch, rank, world_size], shared with DataLoader workers (persistent ones too), so set_epoch reaches
        # them, and so does the split of a torch.distributed initialised after they started (one tensor: each
        # shared tensor holds a file descriptor)
        self._epoch_shared = torch.tensor([0, 0, 1], dtype=torch.int64).share_memory_()
        self._resolve_dist()
        self._epoch = 0
        self._resume = Resume()
        self._token = uuid.uuid4().hex  # identifies this object and its copies in worker processes
        self._preload_samples = 0  # see LoaderSeam.preload_next_epoch
        self._reset_process_state()
        if not self.source.streaming:
            self._plan()  # validate now (empty dataset, drop leaving nothing)

    # ----- this process's state ----------------------------------------------------------------
    def _reset_process_state(self) -> None:
        self._live: Cursor | None = None  # the walk state_dict() follows
        self._plans: dict[tuple[int, int], SplitPlan] = {}
        self._next_epoch: NextEpoch | None = None  # a persistent worker's next-epoch preload
        self._walked = False  # a DataLoader worker (this process) has begun a walk (see __iter__)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_live", "_plans", "_next_epoch", "_walked"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # its own readers, store and budget (copy.copy(dataset) too: the configuration and records shared)
        self._samples = copy.copy(self._samples)
        self._skips = SkipLog(self.skipped, self._skips.inline)
        self._reset_process_state()

    def _resolve_dist(self, stacklevel: int = 3) -> None:
        """Rank and world size: explicit, else torch.distributed (main process only)."""
        if self._explicit_dist is not None:
            self.rank, self.world_size = self._explicit_dist
            if not self._warned_unsplit and not in_worker() and dist_ready() \
                    and torch.distributed.get_world_size() == self.world_size != 1 \
                    and torch.distributed.get_rank() != self.rank:
                self._warned_unsplit = True  # once per dataset
                warnings.warn(
                    f"rank={self.rank} was passed, but torch.distributed says this process is rank "
                    f"{torch.distributed.get_rank()} of the same world_size={self.world_size}: two processes read "
                    "the same part and one part is never read (LOCAL_RANK passed as rank? on several nodes it "
                    "repeats on each); pass the global rank, or neither (taken from torch.distributed)",
                    UserWarning, stacklevel=stacklevel)
        elif dist_ready():
            self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        shared = self._epoch_shared
        if not in_worker() and (int(shared[1]), int(shared[2])) != (self.rank, self.world_size):
            shared[1], shared[2] = self.rank, self.world_size
        if (self.world_size > 1 and self.source.streaming and self.samples_per_epoch is None
                and not self._warned_uneven and not in_worker()):
            self._warned_uneven = True  # once per dataset (workers get the flag with their copy)
            warnings.warn(
                f"a streaming (URL) source at world_size={self.world_size} without samples_per_epoch: whole shards "
                "are dealt to ranks, so ranks can get different sample and batch counts and a DDP job can hang "
                "at the epoch's end; pass samples_per_epoch= for equal work per rank", UserWarning,
                stacklevel=stacklevel)

    def _warn_unsplit(self) -> None:
        """Once per dataset, when an epoch is sized or started: torchrun's ``WORLD_SIZE`` says this process
        is one of several, but neither ``torch.distributed`` nor ``rank=``/``world_size=`` say which, so it
        reads every sample (as every other process does, or len() sizes a schedule for one rank)."""
        if self._warned_unsplit or self._explicit_dist is not None or dist_ready():
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
        """The split of this rank (the elastic one for the rest of an epoch resumed at another world size)."""
        key = (self.rank, self.world_size)
        plan = self._plans.get(key)
        if plan is None:
            plan = SplitPlan(
                tuple(self.source.sizes or ()), world_size=self.world_size, rank=self.rank, seed=self.seed,
                shuffle=self.shuffle, even=self.even, samples_per_epoch=self.samples_per_epoch,
                origin=self._resume.origin if self.samples_per_epoch is not None else (0, 0),
            )
            self._plans[key] = plan
        el = self._resume.elastic
        if el is not None and el[0] == self.epoch and len(el[2]) == self.world_size:
            ekey = (-1 - self.rank, self.world_size)  # the elastic plan of this rank (see load_state_dict)
            eplan = self._plans.get(ekey)
            if eplan is None:
                eplan = ElasticPlan(plan, *el)  # type: ignore[assignment]
                self._plans[ekey] = eplan  # type: ignore[assignment]
            return eplan  # type: ignore[return-value]
        return plan

    # ----- the user's API -----------------------------------------------------------------------
    @property
    def num_samples(self) -> int | None:
        """Samples in one pass over all shards (None for streaming sources)."""
        return None if self.source.sizes is None else sum(self.source.sizes)

    @property
    def streaming(self) -> bool:
        """True for a streaming (URL) source: no random access, no index sequences."""
        return bool(self.source.streaming)

    @property
    def loader_seam(self) -> LoaderSeam:
        """The protocol between this dataset and the loader stage (package-internal; see :class:`LoaderSeam`)."""
        return LoaderSeam(self)

    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration reads (see :meth:`set_epoch`)."""
        return int(self._epoch_shared[0]) if in_worker() else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its order); keeps a loaded resume state only if it is for ``epoch``."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if not in_worker():
            self._resolve_dist()
        self._epoch = int(epoch)
        self._epoch_shared[0] = int(epoch)
        if self._resume.point is not None and self._resume.point[0] != epoch:
            self._resume = replace(self._resume, point=None)
        if self._resume.elastic is not None and self._resume.elastic[0] != epoch:
            self._resume = replace(self._resume, elastic=None)
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
        if not in_worker():
            self._resolve_dist()
            self._warn_unsplit()
        return self._per_rank()

    def state_dict(self) -> dict[str, Any]:
        """Position in the current epoch, for loops that iterate the dataset in this process.

        With DataLoader workers the progress lives in the workers: use
        ``fastdata.DataLoader.state_dict()`` instead.
        """
        self._resolve_dist()
        check_resume_dist(self)
        epoch = self._epoch
        live, point = self._live, self._resume.point
        if live is not None and live.epoch == epoch:
            return state_of(self, epoch, live.state_stages())
        if point is not None and point[0] == epoch:
            return state_of(self, epoch, point[1], point[2])
        return state_of(self, epoch, [])

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
                        batch_size: int | None = None, num_workers: int = 0, drop_last: bool = False) -> None:
        """Resume: the next iteration of ``state["epoch"]`` yields exactly the rest of that epoch.

        ``state``: this rank's ``state_dict()``, or the list of every rank's (rank order, e.g.
        gathered with ``torch.distributed.all_gather_object``). A list saved at another world size
        resumes elastically: the samples no rank consumed are cut into equal-batch parts for the
        new ranks (``batch_size``, ``num_workers`` and ``drop_last`` of the loader that will read
        them; fastdata.DataLoader passes its own), each read exactly once. A ``fastdata.DataLoader``
        state (or list of them) is taken too: its dataset part. The whole state is checked before anything
        changes: a bad one is a :class:`~fastdata.StateError` naming the field, its value and the logical
        worker where one is meant.
        """
        load_state(self, state, batch_size, num_workers, drop_last)

    def build_cache(self, *, num_workers: int = 0, progress: bool = False) -> StoreInfo:
        """Fill the cache store ahead of time by reading one epoch of this dataset; returns its info.

        One epoch is what this object reads: with ``rank``/``world_size`` only this rank's share (call it
        on every rank, or build from a dataset made without them), with ``samples_per_epoch`` only that
        many samples. ``num_workers`` DataLoader processes fill in parallel; check ``fill_ratio`` of the
        result (samples skipped by ``on_error`` stay unfilled).
        """
        from fastdata.dataset._fill import build_dataset

        return build_dataset(self, num_workers=num_workers, progress=progress)

    def __iter__(self) -> Iterator[Any]:
        seam = self.loader_seam
        info = get_worker_info()
        epoch = None
        if info is None:
            self._resolve_dist()
        else:  # the main process's (see _epoch_shared); the same as this copy's unless they changed since
            self.rank, self.world_size = int(self._epoch_shared[1]), int(self._epoch_shared[2])
        if info is not None and not self._walked:
            # a worker's first walk: the epoch of the iter() that started the worker (its copy of the
            # dataset was made then), not the one a set_epoch right after iter() put in shared memory
            # before the worker got here; later walks (persistent workers, resumed within iter()): shared
            epoch, self._walked = self._epoch, True
        worker, nw = (info.id, info.num_workers) if info is not None else (0, 0)
        start = seam.epoch_start(nw, epoch)
        # Physical worker 0 serves the worker that yields first, so that torch's round-robin
        # over workers reproduces the interrupted run's batch order.
        worker = (worker + start.first) % max(1, nw)
        seam.consume_resume()  # a resume state is applied once per copy of the dataset
        if info is None:
            seam.begin_skip_budget()
        elif self._preload_samples > 0 and not self.source.streaming:
            if self._next_epoch is None:
                self._next_epoch = NextEpoch(self._preload_samples)
            return self._next_epoch.walk(seam, start, worker, info.id)
        return iter(seam.cursor(start, worker, live=info is None))
