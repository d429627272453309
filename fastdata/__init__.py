"""fastdata: keep GPUs fed.

Public names (and subpackages such as ``fastdata.train``) are imported lazily so that ``import fastdata``
stays cheap: torch, h5py and the optional dependencies (fsspec, ray, pynvml) load only when used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastdata._version import __version__ as __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CacheError": "fastdata.errors",
    "DecodeError": "fastdata.errors",
    "FastdataError": "fastdata.errors",
    "CUDAPrefetcher": "fastdata.prefetch",
    "Cache": "fastdata.cache",
    "DataLoader": "fastdata.loader",
    "Deterministic": "fastdata.transforms",
    "FieldInfo": "fastdata.manifest",
    "HDF5ShardReader": "fastdata.shards.hdf5",
    "Manifest": "fastdata.manifest",
    "ResizeCenterCrop": "fastdata.transforms",
    "ShardInfo": "fastdata.manifest",
    "ShardedDataset": "fastdata.dataset",
    "RemoteShards": "fastdata.dataset",
    "ShuffleOptions": "fastdata.dataset",
    "SkippedSampleWarning": "fastdata.dataset",
    "StallMeter": "fastdata.monitor",
    "TarShardReader": "fastdata.shards.tar",
    "TrainStep": "fastdata.train",
    "Checkpoint": "fastdata.train",
    "CheckpointError": "fastdata.train",
    "evaluate": "fastdata.train",
    "load_checkpoint": "fastdata.train",
    "save_checkpoint": "fastdata.train",
    "open_shard": "fastdata.shards.reader",
    "verify": "fastdata.shards.reader",
    "ManifestError": "fastdata.errors",
    "ShardError": "fastdata.errors",
    "RemoteError": "fastdata.errors",
    "ConversionError": "fastdata.errors",
    "MissingFieldError": "fastdata.errors",
    "SkipBudgetError": "fastdata.errors",
    "SourceError": "fastdata.errors",
    "SourceNotFoundError": "fastdata.errors",
    "StateError": "fastdata.errors",
    "ShardWriter": "fastdata.shards.writer",
}

__all__ = sorted([*_EXPORTS, "__version__"])

# subpackages and modules the docs name as ``fastdata.<name>.<attribute>`` (``fastdata.train.accuracy``):
# imported at first use, as the names above are, so ``import fastdata`` alone reaches them
_SUBMODULES = frozenset({"cache", "cli", "dataset", "decode", "errors", "gpu", "io", "loader", "manifest", "monitor",
                         "nodecache", "prefetch", "shards", "train", "transforms"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"fastdata.{name}")  # the import sets it as an attribute of this package
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from fastdata.cache import Cache
    from fastdata.dataset import RemoteShards, ShardedDataset, ShuffleOptions, SkippedSampleWarning
    from fastdata.errors import (
        CacheError,
        ConversionError,
        DecodeError,
        FastdataError,
        ManifestError,
        MissingFieldError,
        RemoteError,
        ShardError,
        SkipBudgetError,
        SourceError,
        SourceNotFoundError,
        StateError,
    )
    from fastdata.loader import DataLoader
    from fastdata.manifest import FieldInfo, Manifest, ShardInfo
    from fastdata.monitor import StallMeter
    from fastdata.prefetch import CUDAPrefetcher
    from fastdata.shards.hdf5 import HDF5ShardReader
    from fastdata.shards.reader import open_shard, verify
    from fastdata.shards.tar import TarShardReader
    from fastdata.shards.writer import ShardWriter
    from fastdata.train import Checkpoint, CheckpointError, TrainStep, evaluate, load_checkpoint, save_checkpoint
    from fastdata.transforms import Deterministic, ResizeCenterCrop
