"""Batch comparisons shared by the tests of the loader's in-process paths (cached fast path, thread decoder)."""
from __future__ import annotations

from collections.abc import Callable
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


def assert_resumes_across_paths(loader: Callable[[str], Any], before: str, after: str, samples: int) -> None:
    """A state saved after 1, 5, all but one and all batches on path ``before`` (``loader(path)`` makes a
    loader of epoch 2 taking that path) resumes on path ``after``: the rest of the epoch is exactly what an
    uninterrupted worker-path epoch yields, and the next epoch starts from scratch (``samples`` in all)."""
    import json

    full = epoch_on_path(loader("workers"), "workers")
    for k in (1, 5, len(full) - 1, len(full)):
        dl = loader(before)
        it = iter(dl)
        first = [next(it) for _ in range(k)]
        assert dl.last_path == before
        state = json.loads(json.dumps(dl.state_dict()))
        del it
        dl2 = loader(after)
        dl2.load_state_dict(state)
        dl2.set_epoch(2)
        assert_same(first + epoch_on_path(dl2, after), full)
        dl2.set_epoch(3)
        assert sum(len(b["cls"]) for b in epoch_on_path(dl2, after)) == samples
