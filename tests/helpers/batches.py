"""Batch comparisons shared by the tests of the loader's in-process paths (cached fast path, thread decoder)."""
from __future__ import annotations

from typing import Any

import torch


def epoch_on_path(loader: Any, path: str) -> list[Any]:
    """One epoch of ``loader``, asserting it took ``path`` ("cached", "threads" or "workers")."""
    out = list(loader)
    assert loader.last_path == path, loader.fallback_reason
    return out


def assert_same(a: list[Any], b: list[Any]) -> None:
    """Bit for bit: batch count, keys and their order, dtypes, shapes, values."""
    assert len(a) == len(b)
    for j, (x, y) in enumerate(zip(a, b)):
        assert list(x) == list(y), f"batch {j}"
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, f"batch {j} field {k}"
                assert torch.equal(x[k], y[k]), f"batch {j} field {k}"
            else:
                assert x[k] == y[k], f"batch {j} field {k}"


def batch_keys(batches: list[Any]) -> list[str]:
    """Every sample key of ``batches``, in order."""
    return [k for b in batches for k in b["__key__"]]


def batch_cls(batch) -> list[int]:
    """The ``cls`` values of a batch, as ints."""
    return [int(i) for i in batch["cls"]]
