"""Small shard sets the tests write: labels only, no images."""
from __future__ import annotations

from pathlib import Path

import fastdata


def label_shards(dest: Path, samples: int, per_shard: int) -> Path:
    """``samples`` samples ``{"__key__": "k00", "cls": i}`` in tar shards of ``per_shard``, with a manifest."""
    with fastdata.ShardWriter(dest, max_samples=per_shard) as w:
        for i in range(samples):
            w.write({"__key__": f"k{i:02d}", "cls": i})
    return dest
