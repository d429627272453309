"""SRC kinds ``tar`` and ``hdf5``: shard files or folders of them, and fastdata output folders.

Tar: a ``.tar`` file or a folder of ``*.tar`` shards (webdataset-written ones included), samples in
file order, fields passed through byte for byte. HDF5: ``.h5``/``.hdf5`` files in fastdata's layout.
A folder holding ``manifest.json`` is read in manifest order, each shard checked against the
manifest as a dataset checks it. Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from fastdata.errors import SourceError
from fastdata.manifest import MANIFEST_NAME, FieldInfo, Manifest
from fastdata.shards._fields import dtype_spelling
from fastdata.shards._images import IMAGE_EXTENSIONS
from fastdata.shards._listing import Listing, check_source_key, file_items, set_stamp
from fastdata.shards._tarfmt import member_bytes

__all__ = ["list_hdf5", "list_manifest_folder", "list_tar", "merge_field"]


def list_manifest_folder(root: Path) -> Listing:
    """A fastdata output folder: each shard checked against its manifest as a dataset checks it
    (size, sample count, identity, fields; ShardError naming it), so a replaced or swapped shard is
    not converted into a new folder with fresh checksums."""
    manifest = Manifest.load(root)
    files = [root / s.name for s in manifest.shards]
    if not files:
        raise SourceError(f"SRC {root}: {MANIFEST_NAME} lists no shards")
    if manifest.format == "tar":
        indexes = [None if s.index is None else str(root / s.index) for s in manifest.shards]
        listing = list_tar(root, files, indexes, manifest)
    else:
        listing = list_hdf5(root, files, manifest)
    source = manifest.extra.get("source")
    classes = source.get("classes") if isinstance(source, dict) else None
    if isinstance(classes, list) and all(isinstance(c, str) for c in classes):
        listing.extra["classes"] = classes  # the names of the 'cls' labels go on into the new manifest
    return listing


def list_tar(root: Path, files: Sequence[Path], indexes: Sequence[str | None],
              manifest: Manifest | None = None) -> Listing:
    from fastdata.shards.tar import TarShardReader

    listing = Listing(kind="tar", root=str(root), files=tuple(map(str, files)), indexes=tuple(indexes))
    names: set[str] = set()
    for i, (path, index) in enumerate(zip(files, indexes)):
        expect = None if manifest is None else manifest.shards[i]
        fields = None if manifest is None else [f.name for f in manifest.fields]
        idx = TarShardReader(path, index=index, expect=expect, fields=fields).index  # ShardError names the shard
        where = os.path.relpath(path, root) if Path(path) != root else Path(path).name
        listing.skipped.extend({"source": f"{where}:{name}", "reason": reason}
                               for name, reason in idx.skipped)
        for j, (key, members) in enumerate(zip(idx.keys, idx.members)):
            check_source_key(key, path, j)
            listing.keys.append(key)
            listing.refs.append((i, j))
            total = image = data = image_data = 0
            for fld, a, b in members:
                size = member_bytes(f"{key}.{fld}", b - a)
                total += size
                data += b - a
                if fld.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS:
                    image += size
                    image_data += b - a
                names.add(fld)
                listing.field_counts[fld] = listing.field_counts.get(fld, 0) + 1
            listing.sizes.append(total)
            listing.image_sizes.append(image)
            listing.data_sizes.append(data)
            listing.image_data_sizes.append(image_data)
    if not listing.keys:
        raise SourceError(f"SRC {root}: the tar shards hold no samples")
    listing.fields = tuple(FieldInfo(n, "bytes") for n in sorted(names))
    set_stamp(listing, file_items(root, files))
    return listing


def list_hdf5(root: Path, files: Sequence[Path], manifest: Manifest | None = None) -> Listing:
    import h5py

    from fastdata.shards.hdf5 import HDF5ShardReader

    listing = Listing(kind="hdf5", root=str(root), files=tuple(map(str, files)), indexes=(None,) * len(files))
    merged: dict[str, FieldInfo] = {}
    for i, path in enumerate(files):
        expect = None if manifest is None else manifest.shards[i]
        fields = None if manifest is None else manifest.fields
        with HDF5ShardReader(path, expect=expect, fields=fields) as reader:  # ShardError names dataset/shard
            keys, kinds = reader.keys, reader.fields
        infos = []
        with h5py.File(path, "r") as f:
            for name, kind in sorted(kinds.items()):
                ds = f[name]
                fixed = kind == "array" and h5py.check_vlen_dtype(ds.dtype) is None
                infos.append(FieldInfo(name, kind, dtype_spelling(ds.dtype) if fixed else None,
                                       tuple(ds.shape[1:]) if fixed else None))
        # vlen data lives in the file's heap, not in the datasets: estimate from the file size
        stored = os.path.getsize(path) // max(1, len(keys))
        per_sample = stored + 1024 * len(infos)
        for info in infos:
            merged[info.name] = merge_field(merged.get(info.name), info, path)
        for j, key in enumerate(keys):
            check_source_key(key, path, j)
            listing.keys.append(key)
            listing.refs.append((i, j))
            listing.sizes.append(per_sample)
            listing.image_sizes.append(0)
            listing.data_sizes.append(stored)
            listing.image_data_sizes.append(0)
        if set(merged) != {x.name for x in infos}:
            raise SourceError(f"{path}: has fields {sorted(x.name for x in infos)} but earlier HDF5 files have "
                              f"{sorted(merged)}; every file of SRC needs the same fields")
    if not listing.keys:
        raise SourceError(f"SRC {root}: the HDF5 shards hold no samples")
    listing.fields = tuple(merged[n] for n in sorted(merged))
    set_stamp(listing, file_items(root, files))
    return listing


def merge_field(prev: FieldInfo | None, info: FieldInfo, where: object) -> FieldInfo:
    """Combine two descriptions of one field; dtype/shape become None where they differ."""
    if prev is None:
        return info
    if prev.kind != info.kind:
        raise SourceError(f"{where}: field {info.name!r} is {info.kind!r} here but {prev.kind!r} elsewhere")
    return FieldInfo(info.name, info.kind, prev.dtype if prev.dtype == info.dtype else None,
                     prev.shape if prev.shape == info.shape else None)
