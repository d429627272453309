"""Exception types of fastdata.

Every error names what it is about (file, shard, key, field, byte offset) so a user can find
the offending input without a debugger.
"""
from __future__ import annotations

__all__ = [
    "CacheError", "ConversionError", "DecodeError", "FastdataError", "ManifestError", "MissingFieldError",
    "RemoteError", "ShardError", "SkipBudgetError", "SourceError", "SourceNotFoundError", "StateError",
]


class FastdataError(Exception):
    """Base class of all fastdata errors."""


class ManifestError(FastdataError, ValueError):
    """A ``manifest.json`` is malformed or does not match the shards; names the file and JSON path."""


class ShardError(FastdataError):
    """A shard's content is bad (truncated, corrupt, not in the documented layout).

    The message names the shard path and, where known, the member/key and byte offset.
    """


class MissingFieldError(ShardError):
    """A sample lacks a field the dataset requires (``on_missing="raise"``); names shard, key and fields."""


class SkipBudgetError(FastdataError):
    """More samples were skipped in an epoch than ``max_skips`` allows.

    ``skipped`` holds the skip records of that epoch (``{"shard", "key", "index", "reason", ...}``).
    """

    def __init__(self, message: str, skipped: list | None = None):
        super().__init__(message)
        self.skipped = list(skipped or [])

    def __reduce__(self) -> tuple:  # keep the records across processes (pickle)
        return (type(self), (str(self), self.skipped))


class DecodeError(FastdataError):
    """A field could not be decoded; names shard, key and field."""


class CacheError(FastdataError):
    """The preprocessing cache is unusable (bad metadata, mismatching store)."""


class SourceError(FastdataError, ValueError):
    """A conversion SRC or a dataset source cannot be used; names the file and the problem."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """A dataset source (shard file, manifest folder) does not exist or has no ``manifest.json``; names it."""


class ConversionError(FastdataError, ValueError):
    """A conversion cannot proceed; the message names the file, key or argument."""


class RemoteError(FastdataError, OSError):
    """A remote shard or manifest cannot be fetched; names the URL and keeps the reason (status, message)."""


class StateError(FastdataError, ValueError):
    """A resume state cannot be loaded, found by ``load_state_dict`` before anything changes.

    The state is malformed, of another version, or does not fit what it is loaded into (other data,
    seed or world size; a position past its worker's part of the epoch); the message names the field,
    its value and, where one is meant, the logical worker. Also raised by ``next()`` of an iterator
    made before a ``load_state_dict`` (the state applies to the next ``iter()``).
    """
