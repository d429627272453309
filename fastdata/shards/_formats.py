"""The registry of shard formats: one :class:`ShardFormat` per manifest ``format``, instead of branches.

Everything that differs between tar and HDF5 shards outside their own modules is a field of their
entry here: file suffixes, opening a reader, writing a whole shard, verifying one, what the format
demands of samples (every field in every sample, UTF-8 keys), whether its library may be handed a
damaged file, and the size model a conversion plans shards with. The format modules (``tar``,
``hdf5``) are imported at first use, so looking a format up costs no h5py import. A new format is
one more :func:`register` call. Design note: ``docs/design/shard-formats.md``.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdata.manifest import FieldInfo, Manifest, ShardInfo
from fastdata.shards import _tarfmt
from fastdata.shards._tarindex import INDEX_SUFFIX

__all__ = ["SHARD_FORMATS", "ShardFormat", "register", "shard_format"]


@dataclass(frozen=True)
class ShardFormat:
    """One on-disk shard format (see the module docstring); looked up with :func:`shard_format`."""

    name: str  # the manifest's "format"
    suffix: str  # of the shard files fastdata writes: shard-000000<suffix>
    source_suffixes: tuple[str, ...]  # file names a conversion's SRC is recognised by (lower case)
    index_suffix: str | None  # a sidecar file beside each shard (<shard name><index_suffix>), if any
    same_fields: bool  # every sample holds every field (else a manifest field may be missing from a shard)
    utf8_keys: bool  # keys are stored as UTF-8 text (a key from a file name in another encoding is refused)
    opens_damaged: bool  # its library may be handed a file whose size or sha256 is wrong (it cannot crash on one)
    # ShardWriter holds a shard's samples in memory and writes them whole with ``write`` (HDF5); False means
    # it streams each sample into a TarShardWriter, which only tar has. ShardWriter's checks for a buffered
    # format are HDF5's (same fields in every sample, hdf5.check_value): a new format needs its own there
    buffered: bool
    # open(path, *, index=None, expect=None, fields=None, **options) -> ShardReader; fields: the manifest's
    open: Callable[..., Any]
    # write(path, samples, *, fields) -> ShardInfo: one whole shard, atomically
    write: Callable[..., ShardInfo]
    # verify(folder, manifest, shard, problems) -> the shard's fields; problems found are appended
    verify: Callable[[Path, Manifest, ShardInfo, list[str]], set[str]]
    # build_index(path) -> the sidecar index of a local shard, from the shard itself (len(): its samples;
    # .save(path)); None exactly when index_suffix is None, the one test of "has a sidecar index"
    build_index: Callable[[Path], Any] | None
    file_bytes: Callable[[int], int]  # a shard file's bytes besides its samples, for a number of fields
    # estimate(listing, resize, fields) -> the planned bytes of each sample of a conversion's listing
    estimate: Callable[[Any, int | None, Sequence[FieldInfo]], list[int]]


SHARD_FORMATS: dict[str, ShardFormat] = {}


def register(fmt: ShardFormat) -> ShardFormat:
    """Add ``fmt`` to the registry (by its name) and return it."""
    SHARD_FORMATS[fmt.name] = fmt
    return fmt


def shard_format(name: Any) -> ShardFormat:
    """The registered format called ``name``; ValueError naming the formats otherwise."""
    fmt = SHARD_FORMATS.get(name) if isinstance(name, str) else None  # a list is unhashable: no TypeError
    if fmt is None:
        raise ValueError(f"format must be {' or '.join(map(repr, SHARD_FORMATS))}, got {name!r}")
    return fmt


# ---------------------------------------------------------------------------------------------- tar

def _open_tar(path: str | os.PathLike[str], *, index: str | os.PathLike[str] | None = None,
              expect: ShardInfo | None = None, fields: Sequence[FieldInfo] | None = None, **options: Any) -> Any:
    from fastdata.shards.tar import TarShardReader

    names = None if fields is None else [f.name for f in fields]
    return TarShardReader(path, index=index, expect=expect, fields=names, **options)


def _write_tar(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]], *,
               fields: Sequence[FieldInfo] | None = None) -> ShardInfo:
    from fastdata.shards.tar import write_tar_shard

    return write_tar_shard(path, samples)


def _verify_tar(folder: Path, manifest: Manifest, shard: ShardInfo, problems: list[str]) -> set[str]:
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


def _build_tar_index(path: Path) -> Any:
    from fastdata.shards.tar import TarIndex

    return TarIndex.build(path)


_TAR_END = 2 * 512  # end-of-archive blocks (record padding comes on top, < 10 KiB)


def _estimate_tar(listing: Any, resize: int | None, fields: Sequence[FieldInfo]) -> list[int]:
    if not resize:
        return listing.sizes
    npy = 128 + 3 * resize * resize
    return [s - img + _tarfmt.member_bytes(f"{k}.img.npy", npy)
            for s, img, k in zip(listing.sizes, listing.image_sizes, listing.keys)]


TAR = register(ShardFormat(
    name="tar", suffix=".tar", source_suffixes=(".tar",), index_suffix=INDEX_SUFFIX,
    same_fields=False, utf8_keys=False, opens_damaged=True, buffered=False,
    open=_open_tar, write=_write_tar, verify=_verify_tar, build_index=_build_tar_index,
    file_bytes=lambda n_fields: _TAR_END, estimate=_estimate_tar,
))


# --------------------------------------------------------------------------------------------- HDF5

def _open_hdf5(path: str | os.PathLike[str], *, index: str | os.PathLike[str] | None = None,
               expect: ShardInfo | None = None, fields: Sequence[FieldInfo] | None = None, **options: Any) -> Any:
    from fastdata.shards.hdf5 import HDF5ShardReader

    return HDF5ShardReader(path, expect=expect, fields=fields, **options)


def _write_hdf5(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]], *,
                fields: Sequence[FieldInfo] | None = None) -> ShardInfo:
    from fastdata.shards.hdf5 import write_hdf5_shard

    return write_hdf5_shard(path, samples, fields=fields)


def _verify_hdf5(folder: Path, manifest: Manifest, shard: ShardInfo, problems: list[str]) -> set[str]:
    with _open_hdf5(folder / shard.name, expect=shard, fields=manifest.fields) as reader:  # as datasets read it
        count, fields = len(reader), set(reader.fields)
    if count != shard.num_samples:
        problems.append(f"{shard.name}: has {count} samples, manifest says {shard.num_samples}")
    return fields


# HDF5 bytes besides the data (measured with h5py 3): per variable-length value (and key) of a row, its
# descriptor (16 bytes) and heap object (16 bytes of header, data padded to 16); per file, the
# superblock and a heap collection; per dataset, its header and chunk index
_H5_VALUE_BYTES = 48
_H5_FILE_BYTES = 4096
_H5_DATASET_BYTES = 2048


def _estimate_hdf5(listing: Any, resize: int | None, fields: Sequence[FieldInfo]) -> list[int]:
    """The data, with no tar headers or block padding."""
    vlen = [f for f in fields if f.kind not in ("int", "float") and (f.dtype is None or f.shape is None)]
    row = _H5_VALUE_BYTES * (len(vlen) + 1)  # the key too
    if not resize:
        return [d + row for d in listing.data_sizes]
    side = 3 * resize * resize
    return [d - img + side + row for d, img in zip(listing.data_sizes, listing.image_data_sizes)]


HDF5 = register(ShardFormat(
    name="hdf5", suffix=".h5", source_suffixes=(".h5", ".hdf5"), index_suffix=None,
    same_fields=True, utf8_keys=True, opens_damaged=False, buffered=True,
    open=_open_hdf5, write=_write_hdf5, verify=_verify_hdf5, build_index=None,
    file_bytes=lambda n_fields: _H5_FILE_BYTES + _H5_DATASET_BYTES * (n_fields + 1), estimate=_estimate_hdf5,
))
