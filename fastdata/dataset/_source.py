"""Where a ShardedDataset's samples come from: a manifest folder, local tar files, or URLs.

- A folder (or ``manifest.json``) -> the manifest's shards, random access (tar or HDF5).
- Local tar paths or brace patterns (``data/shard-{000000..000099}.tar``) without a manifest ->
  random access; each shard is indexed by its sidecar ``.idx`` or by a header scan.
- A folder URL with a ``manifest.json`` (``https://host/ds/``, ``s3://bucket/ds``, or
  :class:`RemoteShards` for options) -> random access like a local folder: each shard is
  downloaded once per host into the node-local cache (:mod:`fastdata.nodecache`),
  verified against the manifest's sha256, and read from local disk.
- URLs of tar files (``s3://``, ``https://``, ... through fsspec) -> streaming only: shards are
  split between ranks and workers whole, samples are read in file order (no random access);
  each shard is one sequential GET (no Range requests), resumed after transient drops.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdata._util import byte_limit
from fastdata.dataset._readers import _LOCK_FREE
from fastdata.errors import ManifestError, RemoteError, ShardError, SourceError, SourceNotFoundError
from fastdata.manifest import MANIFEST_NAME, Manifest
from fastdata.shards import shard_format
from fastdata.io import (RemoteStream, RetryPolicy, env_retry, folder_url, is_url, local_path, read_bytes,
                         redact_url, split_query, url_identity, url_join)

__all__ = ["RemoteShards", "Source", "resolve_source"]

_is_url = is_url
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_HDF5_SUFFIXES = (".h5", ".hdf5")


@dataclass(frozen=True)
class RemoteShards:
    """A remote shard folder (``manifest.json`` at ``url``) read through a node-local cache.

    Pass it as ``ShardedDataset(source=...)``; a plain folder URL string means the defaults.

    Args:
        url: folder URL (``https://``, ``s3://``, ``gs://``, anything fsspec opens) or the URL of
            its ``manifest.json``.
        cache_dir: node-local folder for verified shards (default ``$FASTDATA_NODE_CACHE`` or
            ``~/.cache/fastdata/shards``); shared by every process on the host.
        max_bytes: byte limit of the cache (``"200GB"`` or an int; None: no limit).
        prefetch: shards each reading process downloads ahead of need.
        eviction: ``"future"`` (the shard needed furthest in the future goes first) or ``"lru"``.
        retries: attempts per request on transient failures (exponential backoff with jitter).
    """

    url: str
    cache_dir: str | os.PathLike[str] | None = None
    max_bytes: int | str | None = None
    prefetch: int = 2
    eviction: str = "future"
    retries: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not is_url(self.url):
            raise ValueError(f"RemoteShards.url must be a URL (scheme://...), got {self.url!r}")
        if self.max_bytes is not None:
            object.__setattr__(self, "max_bytes", byte_limit(self.max_bytes, name="RemoteShards.max_bytes"))
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 1:
            raise ValueError(f"RemoteShards.retries must be an int >= 1 (attempts per request), got {self.retries!r}")
        # checked here, before the manifest is fetched (a network round trip, retried when the server is down)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"RemoteShards.prefetch must be an int >= 0 (shards downloaded ahead), "
                             f"got {self.prefetch!r}")
        from fastdata.nodecache import EVICTION_POLICIES

        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"RemoteShards.eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"RemoteShards.cache_dir must be a path (str or os.PathLike) or None, "
                            f"got {self.cache_dir!r}")
        if self.cache_dir is not None and not os.fspath(self.cache_dir):  # '' would be the current folder
            raise ValueError("RemoteShards.cache_dir must be a non-empty path or None (the default folder), got ''")
        RetryPolicy(attempts=self.retries)  # validates

    @property
    def base_url(self) -> str:
        return folder_url(self.url)  # a signed folder URL's token stays on every URL made from it

    def __repr__(self) -> str:  # a signed URL's token stays out of logs
        return (f"RemoteShards(url={redact_url(self.url)!r}, cache_dir={self.cache_dir!r}, "
                f"max_bytes={self.max_bytes!r}, prefetch={self.prefetch!r}, eviction={self.eviction!r}, "
                f"retries={self.retries!r})")


def _expand(pattern: str) -> list[str]:
    if "{" not in pattern:
        return [pattern]
    from braceexpand import braceexpand  # a dependency of fastdata (brace patterns)

    return list(braceexpand(pattern))


@dataclass
class Source:
    """Shards of a dataset and how to read them."""

    names: list[str]  # display names (paths, or URLs with a signed URL's tokens hidden), in manifest order
    sizes: list[int] | None  # samples per shard; None for streaming sources
    fingerprint: str  # identifies the content (manifest), the files (path, size, mtime) or the URLs (url_identity)
    streaming: bool = False
    fields: tuple[str, ...] | None = None  # all fields: the manifest's, or those the tar indexes hold
    _opener: Any = field(default=None, repr=False)
    node_cache: Any = field(default=None, repr=False)  # ShardCache of a remote manifest
    retry: RetryPolicy | None = field(default=None, repr=False)  # streaming sources
    urls: list[str] | None = field(default=None, repr=False)  # streaming sources: the URLs read (tokens kept)
    # tar members that give no sample data, found while indexing (a symlink out of the archive, ...):
    # {"shard", "key", "member", "index": None, "reason"}
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def reader(self, i: int) -> Any:
        """A random-access reader of shard ``i`` (lazy: opens on first use)."""
        return self._opener(i)

    def stream(self, i: int, skipped: list[tuple[str, str]] | None = None) -> Iterator[dict[str, Any]]:
        """Samples of shard ``i`` in file order (streaming sources); members left out go to ``skipped``
        as ``(member, reason)``."""
        from fastdata.shards.tar import iter_tar_stream

        url, name = (self.urls or self.names)[i], self.names[i]
        try:
            with RemoteStream(url, retry=self.retry or env_retry()) as raw:
                if split_query(url)[0].lower().endswith((".gz", ".tgz")):
                    import gzip

                    with gzip.GzipFile(fileobj=raw, mode="rb") as f:  # type: ignore[arg-type]
                        yield from iter_tar_stream(f, name, skipped)  # type: ignore[arg-type]
                else:
                    yield from iter_tar_stream(raw, name, skipped)  # type: ignore[arg-type]
        except ShardError as e:
            if isinstance(e.__cause__, RemoteError):  # the network failed, not the tar: say so
                raise e.__cause__ from None
            raise

    def plan_reads(self, plan: Any, epoch: int, seq: Any, num_workers: int, done: float) -> None:
        """Tell the node cache (remote manifests) what this process reads next; no-op otherwise.

        ``plan``: the rank's SplitPlan; ``seq``: the global indices this walk still reads;
        ``done``: the fraction of the walk already read. The ranks sharing this host
        (``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` of torchrun, else this rank alone) share the cache.
        """
        if self.node_cache is None:
            return
        from fastdata.dataset._split import read_order, shard_schedule

        base = getattr(plan, "base", plan)  # an ElasticPlan's epoch is approximated by the plain split
        ranks = _host_ranks(plan.rank, plan.world_size)
        schedule = shard_schedule(base, epoch + 1, ranks, num_workers)
        for s, t in shard_schedule(base, epoch, ranks, num_workers).items():
            schedule[s] = min(t, schedule.get(s, t))
        self.node_cache.plan(read_order(plan, seq), schedule, epoch + done)


class _ManifestOpener:
    def __init__(self, folder: Path, manifest: Manifest):
        self.folder, self.manifest = folder, manifest

    def __call__(self, i: int) -> Any:
        from fastdata.shards.reader import open_shard

        return open_shard(self.folder, self.manifest.shards[i], format=self.manifest.format,
                          fields=self.manifest.fields)  # checked against the manifest when first read


class _TarOpener:
    def __init__(self, readers: Sequence[Any]):
        self.readers = list(readers)

    def __call__(self, i: int) -> Any:
        return self.readers[i]


def _from_manifest(path: Path) -> Source:
    manifest = Manifest.load(path)
    folder = path if path.is_dir() else path.parent
    if manifest.num_samples == 0:
        raise SourceError(f"{folder / MANIFEST_NAME}: the dataset has no samples "
                          f"(the manifest lists {len(manifest.shards)} shard(s), all empty)")
    return Source(
        names=[str(folder / s.name) for s in manifest.shards],
        sizes=[s.num_samples for s in manifest.shards],
        fingerprint=manifest.fingerprint(),
        fields=tuple(f.name for f in manifest.fields),
        _opener=_ManifestOpener(folder, manifest),
    )


def _host_ranks(rank: int, world_size: int) -> list[int]:
    """Ranks on this host: torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE when they fit, else ``[rank]``."""
    try:
        local, local_n = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return [rank]
    first = rank - local
    if not (0 <= local < local_n and first >= 0 and first + local_n <= world_size):
        return [rank]
    return list(range(first, first + local_n))


class _CachedShard:
    """Lazy reader of shard ``i`` of a remote manifest: fetched into the node cache on first use.

    ``len()`` comes from the manifest (no download); everything else reads the local copy, under
    the shard's use lock (:meth:`ShardCache.acquire`). Open, it is watched by the cache
    (:meth:`ShardCache.watch`): when another process waits for space, a reader no thread has read
    for a while closes itself and releases its shard (:meth:`release_if_idle`); its next read
    reopens it.

    A read takes no lock (under the GIL): it appends to ``_busy`` before it reads ``_inner``, and
    :meth:`release_if_idle` sets ``_inner`` to None before it reads ``_busy`` (putting it back when
    a read is under way), so either the releaser sees the read or the read sees None and reopens
    under the lock, which the releaser holds until it is done. An ``iter_range`` counts as one read
    until it ends. ``_reads`` counts finished reads (the releaser's idle clock).
    """

    def __init__(self, cache: Any, i: int, fmt: str):
        self._cache, self._i, self._fmt = cache, i, fmt
        self.path = redact_url(cache.url(i))  # a display name, as Source.names
        self._reset()

    def _reset(self) -> None:
        """Fresh process-local state (a new reader, or one inherited through fork or unpickled:
        the parent's reader, use lock and thread lock stay the parent's)."""
        self._inner: Any = None
        self._pid: int | None = None  # the process that opened _inner (and holds its use lock)
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._busy: list[None] = []  # one entry per read in progress
        self._reads = 0
        self._seen = (-1, 0.0)  # (_reads, when the releaser first saw that count)

    def __repr__(self) -> str:
        return f"<remote shard reader {self.path}>"

    def _begin_read(self) -> Any:
        """The open inner reader, counted busy until :meth:`_end_read`."""
        if self._lock_pid != os.getpid():
            self._reset()
        busy = self._busy
        if _LOCK_FREE:
            busy.append(None)
            inner = self._inner
            if inner is not None:
                return inner
        try:
            with self._lock:
                if not _LOCK_FREE:
                    busy.append(None)
                return self._open()
        except BaseException:
            busy.pop()
            raise

    def _end_read(self) -> None:
        self._busy.pop()
        self._reads += 1

    def _open(self) -> Any:
        """The inner reader, opened if needed (under ``_lock``)."""
        if self._inner is None:
            local = self._cache.acquire(self._i)
            try:
                # checked against the manifest as a local folder's shards are (open_shard): sample count,
                # the fields it lists (HDF5: also kinds, shapes, dtypes)
                shard, fields = self._cache.manifest.shards[self._i], self._cache.manifest.fields
                fmt = shard_format(self._fmt)
                index = self._cache.index_path(self._i)  # None: the format has no sidecar index
                inner = fmt.open(local, index=index, expect=shard, fields=fields)
                if index is not None:  # tar: the sidecar is a local file like any other, checked here
                    try:
                        _ = inner.index
                    except ShardError as e:  # empty after a host crash, edited: rebuilt (or the shard fetched again)
                        self._cache.repair_index(self._i, e)
                        inner = fmt.open(local, index=index, expect=shard, fields=fields)
                        _ = inner.index
            except BaseException:
                self._cache.release(self._i)
                raise
            self._pid = os.getpid()
            self._inner = inner
            self._cache.watch(self)
        return self._inner

    def __len__(self) -> int:
        return self._cache.manifest.shards[self._i].num_samples

    @property
    def keys(self) -> tuple[str, ...]:
        inner = self._begin_read()
        try:
            return inner.keys
        finally:
            self._end_read()

    def read(self, i: int, fields: Any = None) -> dict[str, Any]:
        inner = self._begin_read()
        try:
            return inner.read(i, fields=fields)
        finally:
            self._end_read()

    def iter_range(self, start: int = 0, stop: int | None = None, fields: Any = None) -> Iterator[dict[str, Any]]:
        inner = self._begin_read()
        try:
            yield from inner.iter_range(start, stop, fields=fields)
        finally:
            self._end_read()

    def release_if_idle(self, now: float, idle_s: float) -> bool:
        """Close the inner reader and release the shard's use lock when no read is under way and
        none finished in the ``idle_s`` seconds before ``now`` (as seen by earlier calls: the node
        cache's releaser calls this every poll); the next read reopens it. Never waits for a
        thread that is opening it. True when released."""
        reads = self._reads
        if reads != self._seen[0]:
            self._seen = (reads, now)
            return False
        if now - self._seen[1] < idle_s or self._inner is None or self._lock_pid != os.getpid():
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            inner = self._inner
            self._inner = None  # before _busy is read (see the class docstring)
            if inner is None or self._busy or self._reads != reads:
                self._inner = inner  # a read is under way (one that saw None waits for the lock)
                return False
            self._close_inner(inner)
            return True
        finally:
            self._lock.release()

    def _close_inner(self, inner: Any) -> None:
        """Close ``inner`` (taken out of ``_inner``), then release its use lock (under ``_lock``)."""
        if inner is not None and self._pid == os.getpid():
            try:
                inner.close()  # the memory map goes before the use lock: eviction deletes a file nobody maps
            finally:
                self._cache.unwatch(self)
                self._cache.release(self._i)

    def close(self) -> None:
        if self._lock_pid != os.getpid():
            self._reset()
            return
        with self._lock:
            inner, self._inner = self._inner, None
            self._close_inner(inner)

    def __enter__(self) -> _CachedShard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"_cache": self._cache, "_i": self._i, "_fmt": self._fmt, "path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()


class _NodeCacheOpener:
    def __init__(self, cache: Any):
        self.cache = cache

    def __call__(self, i: int) -> Any:
        return _CachedShard(self.cache, i, self.cache.manifest.format)


def _load_remote_manifest(spec: RemoteShards) -> tuple[Manifest, Path]:
    """Fetch and validate ``manifest.json`` of ``spec``; keep a copy in the cache folder."""
    from fastdata.nodecache import default_cache_dir

    url = url_join(spec.base_url, MANIFEST_NAME)
    data = read_bytes(url, retry=RetryPolicy(attempts=spec.retries), what="fetching manifest")
    root = Path(spec.cache_dir).expanduser().absolute() if spec.cache_dir is not None else default_cache_dir()
    folder = root / "manifests"
    local = folder / (hashlib.sha256(data).hexdigest()[:24] + ".json")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not local.is_file():
            tmp = folder / f".{local.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            try:
                tmp.write_bytes(data)
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as e:
        raise RemoteError(f"node cache folder {root} (RemoteShards.cache_dir or $FASTDATA_NODE_CACHE): cannot "
                          f"keep the manifest of {redact_url(url)} there: {e}") from e
    try:
        return Manifest.load(local), root
    except ManifestError as e:
        raise ManifestError(str(e).replace(str(local), redact_url(url))) from None


def _from_remote_manifest(spec: RemoteShards) -> Source:
    from fastdata.nodecache import ShardCache

    manifest, root = _load_remote_manifest(spec)
    if manifest.num_samples == 0:  # as for a local folder: named, before a node-cache folder is made for it
        raise SourceError(f"{redact_url(url_join(spec.base_url, MANIFEST_NAME))}: the dataset has no samples "
                          f"(the manifest lists {len(manifest.shards)} shard(s), all empty)")
    cache = ShardCache(spec.base_url, manifest, directory=root, max_bytes=spec.max_bytes,  # type: ignore[arg-type]
                       prefetch=spec.prefetch, eviction=spec.eviction, retry=RetryPolicy(attempts=spec.retries))
    return Source(
        names=[redact_url(url_join(spec.base_url, s.name)) for s in manifest.shards],
        sizes=[s.num_samples for s in manifest.shards],
        fingerprint=manifest.fingerprint(),
        fields=tuple(f.name for f in manifest.fields),
        _opener=_NodeCacheOpener(cache),
        node_cache=cache,
    )


def _from_local_tars(paths: list[str]) -> Source:
    from fastdata.shards.tar import TarShardReader

    readers, ident = [], []
    for p in paths:
        local = os.path.abspath(local_path(p))  # "~/shards/0.tar" too, as Cache and ShardWriter expand it; a chdir
        try:
            st = os.stat(local)
        except OSError as e:
            raise (SourceNotFoundError if isinstance(e, FileNotFoundError) else SourceError)(
                f"shard {p}: {e.strerror or e}") from e
        if os.path.isdir(local):
            raise SourceError(f"shard {p} is a folder: a list of sources names tar files (the folders of several "
                              f"datasets are not combined); pass the folder itself, which reads its {MANIFEST_NAME}")
        if local.lower().endswith(_HDF5_SUFFIXES):
            raise SourceError(f"shard {p}: an HDF5 shard is read through its folder's {MANIFEST_NAME}: pass the "
                              f"folder {os.path.dirname(local) or '.'!r}")
        if not local.lower().endswith(".tar"):
            raise SourceError(f"shard {p}: only uncompressed .tar shards can be read without a manifest "
                              "(use a URL for streaming, or convert with `fastdata shard`)")
        readers.append(TarShardReader(local))
        ident.append([os.path.abspath(local), st.st_size, st.st_mtime_ns])
    sizes = [len(r) for r in readers]  # sidecar index or header scan
    fields, skipped = _check_tar_indexes(readers)
    digest = hashlib.sha256(json.dumps(ident).encode("utf-8")).hexdigest()
    return Source(names=[r.path for r in readers], sizes=sizes, fingerprint=f"files:{digest}",
                  fields=fields, _opener=_TarOpener(readers), skipped=skipped)


def _check_tar_indexes(readers: Sequence[Any]) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """Fields of tar shards without a manifest and the members their indexes left out.

    The keys are known once the shards are indexed: a key in two shards (or one shard listed
    twice) is a SourceError naming both, an empty source one naming the shards.
    """
    from fastdata.shards import split_member_name

    first: dict[str, int] = {}
    seen_paths: dict[str, int] = {}
    fields: set[str] = set()
    skipped: list[dict[str, Any]] = []
    for s, reader in enumerate(readers):
        real = os.path.realpath(reader.path)
        if real in seen_paths:
            raise SourceError(f"shard {reader.path} is listed twice in the source (also as "
                              f"{readers[seen_paths[real]].path}); its samples would be read twice")
        seen_paths[real] = s
        index = reader.index
        for key in index.keys:
            other = first.setdefault(key, s)
            if other != s:
                raise SourceError(f"key {key!r} is in shard {readers[other].path} and in shard {reader.path}: "
                                  "keys must be unique across the shards of a dataset (remove the duplicate "
                                  "shard or rename the samples)")
        fields.update(f for m in index.members for f, _, _ in m)
        for member, reason in index.skipped:
            parts = split_member_name(member)
            skipped.append({"shard": reader.path, "key": None if parts is None else parts[0], "member": member,
                            "index": None, "reason": reason})
    if not first:
        names = ", ".join(r.path for r in readers[:3]) + (", ..." if len(readers) > 3 else "")
        raise SourceError(f"{names}: the dataset has no samples (every shard is empty)")
    return tuple(sorted(fields)), skipped


def _refuse_hdf5_urls(urls: Sequence[str]) -> None:
    """An HDF5 shard has no stream form: a URL of one is read through its folder's manifest (random access).
    Streamed as tar it was called corrupt; alone it was taken for a folder (its manifest.json: HTTP 404)."""
    for url in urls:
        path = split_query(url)[0]
        if path.lower().endswith(_HDF5_SUFFIXES):
            folder = path.rsplit("/", 1)[0] + "/"
            raise SourceError(f"{redact_url(url)}: an HDF5 shard is read through its folder's {MANIFEST_NAME}, "
                              f"not streamed (URLs are streamed as tar files): pass the folder URL "
                              f"{redact_url(folder)!r} (signed for the folder where it needs a token) or "
                              "fastdata.RemoteShards(folder URL)")


def resolve_source(source: str | os.PathLike[str] | RemoteShards | Sequence[str | os.PathLike[str]]) -> Source:
    """Turn the ``source`` argument of ShardedDataset into a :class:`Source`."""
    if isinstance(source, RemoteShards):
        return _from_remote_manifest(source)
    if isinstance(source, str) and is_url(source) and "{" not in source:
        _refuse_hdf5_urls([source])
        if not split_query(source)[0].lower().endswith(_TAR_SUFFIXES):  # a signed tar URL is a tar URL
            return _from_remote_manifest(RemoteShards(source))
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        p = Path(os.path.abspath(local_path(text)))  # a file:// folder too, "~/shards"; a later chdir changes nothing
        if not _is_url(text) and "{" not in text:
            if p.is_dir():
                if not (p / MANIFEST_NAME).is_file():
                    raise SourceNotFoundError(f"{p}: no {MANIFEST_NAME} in this folder; pass the folder written by "
                                              "`fastdata shard` or ShardWriter, or a list/brace pattern of tar files")
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
        _refuse_hdf5_urls(paths)
        # the dataset's identity (resume states are checked against it): a rotated token or password
        # (signed URLs expire) names the same shards, another object or another order does not
        digest = hashlib.sha256(json.dumps([url_identity(p) for p in paths]).encode("utf-8")).hexdigest()
        return Source(names=[redact_url(p) for p in paths], sizes=None, fingerprint=f"urls:{digest}", streaming=True,
                      urls=list(paths))
    return _from_local_tars(paths)
