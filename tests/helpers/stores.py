"""Preprocessing-store contents predictable from the sample index, and datasets served through a store."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fastdata.cache import Store


IMG = (3, 64, 64)


def expected(index: int) -> dict[str, np.ndarray]:
    """Predictable sample content derived from the index (every byte differs between neighbours)."""
    img = ((np.arange(int(np.prod(IMG)), dtype=np.int64) * 3 + index * 7) % 251).astype(np.uint8).reshape(IMG)
    return {"img": img, "aux": np.full(16, index, dtype=np.float32) + np.arange(16, dtype=np.float32)}


def check_store(store: Store, *, require_full: bool = False) -> int:
    """Every valid sample equals its expected content; returns the number of valid samples."""
    valid = 0
    for i in range(store.num_samples):
        got = store.get(i)
        if got is None:
            assert not require_full, f"sample {i} missing"
            continue
        valid += 1
        exp = expected(i)
        assert set(got) == set(exp)
        for name, arr in exp.items():
            assert torch.equal(got[name], torch.from_numpy(arr)), f"sample {i} field {name} differs"
    return valid


def photo_shards(dest: Path, *, n: int = 24, changed: int | None = None) -> Path:
    """``n`` photo-like JPEGs of varied sizes in shards of 10; sample ``changed`` drawn differently."""
    from fastdata.cli._synth import jpeg_bytes, synth_image
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(dest, max_samples=10, overwrite=True) as w:
        for i in range(n):
            rng = np.random.default_rng([i, 99 if i == changed else 0])
            img = synth_image(rng, 40 + (i * 7) % 50, 40 + (i * 13) % 50)
            w.write({"__key__": f"s{i:04d}", "jpg": jpeg_bytes(img, 90), "cls": i % 3})
    return dest


def cached_samples(source: Path, **kw: object) -> list[dict]:
    """Every sample of ``source`` preprocessed by ResizeCenterCrop(``size``), through the dataset."""
    from fastdata.dataset import ShardedDataset
    from fastdata.transforms import ResizeCenterCrop

    size = kw.pop("size", 32)
    return list(ShardedDataset(source, preprocess=ResizeCenterCrop(size), **kw))  # type: ignore[arg-type]


def same_samples(a: list[dict], b: list[dict]) -> bool:
    """Same keys, labels and images, in the same order."""
    return len(a) == len(b) and all(
        x["__key__"] == y["__key__"] and x["cls"] == y["cls"] and torch.equal(x["jpg"], y["jpg"]) for x, y in zip(a, b))
