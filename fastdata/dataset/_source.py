"""Where a ShardedDataset's samples come from: a manifest folder, local tar files, or URLs.

- A folder (or ``manifest.json``) -> the manifest's shards, random access (tar or HDF5).
- Local tar paths or brace patterns (``data/shard-{000000..000099}.tar``) without a manifest ->
  random access; each shard is indexed by its sidecar ``.idx`` or by a header scan.
- URLs (``s3://``, ``https://``, ... through fsspec) -> streaming only: shards are split
  between ranks and workers whole, samples are read in file order (no random access).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdata.manifest import MANIFEST_NAME, Manifest

__all__ = ["Source", "resolve_source"]


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _expand(pattern: str) -> list[str]:
    if "{" not in pattern:
        return [pattern]
    from braceexpand import braceexpand  # installed with webdataset

    return list(braceexpand(pattern))


@dataclass
class Source:
    """Shards of a dataset and how to read them."""

    names: list[str]  # display names (paths or URLs), in manifest order
    sizes: list[int] | None  # samples per shard; None for streaming sources
    fingerprint: str  # identifies the content (manifest) or the files (path, size, mtime)
    streaming: bool = False
    fields: tuple[str, ...] | None = None  # all fields, when a manifest lists them
    _opener: Any = field(default=None, repr=False)

    def reader(self, i: int) -> Any:
        """A random-access reader of shard ``i`` (lazy: opens on first use)."""
        return self._opener(i)

    def stream(self, i: int) -> Iterator[dict[str, Any]]:
        """Samples of shard ``i`` in file order (streaming sources)."""
        from fastdata.shards.tar import iter_tar_stream

        url = self.names[i]
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(f"reading {url} needs fsspec: pip install 'fastdata[remote]'") from e
        with fsspec.open(url, "rb", compression="infer") as f:
            yield from iter_tar_stream(f, url)


class _ManifestOpener:
    def __init__(self, folder: Path, manifest: Manifest):
        self.folder, self.manifest = folder, manifest

    def __call__(self, i: int) -> Any:
        from fastdata.shards.reader import open_shard

        return open_shard(self.folder, self.manifest.shards[i], format=self.manifest.format)


class _TarOpener:
    def __init__(self, readers: Sequence[Any]):
        self.readers = list(readers)

    def __call__(self, i: int) -> Any:
        return self.readers[i]


def _from_manifest(path: Path) -> Source:
    manifest = Manifest.load(path)
    folder = path if path.is_dir() else path.parent
    return Source(
        names=[str(folder / s.name) for s in manifest.shards],
        sizes=[s.num_samples for s in manifest.shards],
        fingerprint=manifest.fingerprint(),
        fields=tuple(f.name for f in manifest.fields),
        _opener=_ManifestOpener(folder, manifest),
    )


def _from_local_tars(paths: list[str]) -> Source:
    from fastdata.shards.tar import TarShardReader

    readers, ident = [], []
    for p in paths:
        local = p[len("file://"):] if p.startswith("file://") else p
        try:
            st = os.stat(local)
        except OSError as e:
            raise FileNotFoundError(f"shard {p}: {e.strerror or e}") from e
        if not local.endswith(".tar"):
            raise ValueError(f"shard {p}: only uncompressed .tar shards can be read without a manifest "
                             "(use a URL for streaming, or convert with tools/shard.py)")
        readers.append(TarShardReader(local))
        ident.append([os.path.abspath(local), st.st_size, st.st_mtime_ns])
    sizes = [len(r) for r in readers]  # sidecar index or header scan
    digest = hashlib.sha256(json.dumps(ident).encode("utf-8")).hexdigest()
    return Source(names=[r.path for r in readers], sizes=sizes, fingerprint=f"files:{digest}",
                  _opener=_TarOpener(readers))


def resolve_source(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Source:
    """Turn the ``source`` argument of ShardedDataset into a :class:`Source`."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        p = Path(text)
        if not _is_url(text) and "{" not in text:
            if p.is_dir():
                if not (p / MANIFEST_NAME).is_file():
                    raise FileNotFoundError(f"{p}: no {MANIFEST_NAME} in this folder; pass the folder written by "
                                            "tools/shard.py or ShardWriter, or a list/brace pattern of tar files")
                return _from_manifest(p)
            if p.name == MANIFEST_NAME:
                return _from_manifest(p)
        paths = _expand(text)
    elif isinstance(source, Sequence) and source:
        paths = [q for s in source for q in _expand(os.fspath(s))]
    else:
        raise TypeError(f"source must be a folder, a tar path/URL, a brace pattern or a list of them, got {source!r}")
    if not paths:
        raise ValueError(f"source {source!r} names no shards")
    remote = [_is_url(p) for p in paths]
    if any(remote):
        if not all(remote):
            raise ValueError("source mixes local paths and URLs; pass one kind")
        digest = hashlib.sha256(json.dumps(paths).encode("utf-8")).hexdigest()
        return Source(names=list(paths), sizes=None, fingerprint=f"urls:{digest}", streaming=True)
    return _from_local_tars(paths)
