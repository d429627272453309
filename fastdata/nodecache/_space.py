"""Space in the node cache folder under ``max_bytes``: reservation, eviction, and waiting for others.

Every decision is taken under the host-wide ``.locks/space.lock``. A download reserves its bytes by
creating its ``.part`` file (named with its size) once they fit; shards being read by any process
(their ``.use`` lock is held) are never evicted. A process waiting for space registers in ``.waits/``
what it holds and waits for, so that waiters can tell a slow host from one where every holder of the
space waits for space itself (then each raises NodeCacheError instead of hanging).
Design note: ``docs/design/nodecache.md``.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastdata.manifest import ShardInfo
from fastdata.nodecache._errors import NodeCacheError
from fastdata.nodecache._locks import flock, try_flock, unlock

__all__ = ["SpaceAccounting"]

_DEADLOCK_S = 1.0  # every holder of the space waiting this long (seen on every poll): nobody can move on
_WAIT_FRESH_S = 10.0  # a waiter's registration not refreshed for this long no longer counts
_STALL_S = 120.0  # a demand download waiting this long without progress: RemoteError
_WAITER_FRESH_S = 2.0  # a waiter refreshes its registration every poll (50 ms): older ones wait no more

_log = logging.getLogger("fastdata.nodecache")


class SpaceAccounting:
    """The space half of :class:`~fastdata.nodecache.ShardCache` (a mixin: it shares the cache's state)."""

    # the cache's state this half reads and writes (set by ShardCache.__init__ and _setup); it also calls the
    # cache's path, _drop_index, _lock_path and _next_use
    root: Path
    max_bytes: int | None
    eviction: str
    stats: Any
    _lock: threading.Lock
    _use: dict[int, list[int]]
    _waits: dict[int, int]
    _gave_up: bool
    _token: str
    _files: dict[str, int]
    _dirs: list[str]

    def _reserve(self, i: int, shard: ShardInfo, *, demand: bool) -> Path | None:
        """Create the temporary file of shard ``i`` once its bytes fit under the limit."""
        tmp = self.root / ".tmp" / f"{i}-{shard.bytes}-{os.getpid()}-{uuid.uuid4().hex}.part"
        if self.max_bytes is None:
            tmp.touch()
            return tmp
        stuck_since: float | None = None  # every holder of the space has been waiting since
        try:
            while True:
                with flock(self.root / ".locks" / "space.lock"):
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
                with flock(self.root / ".locks" / "space.lock"):
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
            fd = try_flock(self._lock_path(int(n), "lock"), fcntl.LOCK_EX)
            if fd is None:
                live = True
                continue
            try:
                if part.exists():
                    part.unlink(missing_ok=True)
                    removed = True
            finally:
                unlock(fd)
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

    _stalled_since: float | None = None  # since when a demand reservation has found no room

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
        fd = try_flock(self._lock_path(j, "use"), fcntl.LOCK_EX)
        if fd is None:
            return 0
        try:
            p = self.path(j)
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                return 0
            p.unlink()
            self._drop_index(j)
            self.stats.evictions += 1
            return size
        finally:
            unlock(fd)

    def used_bytes(self) -> int:
        """Bytes of verified shards in the cache folder now."""
        return sum(size for _, size, _ in self._present())

    def _present(self) -> list[tuple[int, int, float]]:
        """(shard, bytes, mtime) of each shard file in the folder: one listing of the folder (and of the
        folders in shard names), not a stat per manifest shard, whose cost under the host-wide space lock
        grows with the manifest (``docs/design/nodecache.md``)."""
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
