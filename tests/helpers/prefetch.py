"""Nested batches, datasets, comparisons and thread checks shared by the prefetcher tests."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import NamedTuple

import numpy as np
import torch


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


@dataclasses.dataclass(frozen=True)
class Sample:
    x: torch.Tensor
    meta: dict
    extra: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1), init=False)


def nested_batches(n: int = 12, seed: int = 0) -> list:
    """Predictable nested batches: contents derive from the index."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        img = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8, generator=g)
        dd = collections.defaultdict(list, {"k": torch.full((2,), i)})
        out.append(
            {
                "img": img,
                "cls": torch.arange(2) + i,
                "key": f"s{i}",
                "n": i,
                "arr": np.full(3, i),
                "pair": Pair(img.float(), i),
                "list": [torch.tensor(float(i)), "x", (torch.ones(i % 3), None)],
                "sample": Sample(torch.full((3,), i), {"id": i}),
                "dd": dd,
                "empty": torch.empty(0, 4),
            }
        )
    return out


def prefetch_threads() -> list[str]:
    """Names of the prefetcher's threads alive now."""
    return [t.name for t in threading.enumerate() if t.name.startswith("fastdata-prefetch")]


def wait_no_prefetch_threads(timeout: float = 20.0) -> list[str]:
    """The prefetcher's threads still alive after up to ``timeout`` seconds (a hang guard: they end within
    milliseconds when they end)."""
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return prefetch_threads()


def assert_same_tree(a, b) -> None:
    """Same structure, same types, equal tensors, identical non-tensor leaves."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tree(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same_tree(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a is b


class RangeDataset(torch.utils.data.Dataset):
    """A map-style dataset of 40 small samples whose values are their index."""
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((3, 2, 2), i, dtype=torch.uint8), "y": i, "name": f"n{i}"}


def normalize_reference(x: torch.Tensor, mean, std, dim: int = -3) -> torch.Tensor:
    """Normalize's result computed the plain way."""
    shape = [1] * x.dim()
    shape[dim] = len(mean)
    m = torch.tensor(mean, dtype=torch.float32).view(shape)
    s = torch.tensor(std, dtype=torch.float32).view(shape)
    return (x.to(torch.float32) / 255 - m) / s
