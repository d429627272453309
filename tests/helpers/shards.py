"""``make_shards``: the tests' one writer of small shard sets, every value derived from the sample's index.

Use the function (``from tests.helpers.shards import make_shards``) or the ``make_shards`` fixture of
``tests/conftest.py``, which writes into a fresh folder under ``tmp_path``.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.shards.writer import ShardWriter

Size = tuple[int, int]

BROKEN = {"cls": b"x", "jpg": b"not a jpeg"}  # what a bad sample holds in the field it breaks


def varied_size(i: int) -> Size:
    """30 to 49 pixels a side, varying with ``i``: batches of images of several sizes."""
    return 30 + (i * 7) % 20, 30 + (i * 5) % 20


def make_shards(dest: str | os.PathLike, n: int, per_shard: int | None = None, *, format: str = "tar",
                key: str = "s{i:04d}", cls: str | Callable[[int], Any] | None = "bytes",
                image: Size | Callable[[int], Size | bytes] | None = None, quality: int = 90, txt: bool = False,
                payload: int = 0, array: tuple[int, ...] | None = None,
                extra: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None = None,
                bad: tuple[int, ...] | set[int] = (), bad_field: str = "cls", overwrite: bool = False) -> Path:
    """Write ``n`` samples into shards of ``per_shard`` samples (one shard when None) under ``dest``, with
    their manifest; returns the folder. Sample ``i`` has the key ``key.format(i=i)`` and these fields:

    - ``cls``: ``str(i).encode()`` for "bytes", ``i`` for "int", ``cls(i)`` for a callable, none for None;
    - ``jpg`` when ``image`` is given: a photo-like JPEG (``synth_image`` seeded by ``i``) of ``image``
      = (width, height) pixels, or of the size ``image(i)`` returns, or the bytes ``image(i)`` returns;
    - ``txt``: ``f"t{i}"`` when ``txt``; ``bin``: ``payload`` bytes of value ``i % 251`` when ``payload``;
    - ``img.npy``: an array of shape ``array`` filled with ``i % 251`` (uint8) when ``array`` is given;
    - the fields of ``extra`` (a mapping, or ``extra(i)``).

    A sample whose index is in ``bad`` holds undecodable bytes in ``bad_field`` ("cls" or "jpg")."""
    if bad and bad_field not in BROKEN:
        raise ValueError(f"bad_field must be one of {sorted(BROKEN)}, got {bad_field!r}")
    with ShardWriter(dest, format=format, max_samples=per_shard, overwrite=overwrite) as w:
        for i in range(n):
            sample: dict[str, Any] = {"__key__": key.format(i=i)}
            if image is not None:
                got = image(i) if callable(image) else image
                sample["jpg"] = got if isinstance(got, bytes) else jpeg_bytes(
                    synth_image(np.random.default_rng(i), *got), quality)
            if cls is not None:
                sample["cls"] = str(i).encode() if cls == "bytes" else i if cls == "int" else cls(i)
            if txt:
                sample["txt"] = f"t{i}".encode()
            if payload:
                sample["bin"] = np.full(payload, i % 251, np.uint8).tobytes()
            if array is not None:
                sample["img.npy"] = np.full(array, i % 251, np.uint8)
            if extra is not None:
                sample.update(extra(i) if callable(extra) else extra)
            if i in bad:
                sample[bad_field] = BROKEN[bad_field]
            w.write(sample)
    return Path(w.dest)


def shard_maker(root: Path) -> Callable[..., Path]:
    """``make_shards`` writing into a new folder under ``root`` unless ``dest=`` is given."""
    made = [0]

    def make(n: int, per_shard: int | None = None, *, dest: str | os.PathLike | None = None, **kw: Any) -> Path:
        if dest is None:
            made[0] += 1
            dest = root / f"shards-{made[0]}"
        return make_shards(dest, n, per_shard, **kw)

    return make


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
