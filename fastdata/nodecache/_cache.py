"""ShardCache: one process's handle on the node-local cache folder of one remote manifest.

A shard's verified copy is ``<root>/<shard name>`` (tar: with its ``.idx`` rebuilt locally) and exists
only once its size and sha256 matched the manifest. :meth:`ShardCache.ensure` downloads a shard at
most once per host (under the shard's ``.locks/<n>.lock``); :meth:`ShardCache.acquire` also takes
its shared use lock, which keeps it from eviction until :meth:`ShardCache.release`. The handle is
picklable and fork-safe: a process other than the one that made it starts with fresh threads and
locks. Space and eviction live in :mod:`._space`, the background threads in :mod:`._threads`.
Design note: ``docs/design/nodecache.md``.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdata.errors import RemoteError
from fastdata.io import RetryPolicy, redact_url, remote_error, split_query, url_identity, url_join
from fastdata.manifest import Manifest, ShardInfo
from fastdata.nodecache._download import download_verified
from fastdata.nodecache._errors import Interrupted, NodeCacheError
from fastdata.nodecache._locks import flock, release_all, unlock
from fastdata.nodecache._space import SpaceAccounting
from fastdata.nodecache._threads import BackgroundThreads
from fastdata.shards import shard_format

__all__ = ["EVICTION_POLICIES", "NodeCacheError", "ShardCache", "default_cache_dir"]

EVICTION_POLICIES = ("future", "lru")
_FAILED_FRESH_S = 30.0  # a prefetch's failure older than this is not handed to the demand fetch

_log = logging.getLogger("fastdata.nodecache")


def default_cache_dir() -> Path:
    """``$FASTDATA_NODE_CACHE``, else ``$XDG_CACHE_HOME/fastdata/shards`` (``~/.cache/...``)."""
    env = os.environ.get("FASTDATA_NODE_CACHE")
    if env:
        return Path(env).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return (Path(base).expanduser() / "fastdata" / "shards").absolute()


@dataclass
class _Stats:
    hits: int = 0  # shard found verified on local disk
    downloads: int = 0  # shards this process downloaded
    waited: int = 0  # shards another process downloaded while this one waited for its lock
    evictions: int = 0
    downloaded_bytes: int = 0
    retries: int = 0


class ShardCache(BackgroundThreads, SpaceAccounting):
    """One process's handle on the node-local cache folder of one remote manifest.

    Args:
        base_url: folder URL of the shard set (shard ``name`` is at ``base_url/name``).
        manifest: its manifest (names, sizes, sha256).
        directory: the node-local cache root (default :func:`default_cache_dir`).
        max_bytes: byte limit for verified shards plus downloads in progress (None: no limit).
        prefetch: shards downloaded ahead of need, in this process's read order.
        eviction: ``"future"`` (furthest next use first) or ``"lru"``.
        retry: retries of transient download failures (checksum mismatches included).
    """

    def __init__(self, base_url: str, manifest: Manifest, *, directory: str | os.PathLike[str] | None = None,
                 max_bytes: int | None = None, prefetch: int = 2, eviction: str = "future",
                 retry: RetryPolicy | None = None):
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        biggest = max((s.bytes for s in manifest.shards), default=0)
        if max_bytes is not None and max_bytes < biggest:
            raise ValueError(f"node cache max_bytes={max_bytes} is smaller than the largest shard of "
                             f"{redact_url(base_url)} ({biggest} bytes)")
        path, query = split_query(base_url)
        self.base_url = path.rstrip("/") + query
        self.manifest = manifest
        self.max_bytes = max_bytes
        self.prefetch = prefetch
        self.eviction = eviction
        self.retry = retry or RetryPolicy()
        # not the query nor a password: a signed URL's token changes, the shards (the manifest's fingerprint) do not
        ident = hashlib.sha256(f"{url_identity(path.rstrip('/'))}\n{manifest.fingerprint()}".encode()).hexdigest()[:24]
        # "~" expanded, and absolute: an os.chdir later (or a worker's other cwd) finds the same folder
        self.root = Path(directory).expanduser().absolute() / ident if directory is not None \
            else default_cache_dir() / ident
        self._index = {s.name: i for i, s in enumerate(manifest.shards)}
        # shard files by their path in the folder ("a//b.tar" is "a/b.tar") and the folders that hold them ("": root)
        self._files = {os.path.normpath(s.name): i for i, s in enumerate(manifest.shards)}
        self._dirs = sorted({os.path.dirname(name) for name in self._files})
        self.stats = _Stats()
        self._schedule: dict[int, float] = {}  # shard -> time of next need (epochs; fraction inside)
        self._order: list[int] = []  # this process's read order of shards in the current iteration
        self._pos_in_order: dict[int, int] = {}
        self._now = 0.0
        self._setup()

    # ----- process-local state (recreated after fork) -----------------------------------------
    def _setup(self) -> None:
        self._pid = os.getpid()
        self._format = shard_format(self.manifest.format)  # its registry entry (holds lambdas: not pickled)
        self._lock = threading.Lock()
        self._queue: queue.Queue[int | None] | None = None  # prefetch requests for the daemon threads
        self._pending: dict[int, threading.Event] = {}
        # prefetches that failed after every retry: (time.monotonic(), error); raised by the shard's
        # demand fetch when at most _FAILED_FRESH_S old and of this plan (else that fetch tries again)
        self._failed: dict[int, tuple[float, Exception]] = {}
        self._active: set[int] = set()  # shards a prefetch thread is fetching now
        self._prefetchers: list[tuple[threading.Thread, queue.Queue[int | None]]] = []  # threads, their queue
        self._interrupt = threading.Event()  # set while the process forks: prefetch downloads stop
        self._requeue: list[int] = []  # prefetches stopped for a fork: queued again after it
        self._use: dict[int, list[int]] = {}  # shard -> fds holding its shared use lock
        # a handle dropped with shards open (a dataset object let go of) gives their use locks back
        self._finalizer = weakref.finalize(self, release_all, self._use, self._pid)
        self._token = uuid.uuid4().hex[:12]  # names this handle's registration in .waits/
        self._waits: dict[int, int] = {}  # thread ident -> shard it waits for space for
        self._gave_up = False  # raised the deadlock error: the registration stays until shards are released
        self._readers: weakref.WeakSet[Any] = weakref.WeakSet()  # open readers that give way (watch())
        self._releaser: threading.Thread | None = None  # their daemon thread (see ._threads)
        self._releaser_wake = threading.Event()  # ends the releaser's sleep early (a fork, a close)
        self._releaser_paused = False  # stopped for a fork: restart it after
        try:
            for sub in (".locks", ".tmp", ".waits"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NodeCacheError(f"node cache folder {self.root} (RemoteShards.cache_dir or $FASTDATA_NODE_CACHE) "
                                 f"cannot be created: {e}") from e

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._setup()  # threads and locks of the parent do not exist here

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_lock", "_queue", "_pending", "_failed", "_active", "_use", "_waits", "_readers",
                     "_releaser", "_releaser_wake", "_releaser_paused", "_finalizer", "_prefetchers", "_interrupt",
                     "_requeue", "_format"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    # ----- paths ----------------------------------------------------------------------------
    def path(self, i: int) -> Path:
        """Local path of shard ``i`` (present only once verified)."""
        return self.root / self.manifest.shards[i].name

    def index_path(self, i: int) -> Path | None:
        """Local path of shard ``i``'s sidecar index; None for a format without one (HDF5)."""
        suffix = self._format.index_suffix
        return None if suffix is None else self.root / (self.manifest.shards[i].name + suffix)

    def _drop_index(self, i: int) -> None:
        """Delete shard ``i``'s sidecar index, if its format has one and it is there."""
        index = self.index_path(i)
        if index is not None:
            index.unlink(missing_ok=True)

    def url(self, i: int) -> str:
        return url_join(self.base_url, self.manifest.shards[i].name)

    def _lock_path(self, i: int, kind: str) -> Path:
        return self.root / ".locks" / f"{i}.{kind}"

    def is_local(self, i: int) -> bool:
        """Shard ``i`` is in the cache: its file has the manifest's size (a file of another size, e.g.
        left truncated by a host crash, is no copy: the next fetch replaces it)."""
        try:
            return self.path(i).stat().st_size == self.manifest.shards[i].bytes
        except OSError:
            return False

    # ----- plan (what the dataset will read) ---------------------------------------------------
    def plan(self, order: Sequence[int], schedule: dict[int, float], now: float) -> None:
        """This process reads shards in ``order`` next; the host's ranks need shard ``s`` at time
        ``schedule[s]`` (epochs, fractions inside one); the current time is ``now``.

        Starts downloading the first ``prefetch`` shards of ``order`` in the background.
        """
        self._check_pid()
        with self._lock:
            self._order = list(dict.fromkeys(int(s) for s in order))
            self._pos_in_order = {s: k for k, s in enumerate(self._order)}
            self._schedule = dict(schedule)
            self._now = float(now)
            self._failed.clear()  # a new walk: its fetches try again (an abandoned walk's failures are old news)
        self._prefetch_after(-1)

    def _advance(self, i: int) -> None:
        k = self._pos_in_order.get(i)
        if k is None or not self._order:
            return
        epoch = math.floor(self._now)
        t = epoch + k / len(self._order)
        if t > self._now:
            self._now = t
        self._prefetch_after(k)

    def _next_use(self, i: int) -> float:
        t = self._schedule.get(i)
        if t is None or t < self._now:
            return math.inf
        return t

    # ----- public entry points ------------------------------------------------------------------
    def ensure(self, i: int) -> Path:
        """Local path of verified shard ``i``, downloading it first if needed (blocks)."""
        self._check_pid()
        path = self.path(i)
        if self.is_local(i):
            self.stats.hits += 1
            _touch(path)
        else:
            with self._lock:
                pending = self._pending.get(i)
                if pending is not None and i not in self._active:
                    del self._pending[i]  # only queued: fetch it here rather than wait for its turn
                    pending.set()
                    pending = None
            if pending is not None:
                pending.wait()  # a prefetch thread is downloading it
            with self._lock:
                when, failed = self._failed.get(i, (0.0, None))
                if failed is not None and time.monotonic() - when > _FAILED_FRESH_S:
                    del self._failed[i]  # the network may be back: the demand fetch tries again
                    failed = None
            if failed is not None and not self.is_local(i):  # a fetch of this walk used up every retry already
                raise _again(failed, when) from failed
            if self.is_local(i):
                self.stats.hits += 1
            else:
                try:
                    self._fetch(i, demand=True)
                except RemoteError as e:
                    if getattr(e, "url", None) is not None:  # the server's answer or the content, not local disk
                        # remembered for this walk (at most _FAILED_FRESH_S): each sample of the shard that
                        # is read next (on_error="skip", several threads) fails at once, without a retry storm
                        with self._lock:
                            self._failed[i] = (time.monotonic(), e)
                    raise
        self._advance(i)
        return path

    def acquire(self, i: int) -> Path:
        """:meth:`ensure` and mark shard ``i`` as in use by this process until :meth:`release`."""
        self._check_pid()
        try:
            return self._acquire(i)
        except RemoteError:
            raise
        except OSError as e:  # a lock file, the folder: this host's side (the network's are RemoteErrors)
            raise NodeCacheError(
                f"node cache {self.root}: shard {self.manifest.shards[i].name}: {e} (every process on this host "
                "needs to create and lock files in RemoteShards.cache_dir or $FASTDATA_NODE_CACHE: a folder of "
                "another user or a read-only one is no node cache; choose another cache_dir)") from e

    def _acquire(self, i: int) -> Path:
        while True:
            path = self.ensure(i)
            fd = os.open(self._lock_path(i, "use"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if self.is_local(i):  # not evicted between ensure and the lock
                with self._lock:  # _use is shared by this process's threads (readers, the idle-reader thread)
                    self._use.setdefault(i, []).append(fd)
                return path
            unlock(fd)

    def release(self, i: int) -> None:
        """Undo one :meth:`acquire` of shard ``i`` (in this process)."""
        if self._pid != os.getpid():
            return  # the parent's locks are not ours to release
        with self._lock:
            fds = self._use.get(i)
            if not fds:
                return
            fd = fds.pop()
            emptied = not fds
            if emptied:
                del self._use[i]
        unlock(fd)
        if emptied and self._gave_up:  # others may count this process as stuck: tell them what it holds now
            with flock(self.root / ".locks" / "space.lock"):
                self._write_wait()

    # ----- idle readers give way to processes waiting for space ------------------------------------
    def watch(self, reader: Any) -> None:
        """Register an open reader of this process that holds a use lock (of :meth:`acquire`).

        With ``max_bytes``, a daemon thread calls ``reader.release_if_idle(now, idle_s)`` every
        ``_RELEASE_POLL_S`` (``idle_s`` infinite unless another process waits for space and this
        one does not): the reader closes itself and releases its shard when no thread has read it
        for ``idle_s`` (it reopens on its next read). Unregistered by :meth:`unwatch` or when it
        is garbage."""
        self._check_pid()
        if self.max_bytes is None:
            return  # nothing waits for space
        with self._lock:
            self._readers.add(reader)
            if self._releaser is None:
                self._start_releaser()

    def unwatch(self, reader: Any) -> None:
        """Undo :meth:`watch` (the reader closed)."""
        if self._pid == os.getpid():
            with self._lock:
                self._readers.discard(reader)

    def close(self) -> None:
        """Stop prefetching and release every use lock of this process."""
        if self._pid != os.getpid():
            return
        requests, self._queue = self._queue, None
        with self._lock:
            self._readers.clear()
            self._releaser = None  # its thread exits at its next poll
            self._releaser_paused = False
            self._releaser_wake.set()
        if requests is not None:
            with self._lock:
                pending, self._pending = dict(self._pending), {}
            for event in pending.values():
                event.set()  # nobody waits for these any more
            for _ in range(min(4, self.prefetch)):
                requests.put(None)
        for i in self._held():
            while self._use.get(i):
                self.release(i)

    # ----- download ----------------------------------------------------------------------------
    def _fetch(self, i: int, *, demand: bool) -> None:
        path = self.path(i)
        t0 = time.perf_counter()
        with flock(self._lock_path(i, "lock")):
            if self.is_local(i):  # another process or thread downloaded it while we waited
                self.stats.waited += 1
                return
            if path.exists():  # a damaged copy (host crash, edits): never read, replaced below
                _log.warning("node cache: %s has %s bytes, the manifest says %d: downloading it again", path,
                             _size(path), self.manifest.shards[i].bytes)
                path.unlink(missing_ok=True)
                self._drop_index(i)
            for stale in (self.root / ".tmp").glob(f"{i}-*.part"):  # a killed downloader's leftovers
                stale.unlink(missing_ok=True)
            shard = self.manifest.shards[i]
            for attempt in range(1, self.retry.attempts + 1):
                tmp = self._reserve(i, shard, demand=demand)
                if tmp is None:
                    return  # prefetch without room: leave it to the demand fetch
                try:
                    self._download(i, shard, tmp, interruptible=not demand)
                    if self.index_path(i) is not None:  # tar: its sidecar index
                        self._build_index(i, tmp)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp, path)
                    break
                except BaseException as e:
                    tmp.unlink(missing_ok=True)
                    self._drop_index(i)
                    if not isinstance(e, Exception) or isinstance(e, Interrupted):
                        raise
                    if isinstance(e, OSError) and not isinstance(e, RemoteError):  # the network's are RemoteErrors
                        raise NodeCacheError(f"node cache {self.root}: cannot store {shard.name} downloaded from "
                                          f"{redact_url(self.url(i))}: {e} (free space on that disk, lower "
                                          "RemoteShards.max_bytes, or choose another cache_dir)") from e
                    if getattr(e, "checksum", False):  # maybe a bad proxy or a torn write: try again
                        if attempt < self.retry.attempts:
                            self.stats.retries += 1
                            time.sleep(self.retry.delay(attempt))
                            continue
                        raise RemoteError(f"{e} (after {attempt} attempts)") from e
                    raise remote_error(self.url(i), e, "downloading") from e  # RemoteStream retried already
        self.stats.downloads += 1
        self.stats.downloaded_bytes += shard.bytes
        _log.debug("node cache: %s downloaded in %.2fs", redact_url(self.url(i)), time.perf_counter() - t0)

    def _download(self, i: int, shard: ShardInfo, tmp: Path, *, interruptible: bool = False) -> None:
        """Stream shard ``i`` into ``tmp``, checked against the manifest (:func:`download_verified`);
        ``interruptible`` (a prefetch): stopped at the next chunk once the process forks."""
        interrupt = self._interrupt if interruptible else None
        download_verified(self.url(i), shard, tmp, retry=self.retry, interrupt=interrupt)

    def repair_index(self, i: int, error: Exception) -> None:
        """The sidecar index of local shard ``i`` (held by :meth:`acquire`) failed to load with
        ``error`` (a host crash left it empty, or it was edited): rebuild it from the shard, whose
        size matches the manifest; when that fails too the copy is damaged: download it again."""
        _log.warning("node cache: %s: %s; rebuilding it", self.index_path(i), error)
        with flock(self._lock_path(i, "lock")):
            try:
                self._build_index(i, self.path(i))
                return
            except Exception as e:  # noqa: BLE001 - a damaged copy: replaced below
                _log.warning("node cache: %s is damaged (%s): downloading it again", self.path(i), e)
                self.path(i).unlink(missing_ok=True)
                self._drop_index(i)
        self._fetch(i, demand=True)

    def _build_index(self, i: int, tmp: Path) -> None:
        """Build and save the sidecar index of shard ``i`` (its format has one) from ``tmp``."""
        path, build = self.index_path(i), self._format.build_index
        if path is None or build is None:
            raise TypeError(f"format {self._format.name!r} has no sidecar index")
        index = build(tmp)
        if len(index) != self.manifest.shards[i].num_samples:
            raise RemoteError(f"{redact_url(self.url(i))}: has {len(index)} samples, manifest says "
                              f"{self.manifest.shards[i].num_samples}")
        path.parent.mkdir(parents=True, exist_ok=True)
        index.save(path)


def _again(e: Exception, when: float) -> RemoteError:
    """A new RemoteError repeating ``e`` (a failed fetch at ``when``) for another read of its shard."""
    kind = NodeCacheError if isinstance(e, NodeCacheError) else RemoteError  # this host's side stays unskippable
    err = kind(f"{e} (an attempt {time.monotonic() - when:.0f} s ago in this pass; the shard is "
               f"fetched again after {_FAILED_FRESH_S:g} s or in the next pass)")
    for name in ("url", "status", "transient", "checksum"):
        if hasattr(e, name):
            setattr(err, name, getattr(e, name))
    return err


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # mtime = last use, for LRU order
    except OSError:
        pass
