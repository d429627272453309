"""Preprocessing cache: memory-mapped stores of deterministic preprocessing outputs.

Its place among the stages: docs/ARCHITECTURE.md.
It imports nothing from the dataset or the loader: :class:`Cache` manages a directory of
:class:`Store` objects; the dataset opens a store and fills it (see
``fastdata.ShardedDataset.build_cache``).
"""
from fastdata.cache._cache import CACHE_FORMAT_VERSION, Cache, StoreInfo, store_key
from fastdata.cache._layout import FieldLayout
from fastdata.cache._store import Store

__all__ = ["CACHE_FORMAT_VERSION", "Cache", "FieldLayout", "Store", "StoreInfo", "store_key"]
