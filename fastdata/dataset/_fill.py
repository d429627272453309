"""Ahead-of-time cache filling: iterate a cached ShardedDataset once (``fastdata cache build``)."""
from __future__ import annotations

import copy
import pickle
from typing import TYPE_CHECKING, Any

import torch

from fastdata._pickling import explain, main_without_file
from fastdata._util import release_frames, start_method
from fastdata.errors import CacheError

if TYPE_CHECKING:  # pragma: no cover
    from fastdata.cache import Store, StoreInfo

_BATCH = 64  # samples per worker hand-off; only a count crosses the process boundary


def _count(batch: list[Any]) -> int:
    return len(batch)


def dataset_store(dataset: Any) -> Store:
    """The cache store a ShardedDataset created with ``cache=`` reads and fills."""
    seam = getattr(dataset, "loader_seam", None)
    store = seam.cache_store() if seam is not None else None
    if store is None:
        raise CacheError(f"{type(dataset).__name__} has no cache: create it with cache=DIR and a preprocess= "
                         "transform with a fingerprint (e.g. ResizeCenterCrop(224))")
    return store


def build_dataset(dataset: Any, *, num_workers: int = 0, progress: bool = False) -> StoreInfo:
    """Iterate ``dataset`` once so that every sample's preprocessed output is in its cache store.

    Only counts cross the worker boundary; samples that are already cached are only read.
    Returns the store's :class:`~fastdata.cache.StoreInfo` (check ``fill_ratio``: samples that
    failed with ``on_error="skip"`` stay unfilled).
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    store = dataset_store(dataset)
    kwargs: dict[str, Any] = {"batch_size": _BATCH, "num_workers": num_workers, "collate_fn": _count}
    # Workers iterate copies of the dataset; in process, a copy too (its own cursors and readers, the
    # configuration and any loaded resume state shared): iterating ``dataset`` itself would consume a
    # resume state loaded into it, and the training loop would then read the whole epoch again.
    reader = copy.copy(dataset) if num_workers == 0 else dataset
    loader = torch.utils.data.DataLoader(reader, **kwargs)
    total = len(dataset) if hasattr(dataset, "__len__") else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="img", desc="cache build", dynamic_ncols=True)
    method = start_method() if num_workers else "fork"
    parts = [("dataset", dataset)]
    remedy = "num_workers=0 (filled in this process), or a 'fork' start method (Linux)"
    unimportable = main_without_file(method, parts, remedy=remedy) if method != "fork" else None
    if unimportable is not None:  # the workers would die while starting
        raise unimportable
    try:
        try:
            batches = iter(loader)
        except (TypeError, AttributeError, pickle.PicklingError) as e:  # what pickle raises: spawn/forkserver
            better = explain(method, parts, e, remedy=remedy) if method != "fork" else None
            if better is None:
                raise
            raise better from e
        for n in batches:
            if bar is not None:
                bar.update(n)
    except BaseException as e:
        # a worker's error: torch's iterator sits in a cycle through the traceback's frames and would stop
        # its workers only at a later garbage collection, after a 5 s join timeout (see release_frames)
        release_frames(e)
        raise
    finally:
        if bar is not None:
            bar.close()
    return store.cache.info(store.key)
