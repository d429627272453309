"""Minimal reader API over a manifest: open a shard by its ShardInfo, verify a shard folder."""
from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fastdata.errors import FastdataError, ManifestError
from fastdata.manifest import FieldInfo, Manifest, ShardInfo, sha256_file

__all__ = ["ShardReader", "open_shard", "verify", "verify_shard"]


@runtime_checkable
class ShardReader(Protocol):
    """What every shard reader offers (tar and HDF5 alike); readers are picklable."""

    path: str

    def __len__(self) -> int: ...

    @property
    def keys(self) -> tuple[str, ...]:
        """Sample keys in shard order."""

    def read(self, i: int, fields: Collection[str] | None = None) -> dict[str, Any]:
        """Sample ``i`` as ``{"__key__": key, field: value}`` (only ``fields`` when given)."""

    def iter_range(self, start: int = 0, stop: int | None = None,
                   fields: Collection[str] | None = None) -> Iterator[dict[str, Any]]:
        """Samples ``start..stop-1`` in order, as :meth:`read` returns them."""

    def close(self) -> None:
        """Release the open file or map (the reader reopens on next use)."""


def open_shard(folder: str | os.PathLike[str], shard: ShardInfo, *, format: str,
               fields: Sequence[FieldInfo] | None = None, **options: Any) -> ShardReader:
    """A reader for ``shard`` in ``folder`` (``format`` is the manifest's ``"tar"`` or ``"hdf5"``).

    ``options`` go to the reader (``HDF5ShardReader``'s chunk-cache settings). Nothing is opened
    until the reader is first used; then the shard is checked cheaply against ``shard`` (size,
    sample count, identity) and ``fields`` (the manifest's: names; HDF5 also kinds, shapes,
    dtypes), a mismatch being a ShardError naming the shard (see the readers' ``expect``).
    """
    path = Path(folder) / shard.name
    if format == "tar":
        from fastdata.shards.tar import TarShardReader

        index = None if shard.index is None else Path(folder) / shard.index
        names = None if fields is None else [f.name for f in fields]
        return TarShardReader(path, index=index, expect=shard, fields=names, **options)
    if format == "hdf5":
        from fastdata.shards.hdf5 import HDF5ShardReader

        return HDF5ShardReader(path, expect=shard, fields=fields, **options)
    raise ValueError(f"format must be 'tar' or 'hdf5', got {format!r}")


def verify(folder: str | os.PathLike[str]) -> list[str]:
    """Re-read every shard of ``folder`` against its manifest; return the problems (empty if none).

    Checks per shard (:func:`verify_shard`): file present, byte size, sha256, sample count, the
    layout (HDF5) or the sidecar index against a fresh header scan (tar), and that the shard's
    fields are in the manifest.
    """
    try:
        manifest = Manifest.load(folder)
    except ManifestError as e:
        return [str(e)]
    problems: list[str] = []
    for shard in manifest.shards:
        problems.extend(verify_shard(folder, manifest, shard))
    return problems


def verify_shard(folder: str | os.PathLike[str], manifest: Manifest, shard: ShardInfo) -> list[str]:
    """Every problem of one shard of ``manifest`` in ``folder`` (empty if none); safe to run in threads."""
    folder = Path(folder)
    path = folder / shard.name
    if not path.is_file():
        return [f"{shard.name}: shard file is missing"]
    problems = []
    size = path.stat().st_size
    if size != shard.bytes:
        problems.append(f"{shard.name}: size is {size} bytes, manifest says {shard.bytes}")
    else:  # a different size implies a different sha256: hash only when it can tell something
        digest = sha256_file(path)
        if digest != shard.sha256:
            problems.append(f"{shard.name}: sha256 mismatch (file {digest}, manifest {shard.sha256})")
    try:
        if manifest.format == "tar":
            fields = _verify_tar(folder, shard, problems)
        else:
            reader: Any = open_shard(folder, shard, format="hdf5")
            with reader:
                count, fields = len(reader), set(reader.fields)
            if count != shard.num_samples:
                problems.append(f"{shard.name}: has {count} samples, manifest says {shard.num_samples}")
    except (FastdataError, OSError) as e:
        return [*problems, f"{shard.name}: {e}"]
    unknown = sorted(fields - {f.name for f in manifest.fields})
    if unknown:
        problems.append(f"{shard.name}: fields {unknown} are not listed in the manifest")
    return problems


def _verify_tar(folder: Path, shard: ShardInfo, problems: list[str]) -> set[str]:
    from fastdata.shards.tar import TarIndex

    scanned = TarIndex.build(folder / shard.name)
    if len(scanned) != shard.num_samples:
        problems.append(f"{shard.name}: has {len(scanned)} samples, manifest says {shard.num_samples}")
    if shard.index is not None:
        index_path = folder / shard.index
        if not index_path.is_file():
            problems.append(f"{shard.name}: index file {shard.index} is missing")
        elif TarIndex.load(index_path) != scanned:
            problems.append(f"{shard.name}: index file {shard.index} does not match the shard's headers")
    return {f for m in scanned.members for f, _, _ in m}
