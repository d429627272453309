"""``CUDAPrefetcher``'s options and device: ``PrefetchOptions`` (validated once, in ``__post_init__``)
and ``resolve_device`` (``None``, ``"cuda"``, ``"cuda:N"``, an index, a ``torch.device`` -> one device).

Invariants: an option that is out of range raises ``ValueError`` naming the argument and the value;
a bare ``"cuda"`` means the process's local GPU (``LOCAL_RANK``, else the current device).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastdata.prefetch._stage import STREAM_PRIORITIES

__all__ = ["PrefetchOptions", "resolve_device"]


@dataclass(frozen=True)
class PrefetchOptions:
    """Validated options of ``CUDAPrefetcher`` (see its docstring)."""

    depth: int = 2  # batches staged ahead of the one the consumer holds
    keep_on_host: tuple[Any, ...] = ()
    transform: Callable[[Any], Any] | None = None
    seamless: bool = True
    pack_threads: int | None = None
    stream_priority: str = "normal"

    def __post_init__(self) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {self.depth!r}")
        keep = self.keep_on_host
        if isinstance(keep, (str, int)):
            keep = (keep,)
        try:
            if isinstance(keep, (bytes, bytearray)):  # not a sequence of keys: its items are ints
                raise TypeError
            keep = tuple(keep)
        except TypeError:
            raise ValueError(
                f"keep_on_host must be a key or a sequence of keys (str or int), got {self.keep_on_host!r}"
            ) from None
        bad = [k for k in keep if isinstance(k, bool) or not isinstance(k, (str, int))]
        if bad:
            raise ValueError(f"keep_on_host keys must be str or int, got {bad[0]!r} in {self.keep_on_host!r}")
        object.__setattr__(self, "keep_on_host", keep)
        if self.transform is not None and not callable(self.transform):
            raise ValueError(f"transform must be callable or None, got {self.transform!r}")
        if not isinstance(self.seamless, bool):
            raise ValueError(f"seamless must be True or False, got {self.seamless!r}")
        p = self.pack_threads
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ValueError(f"pack_threads must be an int >= 1 or None, got {p!r}")
        if self.stream_priority not in STREAM_PRIORITIES:
            raise ValueError(f"stream_priority must be one of {STREAM_PRIORITIES}, got {self.stream_priority!r}")


_DEVICE_FORMS = "'cpu', 'cuda', 'cuda:N', a CUDA index, a torch.device or None"


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available else CPU; a bare ``"cuda"`` -> ``cuda:$LOCAL_RANK`` (or current)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, bool):
        raise ValueError(f"device must be {_DEVICE_FORMS}, got {device!r}")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be {_DEVICE_FORMS}, got {device!r}") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    index = dev.index if dev.index is not None else _local_rank()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device index {index} (from device={device!r} / LOCAL_RANK) out of range: {count} GPUs")
    return torch.device("cuda", index)


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK")
    if value is None or value.strip() == "":
        return torch.cuda.current_device()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {value!r}") from None
