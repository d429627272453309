"""fastdata: keep GPUs fed.

Public names are imported lazily so that ``import fastdata`` stays cheap and optional
dependencies (h5py, webdataset) load only when used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CacheError": "fastdata.errors",
    "DecodeError": "fastdata.errors",
    "FastdataError": "fastdata.errors",
    "Manifest": "fastdata.manifest",
    "ManifestError": "fastdata.errors",
    "ShardError": "fastdata.errors",
    "ShardWriter": "fastdata.shards.writer",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from fastdata.errors import CacheError, DecodeError, FastdataError, ManifestError, ShardError
    from fastdata.manifest import Manifest
    from fastdata.shards.writer import ShardWriter
