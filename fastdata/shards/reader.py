"""Minimal reader API over a manifest: open a shard by its ShardInfo, verify a shard folder."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fastdata.errors import FastdataError, ManifestError, RemoteError
from fastdata.manifest import MANIFEST_NAME, FieldInfo, Manifest, ShardInfo, sha256_file
from fastdata.io import RemoteStream, folder_url, is_url, read_bytes, redact_url, url_join
from fastdata.shards._formats import shard_format

__all__ = ["ShardReader", "load_manifest", "open_shard", "unheld_fields", "verify", "verify_remote_shard",
           "verify_shard"]


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
    fmt = shard_format(format)
    index = None if shard.index is None else Path(folder) / shard.index
    return fmt.open(Path(folder) / shard.name, index=index, expect=shard, fields=fields, **options)


def verify(folder: str | os.PathLike[str]) -> list[str]:
    """Re-read every shard of ``folder`` against its manifest; return the problems (empty if none).

    Checks per shard (:func:`verify_shard`): file present, byte size, sha256, sample count, the
    layout (HDF5) or the sidecar index against a fresh header scan (tar), and that the shard's
    fields are in the manifest; then (tar) that every field the manifest lists is held by some shard.
    ``folder`` may be a URL (``https://``, ``s3://``, ...): each shard
    is then downloaded into a temporary folder, checked the same way and deleted
    (:func:`verify_remote_shard`); a shard that cannot be fetched is a problem naming URL and reason.
    """
    try:
        manifest = load_manifest(folder)
    except ManifestError as e:
        return [str(e)]
    remote = is_url(os.fspath(folder))
    problems: list[str] = []
    seen: set[str] = set()
    for shard in manifest.shards:
        if remote:
            problems.extend(verify_remote_shard(os.fspath(folder), manifest, shard, seen=seen))
        else:
            problems.extend(verify_shard(folder, manifest, shard, seen=seen))
    return problems + (unheld_fields(manifest, seen) if not problems else [])


def unheld_fields(manifest: Manifest, seen: Collection[str]) -> list[str]:
    """The problem of a tar manifest listing fields that no shard holds (``seen``: the fields of all
    its shards), which fails every read of a sample; an image field one of whose alternatives some
    shard holds (``jpg|png``) is fine. HDF5 shards are checked field by field when opened."""
    from fastdata.shards._fields import missing_fields, required_fields

    if shard_format(manifest.format).same_fields or not manifest.shards:
        return []
    missing = missing_fields(set(seen), required_fields(f.name for f in manifest.fields))
    if not missing:
        return []
    return [f"{MANIFEST_NAME} lists field(s) {missing} that no shard holds: every read of a sample fails "
            "(MissingFieldError)"]


def load_manifest(folder: str | os.PathLike[str]) -> Manifest:
    """The manifest of a shard folder or folder URL (ManifestError naming the file or URL)."""
    text = os.fspath(folder)
    if not is_url(text):
        return Manifest.load(folder)
    url = url_join(folder_url(text), MANIFEST_NAME)
    try:
        data = read_bytes(url, what="fetching manifest")
    except RemoteError as e:
        raise ManifestError(str(e)) from e
    with tempfile.TemporaryDirectory(prefix="fastdata-manifest-") as tmp:
        local = Path(tmp) / MANIFEST_NAME
        local.write_bytes(data)
        try:
            return Manifest.load(local)
        except ManifestError as e:
            raise ManifestError(str(e).replace(str(local), redact_url(url))) from None


def verify_remote_shard(base_url: str, manifest: Manifest, shard: ShardInfo, *,
                        seen: set[str] | None = None) -> list[str]:
    """:func:`verify_shard` of one shard at folder URL ``base_url``: downloaded to a temporary
    folder (with its index), checked there, deleted. Problems name the shard; fetch failures the URL."""
    base = folder_url(base_url)
    with tempfile.TemporaryDirectory(prefix="fastdata-verify-") as tmp:
        for name in (shard.name, shard.index):
            if not name:
                continue
            url = url_join(base, name)
            local = Path(tmp) / name
            local.parent.mkdir(parents=True, exist_ok=True)
            try:
                with RemoteStream(url) as src, open(local, "wb") as out:
                    while chunk := src.read(4 << 20):
                        out.write(chunk)
            except RemoteError as e:
                if getattr(e, "status", None) == 404 or isinstance(e.__cause__, FileNotFoundError) \
                        or "not found" in str(e).lower():
                    return [f"{name}: {'shard' if name == shard.name else 'index'} file is missing ({redact_url(url)})"]
                return [f"{name}: {e}"]
        return verify_shard(tmp, manifest, shard, seen=seen)


def verify_shard(folder: str | os.PathLike[str], manifest: Manifest, shard: ShardInfo, *,
                 seen: set[str] | None = None) -> list[str]:
    """Every problem of one shard of ``manifest`` in ``folder`` (empty if none); safe to run in threads.

    ``seen``: the shard's fields are added to it (for :func:`unheld_fields`).

    An HDF5 shard whose size or sha256 is wrong is not opened: the HDF5 library can crash or spin
    forever on a damaged file."""
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
    fmt = shard_format(manifest.format)
    if problems and not fmt.opens_damaged:  # the HDF5 library can hang or crash on a damaged file
        return problems
    try:
        fields = fmt.verify(folder, manifest, shard, problems)
    except (FastdataError, OSError) as e:
        return [*problems, f"{shard.name}: {e}"]
    if seen is not None:
        seen.update(fields)
    unknown = sorted(fields - {f.name for f in manifest.fields})
    if unknown:
        problems.append(f"{shard.name}: fields {unknown} are not listed in the manifest")
    return problems
