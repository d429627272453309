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


def memory_urls(src: Path, name: str) -> list[str]:
    """The tar shards of ``src`` copied into fsspec's memory file system: ``memory://{name}/...`` URLs, a
    streaming source (needs fsspec)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted(src.glob("*.tar")):
        fs.pipe(f"/{name}/{p.name}", p.read_bytes())
        urls.append(f"memory://{name}/{p.name}")
    return urls
