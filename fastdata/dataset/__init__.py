"""ShardedDataset: shard order, exact splitting by rank and worker, shuffling, resume, cache filling.

Stage 2 of the pipeline (shards -> **dataset** -> cache -> loader -> prefetch -> GPU -> train).
Behind it: ``_source`` (where shards are), ``_split`` (the index math of an epoch),
``_dataset`` (ShardedDataset and its per-worker cursor), ``_fill`` (filling a cache store).
"""
from fastdata.dataset._dataset import ON_ERROR, ShardedDataset, SkippedSampleWarning
from fastdata.dataset._split import ShuffleOptions

__all__ = ["ON_ERROR", "ShardedDataset", "ShuffleOptions", "SkippedSampleWarning"]
