"""Batch memory of the thread decoder: buffers samples are written into in place, and their reuse.

CPU batch buffers come from a ring and are reused only when provably free: not assigned to a batch in
flight and no tensor but the ring's own refers to their storage (``torch._C._storage_Use_Count``; the
consumer always gets views, so any batch, slice or NumPy array it keeps pins the buffer), and never once
their storage moved to shared memory. Pinned buffers are fresh per batch: only torch's caching host
allocator knows when a ``non_blocking`` copy from one has finished. See docs/design/thread-decoder.md.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

__all__ = ["MIN_INPLACE_BYTES", "RING_SPARE", "Buffers", "Layout", "Rows", "Spec", "rows_of", "storage_users",
           "write_row"]

# Ring buffers kept per field beyond those in flight: batches the consumer (or a prefetcher) may
# still hold; more are allocated fresh (and dropped) rather than waited for.
RING_SPARE = 4
# Tensor fields smaller than this are collated normally; bigger ones are written in place.
MIN_INPLACE_BYTES = 1024

Spec = dict[Any, tuple[tuple[int, ...], torch.dtype]]  # field (dict key or tuple index) -> (shape, dtype)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def storage_users(t: torch.Tensor) -> int:
    """References to ``t``'s storage (-1 where this torch cannot tell: then nothing is reused)."""
    if _USE_COUNT is None:
        return -1
    return _USE_COUNT(t.untyped_storage()._cdata)


class Buffers:
    """Batch buffers per field: a ring of provably free CPU buffers, or fresh pinned ones."""

    def __init__(self, pin: str | None, in_flight: int):
        self.pin = pin
        self.cap = in_flight + RING_SPARE
        # two iterators of one dataset may share the ring; reentrant: an iterator's finalizer gives its
        # buffers back from whatever code the garbage collector interrupts, take() included
        self._lock = threading.RLock()
        self._ring: dict[tuple[Any, tuple[int, ...], torch.dtype], list[tuple[torch.Tensor, int]]] = {}
        self._busy: set[int] = set()  # id() of ring tensors assigned to batches in flight
        self.allocated = 0  # tensors allocated (ring and fresh), for tests and stats

    def take(self, spec: Spec, rows: int) -> dict[Any, torch.Tensor]:
        with self._lock:
            return {name: self._one(name, (rows, *shape), dtype) for name, (shape, dtype) in spec.items()}

    def _one(self, name: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pin is not None:
            self.allocated += 1
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        ring = self._ring.setdefault((name, shape, dtype), [])
        # a batch sent through a torch.multiprocessing queue moved its storage (the ring's buffer) into
        # shared memory that the receiving process maps: never write there again
        ring[:] = [(t, base) for t, base in ring if id(t) in self._busy or not t.is_shared()]
        for t, base in ring:
            if base >= 0 and id(t) not in self._busy and storage_users(t) == base:
                self._busy.add(id(t))
                return t
        t = torch.empty(shape, dtype=dtype)
        self.allocated += 1
        if len(ring) < self.cap:
            ring.append((t, storage_users(t)))
            self._busy.add(id(t))
        return t

    def release(self, bufs: dict[Any, torch.Tensor]) -> None:
        """The batch left our hands (handed over as views, or discarded)."""
        with self._lock:
            for t in bufs.values():
                self._busy.discard(id(t))


def _copyable(v: Any) -> bool:
    """A tensor a row copy (``Tensor.numpy()``, or torch's for bfloat16) writes as ``default_collate`` would
    stack it: a plain strided CPU tensor (not conjugate/negative views, quantized or sparse: collated by torch)."""
    return (isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.layout == torch.strided
            and not v.requires_grad and not v.is_quantized and not v.is_conj() and not v.is_neg())


class Layout:
    """The fields of a sample written in place: top-level tensors (big enough) of a plain dict,
    tuple or list (``default_collate`` turns a tuple sample into a list batch)."""

    __slots__ = ("fields", "kind", "length")

    def __init__(self, kind: type, length: int, fields: Spec):
        self.kind, self.length, self.fields = kind, length, fields

    @classmethod
    def of(cls, sample: Any) -> Layout | None:
        kind = type(sample)
        if kind is dict:
            items = sample.items()
        elif kind is tuple or kind is list:
            items = enumerate(sample)
        else:
            return None
        fields = {k: (tuple(v.shape), v.dtype) for k, v in items
                  if _copyable(v) and v.numel() * v.element_size() >= MIN_INPLACE_BYTES}
        return cls(kind, len(sample), fields) if fields else None

    def fits(self, sample: Any, bufs: dict[Any, torch.Tensor]) -> bool:
        if type(sample) is not self.kind or (self.kind is not dict and len(sample) != self.length):
            return False
        for key, buf in bufs.items():
            v = sample.get(key) if self.kind is dict else sample[key]
            if not _copyable(v) or v.shape != buf.shape[1:] or v.dtype != buf.dtype:
                return False
        return True

    def collate(self, samples: list[Any], bufs: dict[Any, torch.Tensor], pinned: Callable[[Any], Any]) -> Any:
        """``default_collate(samples)`` with the in-place fields taken from ``bufs``."""
        n = len(samples)
        if self.kind is dict:
            return {k: bufs[k][:n] if k in bufs else pinned(default_collate([s[k] for s in samples]))
                    for k in samples[0]}
        # default_collate transposes sequences with zip(): each field's values arrive as a tuple
        return [bufs[i][:n] if i in bufs else pinned(default_collate(tuple(s[i] for s in samples)))
                for i in range(self.length)]


Rows = tuple[dict[Any, torch.Tensor], dict[Any, "np.ndarray | None"]]  # a batch's buffers and NumPy views


def rows_of(bufs: dict[Any, torch.Tensor]) -> Rows:
    """The buffers with their NumPy views, made once per batch (None for dtypes NumPy lacks)."""
    arrays: dict[Any, np.ndarray | None] = {}
    for key, t in bufs.items():
        try:
            arrays[key] = t.numpy()
        except TypeError:  # bfloat16
            arrays[key] = None
    return bufs, arrays


def write_row(sample: Any, layout: Layout, rows: Rows, row: int) -> bool:
    """Copy the sample's in-place fields into ``row``; False when the sample does not fit the layout."""
    bufs, arrays = rows
    if not layout.fits(sample, bufs):
        return False
    for key, arr in arrays.items():
        v = sample[key]
        if arr is not None:  # NumPy copies without the GIL and without torch's intra-op threads
            np.copyto(arr[row], v.numpy())
        else:
            bufs[key][row].copy_(v)
    return True
