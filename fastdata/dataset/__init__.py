"""ShardedDataset: shard order, exact splitting by rank and worker, shuffling, resume, cache filling.

Its place among the stages: docs/ARCHITECTURE.md.
The user's API is ``ShardedDataset`` (``_dataset``, its options in ``_options``); the loader stage
reaches the rest through ``ShardedDataset.loader_seam`` (``_seam``: walks in ``_cursor``, batch
dealing in ``_schedule``). Behind them: ``_source`` (where shards are), ``_split``/``_mix``/
``_elastic`` (the index math of an epoch), ``_samples`` (one sample's load), ``_resume`` and ``_state``
(state dicts: saving, loading, the schema), ``_stream`` (URL sources), ``_skips`` (skip records), ``_preload``, ``_fill``. See docs/design/.
"""
from fastdata.dataset._cursor import Cursor, EpochStart, take_cursor
from fastdata.dataset._dataset import ON_ERROR, ON_MISSING, ShardedDataset, SkippedSampleWarning, SkipReport
from fastdata.dataset._options import DatasetOptions
from fastdata.dataset._packed import FORMATS, EncodedImage, ImageInfo, PackedImages, collate, key_index, sniff, sniff_size
from fastdata.dataset._schedule import BatchSchedule, Turn
from fastdata.dataset._seam import LoaderSeam
from fastdata.dataset._source import RemoteShards
from fastdata.dataset._split import ShuffleOptions
from fastdata.dataset._state import ParsedState, parse_state

# Public: ShardedDataset, RemoteShards, ShuffleOptions, SkippedSampleWarning, ON_ERROR, ON_MISSING.
__all__ = ["ON_ERROR", "ON_MISSING", "RemoteShards", "ShardedDataset", "ShuffleOptions", "SkippedSampleWarning"]
# The options ShardedDataset validates its keywords into.
__all__ += ["DatasetOptions"]
# Package-internal seam for the loader stage: LoaderSeam (ShardedDataset.loader_seam) and the walks it
# gives (Cursor, EpochStart, take_cursor), the end-of-walk marker of skip reports (SkipReport), and the
# one schedule every loader path deals batches by (BatchSchedule, Turn), and the schema of a dataset
# state (parse_state, ParsedState) that a loader's state holds.
__all__ += ["BatchSchedule", "Cursor", "EpochStart", "LoaderSeam", "ParsedState", "SkipReport", "Turn",
            "parse_state", "take_cursor"]
# Encoded images kept for the device decode stage (image_decode="device").
__all__ += ["FORMATS", "EncodedImage", "ImageInfo", "PackedImages", "collate", "key_index"]
# Image header facts (format, size) for fastdata.gpu.HostImageDecoder.
__all__ += ["sniff", "sniff_size"]
