"""A loader per rank yielding sample ids (the ``cls`` of conftest's ``seven`` set): the resume and multi-rank tests."""
from __future__ import annotations

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader


def cls_ids(samples) -> list[int]:
    """The ``cls`` values of a list of samples, as ints (a collate_fn)."""
    return [int(s["cls"]) for s in samples]


def rank_loader(shards, rank, world, *, batch_size, num_workers=0, **kw) -> DataLoader:
    """A loader of one rank of ``world`` yielding lists of sample ids."""
    ds = ShardedDataset(shards, rank=rank, world_size=world, **kw)
    return DataLoader(ds, batch_size=batch_size, num_workers=num_workers, collate_fn=cls_ids)
