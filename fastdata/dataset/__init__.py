"""ShardedDataset: shard order, exact splitting by rank and worker, shuffling, resume, cache filling.

Stage 2 of the pipeline (shards -> **dataset** -> cache -> loader -> prefetch -> GPU -> train).
Behind it: ``_source`` (where shards are), ``_split`` (the index math of an epoch),
``_dataset`` (ShardedDataset), ``_cursor`` (the seam: one worker's walk of an epoch), ``_fill`` (filling a cache store).
"""
from fastdata.dataset._cursor import Cursor, EpochStart, current_cursor
from fastdata.dataset._dataset import ON_ERROR, ShardedDataset, SkippedSampleWarning
from fastdata.dataset._source import RemoteShards
from fastdata.dataset._split import ShuffleOptions, num_batches

# Public: ShardedDataset, RemoteShards, ShuffleOptions, SkippedSampleWarning, ON_ERROR. Package-internal seam
# for the loader stage: Cursor, EpochStart, current_cursor, num_batches.
__all__ = ["ON_ERROR", "Cursor", "RemoteShards", "EpochStart", "ShardedDataset", "ShuffleOptions", "SkippedSampleWarning",
           "current_cursor", "num_batches"]
