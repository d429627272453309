"""The node cache's errors: its local side failing, and a prefetch stopped by a fork."""
from __future__ import annotations

from fastdata.errors import CacheError, FastdataError, RemoteError

__all__ = ["Interrupted", "NodeCacheError"]


class NodeCacheError(RemoteError, CacheError):
    """The node cache's local side failed: its folder cannot be written or locked (another user's,
    read-only, full disk) or ``max_bytes`` cannot hold the shards in use. Names the folder. Not a
    sample's fault: never skipped under ``on_error`` (a ``CacheError``, as the preprocessing cache's
    own), else every sample of every shard would be "skipped", each one downloading its shard again."""


class Interrupted(FastdataError):
    """A prefetch's download stopped because the process forks (not a failure: fetched again after)."""
