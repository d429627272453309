"""Node-local cache of a remote manifest's shards: download once per host, verify, evict wisely.

Layout of a dataset's cache folder (``<directory>/<id>/``, ``id`` from URL and manifest)::

    <shard name>          verified shard (present only after sha256 and size matched the manifest)
    <shard name>.idx      tar only: sidecar index rebuilt locally from the verified shard
    .locks/<n>.lock       flock held while shard n is downloaded (one download per host)
    .locks/<n>.use        shared flock held while a process reads shard n (not evicted then)
    .locks/space.lock     flock held while space is reserved or freed
    .tmp/<n>-<bytes>-<pid>-<uuid>.part   download in progress (its size counts against the limit)
    .waits/<pid>-<token>   JSON of a process waiting for space: the shards it holds open (see below)

Protocol of :meth:`ShardCache.ensure` (any number of processes, threads and ranks on a host):
take the shard's download lock; if the verified file exists, reuse it (whoever waited on the
lock now finds it); else reserve space (evicting under ``space.lock``), stream the download into
a uniquely named temporary file while hashing it, compare size and sha256 with the manifest,
``os.replace`` it into place, release the lock. A process killed mid-download leaves a ``.part``
that the next holder of that shard's lock (or a process waiting for space) removes. A shard file
whose size is not the manifest's (left by a host crash: nothing is fsynced) is no copy and is
replaced; a sidecar index that does not load is rebuilt (:meth:`ShardCache.repair_index`).

Eviction (``eviction="future"``, the default): the shard whose next use lies furthest in the
future goes first (Belady's rule). Each process knows the epoch's shard order in advance: the
dataset tells the cache, per iteration, which shards the ranks on this host read and at which
fraction of the epoch (:meth:`ShardCache.plan`); shards not needed again in this epoch or the
next rank last. Ties and processes without a plan fall back to least recently used, which is
also what ``eviction="lru"`` does (kept for comparison). Shards being read by any process on
the host (``.use`` lock) are never evicted.

Waiting for space: a demand download that does not fit waits for other processes to close shards
(120 s without progress at most). A process waiting in :meth:`ShardCache._reserve` registers the
shards it holds open in ``.waits/`` (written under ``space.lock``, refreshed every poll). When every
shard that pins the space is held by a waiting process and no download is in progress, nobody can
move on (e.g. DataLoader workers that each hold the shards the other needs): each waiter sees this
and raises a RemoteError after ``_DEADLOCK_S``. Registrations of dead processes and ones not
refreshed for ``_WAIT_FRESH_S`` are ignored, so a process that is merely slow never counts as stuck.

Idle readers give way: a process that holds shards open but does not read them (e.g. a DataLoader
worker parked by in-order delivery until another worker's batch arrives, or a consumer between
steps) would keep a waiter waiting forever when the waiter is the one it waits for. So while a
process with ``max_bytes`` holds open readers (:meth:`ShardCache.watch`), a daemon thread looks in
``.waits/`` every ``_RELEASE_POLL_S``; when another process waits for space and this one does not,
it closes this process's readers that no thread has read for ``_RELEASE_IDLE_S`` (their use locks
go with them, so the waiter can evict those shards). A released reader reopens on its next read,
through :meth:`ShardCache.acquire` (downloaded and verified again if it was evicted meanwhile).
The thread is stopped while the process forks (fork workers start) and started again after it.

Prefetch threads are stopped while the process forks too: a download under way stops at its next
chunk (its ``.part`` removed) and the parent prefetches the shards still wanted again after the fork.
A fork waits ``_FORK_JOIN_S`` at most for these threads; one still blocked then (a server that has not
answered, a retry's back-off, another process's download of the same shard) waits in a system call,
where it holds no lock of the process (only its own socket and files), and goes on in the parent.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdata.errors import CacheError, FastdataError, RemoteError
from fastdata.io import (RemoteStream, RetryPolicy, redact_url, remote_error, split_query, url_identity,
                         url_join)
from fastdata.manifest import Manifest, ShardInfo

__all__ = ["EVICTION_POLICIES", "NodeCacheError", "ShardCache", "default_cache_dir"]

EVICTION_POLICIES = ("future", "lru")
_CHUNK = 4 << 20
_PREFETCH_IDLE_S = 1.0  # an idle prefetch thread exits after this (no thread lingers, e.g. across a fork)
_DEADLOCK_S = 1.0  # every holder of the space waiting this long (seen on every poll): nobody can move on
_WAIT_FRESH_S = 10.0  # a waiter's registration not refreshed for this long no longer counts
_FAILED_FRESH_S = 30.0  # a prefetch's failure older than this is not handed to the demand fetch
_STALL_S = 120.0  # a demand download waiting this long without progress: RemoteError
_RELEASE_POLL_S = 0.1  # a process holding open readers looks this often for processes waiting for space
_RELEASE_IDLE_S = 0.5  # ... and then closes those of its readers no thread has read for this long
_WAITER_FRESH_S = 2.0  # a waiter refreshes its registration every poll (50 ms): older ones wait no more
_FORK_JOIN_S = 2.0  # the longest a fork waits for the cache's threads to stop (a poll, a chunk, a request)

# Caches whose releaser or prefetch threads may run in this process. None of them runs while the process
# forks (a DataLoader starting fork workers): a thread alive at fork time can leave a lock held in the child
# forever, and Python 3.12 warns about it. Stopped before the fork, restarted after it in the parent.
_RELEASING: weakref.WeakSet[ShardCache] = weakref.WeakSet()
_PREFETCHING: weakref.WeakSet[ShardCache] = weakref.WeakSet()


class NodeCacheError(RemoteError, CacheError):
    """The node cache's local side failed: its folder cannot be written or locked (another user's,
    read-only, full disk) or ``max_bytes`` cannot hold the shards in use. Names the folder. Not a
    sample's fault: never skipped under ``on_error`` (a ``CacheError``, as the preprocessing cache's
    own), else every sample of every shard would be "skipped", each one downloading its shard again."""


class _Interrupted(FastdataError):
    """A prefetch's download stopped because the process forks (not a failure: fetched again after)."""


def _pause_threads_before_fork() -> None:
    threads = []
    for cache in list(_RELEASING):
        thread = cache._stop_releaser()
        if thread is not None:
            threads.append(thread)
    for cache in list(_PREFETCHING):
        threads.extend(cache._stop_prefetch())
    deadline = time.monotonic() + _FORK_JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _resume_threads_after_fork() -> None:
    for cache in list(_RELEASING):
        cache._resume_releaser()
    for cache in list(_PREFETCHING):
        cache._resume_prefetch()
_log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$FASTDATA_NODE_CACHE``, else ``$XDG_CACHE_HOME/fastdata/shards`` (``~/.cache/...``)."""
    env = os.environ.get("FASTDATA_NODE_CACHE")
    if env:
        return Path(env).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return (Path(base).expanduser() / "fastdata" / "shards").absolute()


@contextmanager
def _flock(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, mode)
        try:
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicit: a forked child may share the description
    finally:
        os.close(fd)


def _try_flock(path: Path, mode: int) -> int | None:
    """An fd holding ``mode | LOCK_NB`` on ``path``, or None when someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd


def _unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@dataclass
class _Stats:
    hits: int = 0  # shard found verified on local disk
    downloads: int = 0  # shards this process downloaded
    waited: int = 0  # shards another process downloaded while this one waited for its lock
    evictions: int = 0
    downloaded_bytes: int = 0
    retries: int = 0


class ShardCache:
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
        self._finalizer = weakref.finalize(self, _release_all, self._use, self._pid)
        self._token = uuid.uuid4().hex[:12]  # names this handle's registration in .waits/
        self._waits: dict[int, int] = {}  # thread ident -> shard it waits for space for
        self._gave_up = False  # raised the deadlock error: the registration stays until shards are released
        self._readers: weakref.WeakSet[Any] = weakref.WeakSet()  # open readers that give way (watch())
        self._releaser: threading.Thread | None = None  # their daemon thread (see the module docstring)
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
                     "_requeue"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    # ----- paths ----------------------------------------------------------------------------
    def path(self, i: int) -> Path:
        """Local path of shard ``i`` (present only once verified)."""
        return self.root / self.manifest.shards[i].name

    def index_path(self, i: int) -> Path:
        return self.root / (self.manifest.shards[i].name + ".idx")

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

    # ----- prefetch --------------------------------------------------------------------------
    def _prefetch_after(self, k: int) -> None:
        if not self.prefetch or not self._order:
            return
        want = [s for s in self._order[k + 1 : k + 1 + self.prefetch] if not self.is_local(s)]
        if want:
            self._enqueue(want)

    def _enqueue(self, want: list[int]) -> None:
        """Queue prefetches of ``want`` for the prefetch threads (started if none run)."""
        with self._lock:
            if self._interrupt.is_set():
                self._requeue.extend(s for s in want if s not in self._requeue)  # forking now: after it
                return
            if self._queue is None:
                # daemon threads: a download in flight never keeps the interpreter from exiting (a
                # killed download leaves a .part file that the next holder of the shard's lock removes)
                self._queue = queue.Queue()
                self._prefetchers = [(t, q) for t, q in self._prefetchers if t.is_alive()]
                for k in range(min(4, self.prefetch)):
                    thread = threading.Thread(target=self._prefetch_loop, args=(self._queue,), daemon=True,
                                              name=f"fastdata-nodecache-{k}")
                    self._prefetchers.append((thread, self._queue))
                    thread.start()
                _PREFETCHING.add(self)
            for s in want:
                if s not in self._pending and s not in self._failed:  # a failed one waits for its demand fetch
                    self._pending[s] = threading.Event()
                    self._queue.put(s)

    def _prefetch_loop(self, requests: queue.Queue[int | None]) -> None:
        while True:
            try:
                i = requests.get(timeout=_PREFETCH_IDLE_S)
            except queue.Empty:
                with self._lock:  # idle: retire this queue's threads; the next prefetch starts new ones
                    if self._queue is requests and requests.empty():
                        self._queue = None
                    if self._queue is not requests:
                        return
                continue
            if i is None:
                return
            with self._lock:
                if i not in self._pending:
                    continue  # fetched on demand meanwhile, or the cache was closed
                self._active.add(i)
            try:
                self._fetch(i, demand=False)
            except _Interrupted:
                pass  # the process forks: fetched again after it (a demand fetch meanwhile fetches it itself)
            except Exception as e:  # noqa: BLE001 - handed to the demand fetch of shard i, which raises it
                _log.debug("node cache: prefetch of %s failed: %s", redact_url(self.url(i)), e)
                with self._lock:
                    self._failed[i] = (time.monotonic(), e)
            finally:
                with self._lock:
                    self._active.discard(i)
                    done = self._pending.pop(i, None)
                if done is not None:
                    done.set()

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
            _unlock(fd)

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
        _unlock(fd)
        if emptied and self._gave_up:  # others may count this process as stuck: tell them what it holds now
            with _flock(self.root / ".locks" / "space.lock"):
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

    def _start_releaser(self) -> None:
        """Start the releaser thread (``self._lock`` held)."""
        self._releaser_wake.clear()
        self._releaser_paused = False
        self._releaser = threading.Thread(target=self._release_loop, daemon=True, name="fastdata-nodecache-release")
        _RELEASING.add(self)
        self._releaser.start()

    def _stop_releaser(self) -> threading.Thread | None:
        """Before a fork: tell the releaser thread to stop; the thread to join (None if none runs)."""
        if self._pid != os.getpid():
            return None
        with self._lock:
            thread, self._releaser = self._releaser, None
            if thread is None:
                return None
            self._releaser_paused = True
            self._releaser_wake.set()
        return thread

    def _resume_releaser(self) -> None:
        """After a fork, in the parent: restart a releaser stopped for it while readers are still open."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if self._releaser_paused and self._releaser is None:
                self._releaser_paused = False
                if self._readers:
                    self._start_releaser()

    def _stop_prefetch(self) -> list[threading.Thread]:
        """Before a fork: stop the prefetch threads (a download under way stops at its next chunk and
        is dropped); the threads to join. The shards still wanted are queued again after the fork."""
        if self._pid != os.getpid():
            return []
        with self._lock:
            prefetchers, self._prefetchers = self._prefetchers, []
            self._queue = None
            self._interrupt.set()
            queued = [s for s in self._pending if s not in self._active]  # taken by no thread: dropped here
            self._requeue = [s for s in self._order if s in self._pending] + [
                s for s in self._pending if s not in self._order]
            events = [self._pending.pop(s) for s in queued]
        for event in events:
            event.set()  # a demand fetch waiting for it fetches it itself
        for thread, requests in prefetchers:
            requests.put(None)  # one per thread of that queue: each takes one and exits
        return [t for t, _ in prefetchers if t.is_alive()]

    def _resume_prefetch(self) -> None:
        """After a fork, in the parent: prefetch again what :meth:`_stop_prefetch` stopped."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._interrupt.clear()
            want, self._requeue = self._requeue, []
        want = [s for s in want if not self.is_local(s)]
        if want:
            self._enqueue(want)

    def unwatch(self, reader: Any) -> None:
        """Undo :meth:`watch` (the reader closed)."""
        if self._pid == os.getpid():
            with self._lock:
                self._readers.discard(reader)

    def _release_loop(self) -> None:
        me = threading.current_thread()
        while True:
            self._releaser_wake.wait(_RELEASE_POLL_S)
            with self._lock:
                if self._releaser is not me:
                    return  # the cache was reset (fork, close)
                if not self._readers:  # nothing open: exit (the next watch() starts a new thread)
                    self._releaser = None
                    return
            try:
                self._release_idle()
            except Exception as e:  # noqa: BLE001 - never dies silently: logged, tried again next poll
                _log.warning("node cache %s: releasing idle readers failed: %r", self.root, e)

    def _release_idle(self) -> None:
        """One poll of the releaser (its own frame: no reader outlives it here, so the readers that
        nobody else holds can be collected, and then this cache)."""
        with self._lock:
            readers = list(self._readers)
        # nobody waits, or this process waits too (then the deadlock check decides): the readers
        # only note their read counts (their idle clocks)
        idle_s = math.inf if self._waits or not self._others_wait() else _RELEASE_IDLE_S
        now = time.monotonic()
        for reader in readers:
            if reader.release_if_idle(now, idle_s):
                _log.debug("node cache: released idle %s for a process waiting for space", reader)

    def _others_wait(self) -> bool:
        """Another process (or another handle of this one) waits for space now: its ``.waits/``
        entry names a shard it waits for and was refreshed within ``_WAITER_FRESH_S`` (a waiter
        refreshes it every poll; a dead one's goes stale, in any pid namespace)."""
        mine = self._wait_path()
        now = time.time()
        try:
            paths = list((self.root / ".waits").iterdir())
        except OSError:
            return False
        for path in paths:
            if path == mine:
                continue
            try:
                if path.stat().st_mtime < now - _WAITER_FRESH_S:
                    continue
                entry = json.loads(path.read_text())
                pid, waits = int(entry["pid"]), entry["waits"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # vanished, or being written
            if waits and pid >= 0:  # fresh: refreshed every 50 ms by a live waiter (whatever its pid namespace)
                return True
        return False

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
        with _flock(self._lock_path(i, "lock")):
            if self.is_local(i):  # another process or thread downloaded it while we waited
                self.stats.waited += 1
                return
            if path.exists():  # a damaged copy (host crash, edits): never read, replaced below
                _log.warning("node cache: %s has %s bytes, the manifest says %d: downloading it again", path,
                             _size(path), self.manifest.shards[i].bytes)
                path.unlink(missing_ok=True)
                self.index_path(i).unlink(missing_ok=True)
            for stale in (self.root / ".tmp").glob(f"{i}-*.part"):  # a killed downloader's leftovers
                stale.unlink(missing_ok=True)
            shard = self.manifest.shards[i]
            for attempt in range(1, self.retry.attempts + 1):
                tmp = self._reserve(i, shard, demand=demand)
                if tmp is None:
                    return  # prefetch without room: leave it to the demand fetch
                try:
                    self._download(i, shard, tmp, interruptible=not demand)
                    if self.manifest.format == "tar":
                        self._build_index(i, tmp)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp, path)
                    break
                except BaseException as e:
                    tmp.unlink(missing_ok=True)
                    self.index_path(i).unlink(missing_ok=True)
                    if not isinstance(e, Exception) or isinstance(e, _Interrupted):
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
        """Stream shard ``i`` into ``tmp``; a second thread hashes and writes while this one receives
        (sha256 and the network each take a core: pipelined, a download costs the slower of the two).
        ``interruptible`` (a prefetch): :class:`_Interrupted` at the next chunk once the process forks."""
        url = self.url(i)
        digest = hashlib.sha256()
        chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=4)
        failed: list[BaseException] = []

        def sink(out: Any) -> None:
            try:
                while (chunk := chunks.get()) is not None:
                    digest.update(chunk)  # releases the GIL
                    out.write(chunk)
            except BaseException as e:  # noqa: BLE001 - handed to the receiving thread below
                failed.append(e)
                while chunks.get() is not None:  # drain so that the receiver never blocks
                    pass

        size = 0
        with open(tmp, "wb") as out:
            writer = threading.Thread(target=sink, args=(out,), name="fastdata-nodecache-sink", daemon=True)
            writer.start()
            try:
                with RemoteStream(url, size=shard.bytes, retry=self.retry, what="downloading") as src:
                    while not failed:
                        if interruptible and self._interrupt.is_set():
                            raise _Interrupted(f"prefetch of {shard.name} stopped: the process forks")
                        chunk = src.read(_CHUNK)
                        if not chunk:
                            break
                        size += len(chunk)
                        chunks.put(chunk)
                        if size > shard.bytes:
                            break
            finally:
                chunks.put(None)
                writer.join()
        if failed:
            raise failed[0]
        if size != shard.bytes or digest.hexdigest() != shard.sha256:
            what = (f"size {size} bytes, manifest says {shard.bytes}" if size != shard.bytes
                    else f"sha256 {digest.hexdigest()}, manifest says {shard.sha256}")
            shown = redact_url(url)
            err = RemoteError(f"downloading {shown}: content does not match the manifest ({what})")
            err.url, err.status, err.transient, err.checksum = shown, None, False, True  # type: ignore[attr-defined]
            raise err

    def repair_index(self, i: int, error: Exception) -> None:
        """The sidecar index of local shard ``i`` (held by :meth:`acquire`) failed to load with
        ``error`` (a host crash left it empty, or it was edited): rebuild it from the shard, whose
        size matches the manifest; when that fails too the copy is damaged: download it again."""
        _log.warning("node cache: %s: %s; rebuilding it", self.index_path(i), error)
        with _flock(self._lock_path(i, "lock")):
            try:
                self._build_index(i, self.path(i))
                return
            except Exception as e:  # noqa: BLE001 - a damaged copy: replaced below
                _log.warning("node cache: %s is damaged (%s): downloading it again", self.path(i), e)
                self.path(i).unlink(missing_ok=True)
                self.index_path(i).unlink(missing_ok=True)
        self._fetch(i, demand=True)

    def _build_index(self, i: int, tmp: Path) -> None:
        from fastdata.shards.tar import TarIndex

        index = TarIndex.build(tmp)
        if len(index) != self.manifest.shards[i].num_samples:
            raise RemoteError(f"{redact_url(self.url(i))}: has {len(index)} samples, manifest says "
                              f"{self.manifest.shards[i].num_samples}")
        self.index_path(i).parent.mkdir(parents=True, exist_ok=True)
        index.save(self.index_path(i))

    # ----- space ---------------------------------------------------------------------------------
    def _reserve(self, i: int, shard: ShardInfo, *, demand: bool) -> Path | None:
        """Create the temporary file of shard ``i`` once its bytes fit under the limit."""
        tmp = self.root / ".tmp" / f"{i}-{shard.bytes}-{os.getpid()}-{uuid.uuid4().hex}.part"
        if self.max_bytes is None:
            tmp.touch()
            return tmp
        stuck_since: float | None = None  # every holder of the space has been waiting since
        try:
            while True:
                with _flock(self.root / ".locks" / "space.lock"):
                    used, victims = self._usage(exclude=i)
                    need = used + shard.bytes - self.max_bytes
                    mine = self._next_use(i)
                    others_hold = False  # shards other processes read (they will move on)
                    pinned: list[int] = []  # shards some process reads
                    while need > 0 and victims:
                        victim = victims.pop(0)
                        if not demand and self.eviction == "future" and self._next_use(victim) <= mine:
                            return None  # evicting would throw away something needed sooner
                        freed = self._evict(victim)
                        if not freed and self.path(victim).is_file():
                            pinned.append(victim)
                            if victim not in self._use:
                                others_hold = True
                        need -= freed
                    if need <= 0:
                        tmp.touch()
                        self._stalled_since = None
                        return tmp
                    if not demand:
                        return None
                    self._waits[threading.get_ident()] = i
                    self._write_wait()
                    downloading, removed = self._downloads()
                    if removed:
                        continue  # a killed downloader's reservation is gone: look again at once
                    stuck = None if downloading else self._stuck_holders(pinned)
                if downloading:
                    others_hold = True  # downloads in progress (any process or thread) become evictable when done
                if not others_hold:  # only this process's own open readers pin the space: waiting cannot help
                    mine_open = self._held()
                    raise NodeCacheError(
                        f"node cache {self.root}: max_bytes={self.max_bytes} cannot hold shard {shard.name} "
                        f"({shard.bytes} bytes) next to the {len(mine_open)} shards this process has open "
                        f"({used} bytes in the cache); ShardedDataset keeps open_shards x (walks in this process) "
                        "+ 2 shards open per process: raise max_bytes (to a few more shards than that, times the "
                        "processes on this host) or lower ShuffleOptions.open_shards")
                now = time.monotonic()
                if stuck is None:
                    stuck_since = None
                elif stuck_since is None:
                    stuck_since = now
                elif now - stuck_since >= _DEADLOCK_S:
                    self._gave_up = bool(self._use)  # the others still wait for this process's shards
                    raise NodeCacheError(
                        f"node cache {self.root}: max_bytes={self.max_bytes} cannot hold shard {shard.name} "
                        f"({shard.bytes} bytes): the {stuck} processes on this host that hold its space "
                        f"({len(pinned)} shards open, {used} bytes in the cache) are all waiting for space "
                        "themselves, so none can move on; ShardedDataset keeps open_shards x (walks in a process) "
                        "+ 2 shards open per process (each DataLoader worker is one): raise max_bytes (to a few "
                        "more shards than that, times the processes on this host) or lower "
                        "ShuffleOptions.open_shards or num_workers")
                # everything left is in use by other processes or being downloaded: wait for them to move on
                time.sleep(0.05)
                if self._stalled_since is None:
                    self._stalled_since = time.monotonic()
                elif time.monotonic() - self._stalled_since > _STALL_S:
                    self._stalled_since = None
                    raise NodeCacheError(f"node cache {self.root}: max_bytes={self.max_bytes} cannot hold shard "
                                      f"{shard.name} ({shard.bytes} bytes) next to the shards in use on this host "
                                      f"for {_STALL_S:g} s; raise the limit or read fewer shards at once "
                                      "(open_shards, workers)")
        finally:
            if self._waits.pop(threading.get_ident(), None) is not None:
                with _flock(self.root / ".locks" / "space.lock"):
                    self._write_wait()

    def _held(self) -> list[int]:
        """The shards this process holds open (a snapshot: other threads acquire and release)."""
        with self._lock:
            return sorted(self._use)

    def _wait_path(self) -> Path:
        return self.root / ".waits" / f"{os.getpid()}-{self._token}"

    def _write_wait(self) -> None:
        """Write (or remove) this process's registration in ``.waits/``; called under ``space.lock``."""
        path = self._wait_path()
        if not self._waits and not (self._gave_up and self._use):
            self._gave_up = False
            path.unlink(missing_ok=True)
            return
        entry = {"pid": os.getpid(), "held": self._held(), "waits": sorted(set(self._waits.values())),
                 "gave_up": self._gave_up}
        try:
            path.write_text(json.dumps(entry))
        except OSError as e:  # then nobody counts this process as stuck: the 120 s limit still holds
            _log.debug("node cache: cannot register a wait in %s: %s", path, e)

    def _downloads(self) -> tuple[bool, bool]:
        """(a download is in progress, a killed downloader's ``.part`` was removed); under ``space.lock``.

        A ``.part`` whose shard download lock nobody holds is a leftover (its size counts against
        the limit until removed); a held lock is a live download (or one about to start)."""
        live = removed = False
        for part in (self.root / ".tmp").glob("*.part"):
            n = part.name.split("-", 1)[0]
            if not n.isdigit():
                continue
            fd = _try_flock(self._lock_path(int(n), "lock"), fcntl.LOCK_EX)
            if fd is None:
                live = True
                continue
            try:
                if part.exists():
                    part.unlink(missing_ok=True)
                    removed = True
            finally:
                _unlock(fd)
        return live, removed

    def _stuck_holders(self, pinned: list[int]) -> int | None:
        """The number of processes holding ``pinned`` when each of them waits for space (this one
        included, which does), else None; under ``space.lock``."""
        if not pinned:
            return None
        want = set(pinned)
        waiting: set[int] = set(self._held())
        procs = int(bool(want & waiting))
        now = time.time()
        mine = self._wait_path()
        for path in (self.root / ".waits").iterdir():
            if path == mine:
                continue
            try:
                fresh = path.stat().st_mtime >= now - _WAIT_FRESH_S
                entry = json.loads(path.read_text())
                pid = int(entry["pid"])
                held = {int(j) for j in entry["held"]}
                stuck = bool(entry["waits"]) or bool(entry["gave_up"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # vanished, or being replaced by a crashed writer's leftovers: not a waiter
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                if not fresh:
                    path.unlink(missing_ok=True)  # a dead process's registration
                continue
            except PermissionError:
                pass  # alive, another user's
            if fresh and stuck and held & want:
                waiting |= held
                procs += 1
        if not want <= waiting:
            return None  # a process that is not waiting reads some of them: it will move on
        return procs

    _stalled_since: float | None = None

    def _usage(self, *, exclude: int) -> tuple[int, list[int]]:
        """(bytes used by verified shards and downloads in progress, evictable shards best first)."""
        used = 0
        entries: list[tuple[float, float, int]] = []
        for part in (self.root / ".tmp").glob("*.part"):
            bits = part.name.split("-")
            try:
                used += int(bits[1])
            except (IndexError, ValueError):
                continue
        for j, size, mtime in self._present():
            used += size
            if j == exclude:
                continue
            rank = -self._next_use(j) if self.eviction == "future" else 0.0
            entries.append((rank, mtime, j))
        entries.sort()
        return used, [j for _, _, j in entries]

    def _evict(self, j: int) -> int:
        """Delete verified shard ``j`` unless a process reads it; the bytes freed."""
        fd = _try_flock(self._lock_path(j, "use"), fcntl.LOCK_EX)
        if fd is None:
            return 0
        try:
            p = self.path(j)
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                return 0
            p.unlink()
            self.index_path(j).unlink(missing_ok=True)
            self.stats.evictions += 1
            return size
        finally:
            _unlock(fd)

    def used_bytes(self) -> int:
        """Bytes of verified shards in the cache folder now."""
        return sum(size for _, size, _ in self._present())

    def _present(self) -> list[tuple[int, int, float]]:
        """(shard, bytes, mtime) of each shard file in the folder: one listing of the folder (and of the
        folders in shard names), not a stat per manifest shard, which took seconds under the host-wide
        space lock for 100,000 shards."""
        found = []
        for sub in self._dirs:
            try:
                entries = os.scandir(self.root / sub)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for entry in entries:
                    j = self._files.get(f"{sub}/{entry.name}" if sub else entry.name)
                    if j is None:
                        continue
                    try:
                        if not entry.is_file():
                            continue
                        st = entry.stat()
                    except FileNotFoundError:  # evicted meanwhile
                        continue
                    found.append((j, st.st_size, st.st_mtime))
        return found


def _again(e: Exception, when: float) -> RemoteError:
    """A new RemoteError repeating ``e`` (a failed fetch at ``when``) for another read of its shard."""
    kind = NodeCacheError if isinstance(e, NodeCacheError) else RemoteError  # this host's side stays unskippable
    err = kind(f"{e} (an attempt {time.monotonic() - when:.0f} s ago in this pass; the shard is "
               f"fetched again after {_FAILED_FRESH_S:g} s or in the next pass)")
    for name in ("url", "status", "transient", "checksum"):
        if hasattr(e, name):
            setattr(err, name, getattr(e, name))
    return err


def _release_all(use: dict[int, list[int]], pid: int) -> None:
    """The use locks of a collected :class:`ShardCache` (its finalizer: no lock taken, no Python
    object of the cache touched). A forked child leaves its parent's descriptors alone."""
    if os.getpid() != pid:
        return
    for fds in list(use.values()):
        while fds:
            try:
                _unlock(fds.pop())
            except OSError:  # pragma: no cover - already closed
                pass
    use.clear()


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


if hasattr(os, "register_at_fork"):  # pragma: no branch
    os.register_at_fork(before=_pause_threads_before_fork, after_in_parent=_resume_threads_after_fork)
