"""ShardedDataset: shard order, exact splitting by rank and worker, shuffling, resume, cache filling.

Stage 2 of the pipeline (shards -> **dataset** -> cache -> loader -> prefetch -> GPU -> train).
Behind it: ``_source`` (where shards are), ``_split`` (the index math of an epoch),
``_dataset`` (ShardedDataset), ``_cursor`` (the seam: one worker's walk of an epoch), ``_fill`` (filling a cache store).
"""
from fastdata.dataset._cursor import Cursor, EpochStart, take_cursor
from fastdata.dataset._dataset import ON_ERROR, ON_MISSING, ShardedDataset, SkippedSampleWarning, SkipReport
from fastdata.dataset._source import RemoteShards
from fastdata.dataset._packed import FORMATS, EncodedImage, ImageInfo, PackedImages, collate, key_index
from fastdata.dataset._schedule import BatchSchedule, Turn, num_batches
from fastdata.dataset._split import ShuffleOptions, rng_key

# Public: ShardedDataset, RemoteShards, ShuffleOptions, SkippedSampleWarning, ON_ERROR. Package-internal seam
# for the loader stage: Cursor, EpochStart, take_cursor, num_batches.
__all__ = ["ON_ERROR", "Cursor", "RemoteShards", "EpochStart", "ShardedDataset", "ShuffleOptions", "SkippedSampleWarning",
           "take_cursor", "num_batches"]
# Issue 13: on_missing policies; the end-of-walk marker the loader's collate turns into a skip report.
__all__ += ["ON_MISSING", "SkipReport"]
# How every loader path deals batches over workers (the loader stage's one schedule).
__all__ += ["BatchSchedule", "Turn"]
# Encoded images kept for the device decode stage (image_decode="device"); rng_key, the counter-based
# hash of the split, also seeds the GPU stage's per-sample augmentation.
__all__ += ["FORMATS", "EncodedImage", "ImageInfo", "PackedImages", "collate", "key_index", "rng_key"]
