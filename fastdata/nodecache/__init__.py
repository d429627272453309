"""Node-local shard cache of a remote manifest: one download per host, verified, evicted by future use.

Above ``io`` (downloads, retries, redaction) and ``shards`` (the tar index of a local copy); below
``dataset``, whose sources read remote manifests through :class:`ShardCache`.
Design note: ``docs/design/nodecache.md``.
"""
from fastdata.nodecache._cache import EVICTION_POLICIES, NodeCacheError, ShardCache, default_cache_dir

__all__ = ["EVICTION_POLICIES", "NodeCacheError", "ShardCache", "default_cache_dir"]
