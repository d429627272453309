"""Stall watchdog of :class:`fastdata.DataLoader`: a consumer waiting too long for a batch is told why.

When the consumer has waited ``stall_warning`` seconds for the next batch, one WARNING on the
``fastdata.loader`` logger says how long, which batch (epoch, logical worker, worker process), each
worker process's pid and state, and the Python stack of every thread of every worker process and of
the in-process threads that make batches; repeated at doubling intervals while the stall lasts, and
once more when it ends. Nothing is raised or stopped. Worker stacks come from
:func:`faulthandler.register` on :data:`STACK_SIGNAL`, installed by :class:`WorkerInit` while torch
starts the workers (fork, spawn and forkserver alike), so a deadlocked worker can dump them too. The
watchdog is one daemon thread per iterator, started at the first ``next()``, holding only weak
references; the consumer's cost is one timestamp per batch. See docs/design/stall-watchdog.md.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from fastdata._runtime import at_fork, thread
from fastdata.loader import _exit

__all__ = [
    "CAN_DUMP",
    "DEFAULT_STALL_WARNING",
    "STACK_SIGNAL",
    "THREAD_NAME",
    "Watch",
    "WorkerInit",
    "WorkerStacks",
    "attach",
    "check_stall_warning",
    "threshold",
]

DEFAULT_STALL_WARNING = 60.0
STACK_SIGNAL: int | None = getattr(signal, "SIGUSR2", None)
CAN_DUMP = STACK_SIGNAL is not None and hasattr(faulthandler, "register")
THREAD_NAME = "fastdata-stall-watchdog"
_DUMP_WAIT_S = 2.0  # how long the watchdog waits for a signalled worker's dump
_POLL_S = 0.05
_JOIN_S = 2.0  # close()/exhaustion: how long to wait for the watchdog thread to exit
_MAX_CHARS = 20_000  # per worker process or thread in one warning
_FRAMES = 40  # innermost frames shown per in-process thread
_log = logging.getLogger("fastdata.loader")


def check_stall_warning(value: Any) -> float:
    """Validate ``stall_warning``: seconds >= 0 (0 or None: off); returns a float (0.0: off)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"stall_warning must be a finite number of seconds >= 0 (0 or None: no warning), got {value!r}")
    return float(value)


def threshold(stall_warning: float, timeout: float) -> float | None:
    """Seconds after which a wait is reported (None: never): off, or not below torch's ``timeout``
    (which raises first)."""
    if not stall_warning or (timeout and stall_warning >= timeout):
        return None
    return stall_warning


# ----- worker side -------------------------------------------------------------------------------
_FILES: list[BinaryIO] = []  # in a worker: the open dump file (faulthandler writes to its descriptor)


def _install(folder: str, worker_id: int) -> None:
    sig = STACK_SIGNAL
    if sig is None or not CAN_DUMP:
        return
    final = os.path.join(folder, f"w{worker_id}.stacks")
    tmp = f"{final}.{os.getpid()}.tmp"
    f = open(tmp, "ab", buffering=0)  # noqa: SIM115 - kept open for the process's life (faulthandler's fd)
    previous = signal.getsignal(sig)
    faulthandler.register(sig, file=f, all_threads=True, chain=callable(previous))
    _FILES.append(f)
    os.replace(tmp, final)  # now the handler is in place: the main process may signal


_PARENT_POLL_S = 0.5  # how often a worker checks that the loader's process is still there
PARENT_WATCH_THREAD = "fastdata-worker-parent-watch"


def _start_time(pid: int) -> str | None:
    """The process's start time (Linux ``/proc``; tells a pid reused by another process apart), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        return stat[stat.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _process_gone(pid: int, start: str | None) -> bool:
    """True once process ``pid`` (started at ``start``) has ended: no such process, a zombie, or the pid
    now names a process started at another time."""
    if _PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except FileNotFoundError:
            return True
        except OSError:
            return False
        tail = stat[stat.rindex(")") + 2 :].split()
        return tail[0] in ("Z", "X") or (start is not None and len(tail) > 19 and tail[19] != start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _watch_parent(pid: int, start: str | None, ppid: int) -> None:
    """Thread body in a worker: end the worker at once when the loader's process ``pid`` is gone.

    torch's workers check only their parent process, and only between two tasks: a forkserver
    worker's parent is the fork server, which outlives the loader's process (each of its children
    holds its "alive" pipe open), so after a ``kill -9`` of the training process such workers lived
    on for good; a fork or spawn worker blocked in a write to the result pipe at exit (the reading
    process is gone, but the other workers keep the pipe open) did too."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if (ppid == pid and os.getppid() != ppid) or _process_gone(pid, start):
            os._exit(1)


def _arm_parent_watch(pid: int, start: str | None, ppid: int) -> None:
    if os.name == "nt" or pid == os.getpid():  # Windows: os.kill(pid, 0) would send CTRL_C_EVENT
        return
    if _process_gone(pid, start):  # gone before the worker got here
        os._exit(1)
    thread(_watch_parent, args=(pid, start, ppid), name=PARENT_WATCH_THREAD).start()


# ----- worker processes: the parent's objects are not theirs to collect -----------------------------
_forking = threading.local()  # .workers: this thread is forking a loader's worker processes


def _freeze_inherited() -> None:
    """In a worker just forked: move every object inherited from the loader's process out of reach of
    the worker's garbage collector (``gc.freeze``). A reference cycle left over in the parent (a
    ``DistributedDataParallel`` model whose hook refers to it, a temporary folder's finalizer) was
    otherwise collected in the worker: its destructor ran there, e.g. gloo's process group, which
    then waited forever on threads only the parent has (the worker hung in its first collate), or a
    ``weakref.finalize`` removing a folder the parent still uses. It also keeps the collector from
    touching (copying) the pages the worker shares with the parent."""
    if getattr(_forking, "workers", False):
        gc.freeze()


at_fork(__name__, "in a loader worker: freeze the objects inherited from the parent (gc.freeze)",
        after_in_child=_freeze_inherited)


@contextlib.contextmanager
def forking_workers() -> Iterator[None]:
    """Around the start of a loader's fork worker processes (see :func:`_freeze_inherited`)."""
    before = getattr(_forking, "workers", False)
    _forking.workers = True
    try:
        yield
    finally:
        _forking.workers = before


class WorkerInit:
    """``worker_init_fn`` of fastdata.DataLoader's workers: arms the worker's exit through ``os._exit``
    (:mod:`fastdata.loader._exit`) and its end when the loader's process dies (a daemon thread that
    checks it twice a second, ``_watch_parent``), installs the stack dump handler when the stall
    watchdog is on (``folder``), then calls the user's ``worker_init_fn`` (if any). Made in the
    loader's process; picklable (spawn, forkserver)."""

    def __init__(self, folder: str | None, user_fn: Callable[[int], Any] | None):
        self.folder = folder
        self.user_fn = user_fn
        self.parent = os.getpid()  # the loader's process: the workers end with it
        self.parent_start = _start_time(self.parent)

    def __call__(self, worker_id: int) -> None:
        _exit.arm()
        _arm_parent_watch(self.parent, self.parent_start, os.getppid())
        if self.folder is not None:
            try:
                _install(self.folder, worker_id)
            except (OSError, RuntimeError, ValueError) as e:  # diagnostics only: the worker runs on without
                _log.debug("fastdata.DataLoader worker %d: no stack dump handler: %s", worker_id, e)
        if self.user_fn is not None:
            self.user_fn(worker_id)


# ----- main process: the workers' dump files -------------------------------------------------------
class WorkerStacks:
    """The dump files of one torch iterator's worker processes (a temporary folder, removed with it)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="fastdata-stacks-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def init_fn(self, user_fn: Callable[[int], Any] | None) -> WorkerInit:
        return WorkerInit(self.folder, user_fn)

    def dump(self, workers: list[tuple[int, int]], stop: threading.Event) -> dict[int, str]:
        """{worker id: its threads' stacks, or why there are none} for the live workers ``(id, pid)``."""
        out: dict[int, str] = {}
        pending: dict[int, list[Any]] = {}
        for wid, pid in workers:
            path = os.path.join(self.folder, f"w{wid}.stacks")
            if not os.path.exists(path):
                out[wid] = ("(no stacks: the worker has not reached its worker_init_fn yet; it is still starting: "
                            "importing modules or unpickling the dataset)")
                continue
            try:
                os.truncate(path, 0)
                os.kill(pid, STACK_SIGNAL)  # type: ignore[arg-type]  # CAN_DUMP: not None
            except OSError as e:
                out[wid] = f"(no stacks: {e})"
                continue
            pending[wid] = [path, -1]
        deadline = time.monotonic() + _DUMP_WAIT_S
        while pending and not stop.wait(_POLL_S):
            for wid, entry in list(pending.items()):
                try:
                    size = os.path.getsize(entry[0])
                except OSError:
                    size = 0
                if size and size == entry[1]:  # written and no longer growing
                    out[wid] = _read(entry[0])
                    del pending[wid]
                entry[1] = size
            if time.monotonic() > deadline:
                break
        for wid, entry in pending.items():
            text = _read(entry[0])
            out[wid] = text or (f"(no stack dump within {_DUMP_WAIT_S:.0f} s: the process may be stopped or in "
                                "uninterruptible I/O)")
        return out


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CHARS + 1)
    except OSError as e:
        return f"(no stacks: {e})"
    text = data.decode("utf-8", "replace").rstrip()
    return text[:_MAX_CHARS] + "\n  ... (truncated)" if len(text) > _MAX_CHARS else text


_STACKS: weakref.WeakKeyDictionary[Any, WorkerStacks] = weakref.WeakKeyDictionary()


def attach(inner: Any, stacks: WorkerStacks) -> None:
    """Tie ``stacks`` (its folder) to torch's iterator ``inner`` whose workers write there."""
    _STACKS[inner] = stacks


_PROC = os.path.isdir("/proc/self")
_STATES = {"Z": "exited (not reaped yet)", "X": "dead", "T": "stopped", "t": "stopped by a tracer",
           "D": "alive, in uninterruptible I/O (D)"}


def _state(proc: Any) -> str:
    """A worker process's state without reaping it (torch's SIGCHLD check must still see a dead worker)."""
    pid = proc.pid
    if os.name == "nt":  # no zombies to keep, and os.kill(pid, 0) would send CTRL_C_EVENT there
        return "alive" if proc.is_alive() else "exited"
    if _PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
            return _STATES.get(stat[stat.rindex(")") + 2], "alive")
        except FileNotFoundError:
            return "gone"
        except (OSError, ValueError, IndexError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except OSError:
        return "alive"
    return "alive"


# ----- main process: the watch -----------------------------------------------------------------
def _thread_stack(frames: dict[int, Any], ident: int) -> str:
    frame = frames.get(ident)
    if frame is None:
        return "  (not running)"
    text = "".join(traceback.format_stack(frame, limit=_FRAMES)).rstrip()
    return text[-_MAX_CHARS:]


class Watch:
    """The watchdog state of one loader iterator. The consumer sets :attr:`since` while it waits;
    the thread (:meth:`start`) holds only this object, which holds the iterators weakly."""

    __slots__ = ("_context", "_helpers", "_inner", "_lock", "_what", "ident", "limit", "reports", "since",
                 "stopped", "thread", "warned")

    def __init__(self, limit: float, inner: Any, context: Callable[[], str],
                 helpers: Callable[[Any], list[threading.Thread | None]] | None = None):
        self.limit = limit
        self.since = 0.0  # time.monotonic() when the consumer began waiting; 0.0: not waiting
        self.ident = 0  # the consumer's thread (of the first next())
        self.warned = 0.0  # ``since`` of the wait last warned about (0.0: none)
        self.reports = 0  # stall warnings logged
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        try:
            self._inner: Callable[[], Any] = weakref.ref(inner)
        except TypeError:  # an iterator without weak references: no worker details
            self._inner = _nothing
        self._context = context  # e.g. "batch #18 of epoch 3 from logical worker 1"
        self._helpers = helpers  # inner -> in-process threads that produce its batches
        self._what = ""

    def start(self) -> None:
        """Start the thread; the calling thread is the consumer's (the one whose waits are watched)."""
        self.ident = threading.get_ident()
        if self.thread is None and not self.stopped.is_set():
            self.thread = thread(_loop, args=(self,), name=THREAD_NAME)
            self.thread.start()

    def stop(self, join: bool = True) -> None:
        """End the thread (it exits at once; joined unless ``join=False``, e.g. from a finalizer)."""
        self.stopped.set()
        t = self.thread
        if join and t is not None and t is not threading.current_thread() and t.is_alive():
            t.join(_JOIN_S)

    def ended(self, started: float, outcome: str = "the batch arrived") -> None:
        """The consumer's wait that began at ``started`` is over (called only if a warning was logged)."""
        with self._lock:
            if self.warned != started:
                return
            self.warned = 0.0
            what = self._what
        _log.warning("fastdata.DataLoader: stall over: the wait for %s ended after %.1f s: %s",
                     what, time.monotonic() - started, outcome)

    def report(self, since: float) -> None:
        """Log the stall warning for the wait that began at ``since``."""
        text = self._compose(since)
        with self._lock:
            if self.stopped.is_set():
                return
            self.warned = since
            self.reports += 1
            if self.since != since:  # it ended while the stacks were collected; the consumer may have missed it
                self.warned = 0.0
                text += "\n(the wait ended while this report was being made)"
            _log.warning("%s", text)

    def _compose(self, since: float) -> str:
        waited = time.monotonic() - since
        try:
            what = self._context()
        except Exception as e:  # noqa: BLE001 - the description is best effort
            what = f"the next batch ({type(e).__name__} describing it)"
        self._what = what
        inner = self._inner()
        workers: list[Any] = list(getattr(inner, "_workers", None) or ())
        due = _due_worker(inner)
        head = f"fastdata.DataLoader: no batch for {waited:.1f} s: waiting for {what}"
        if due is not None and due < len(workers):
            head += f", worker process #{due} (pid {workers[due].pid})"
        lines = [head + "."]
        procs = [(i, w.pid, _state(w)) for i, w in enumerate(workers) if w.pid is not None]
        if procs:
            lines.append("Worker processes: " + ", ".join(f"#{i} pid {pid} {st}" for i, pid, st in procs) + ".")
        lines.append(f"Stacks follow (stall_warning={self.limit:g} s; stall_warning=None turns this warning off).")
        if procs:
            stacks = _STACKS.get(inner) if inner is not None else None
            live = [(i, pid) for i, pid, st in procs if st not in ("gone", "dead") and not st.startswith("exited")]
            if stacks is None:
                dumps = {i: ("(stacks unavailable on this platform: no faulthandler.register)" if not CAN_DUMP else
                             "(no stacks: these workers were started without the watchdog's handler)") for i, _ in live}
            else:
                dumps = stacks.dump(live, self.stopped)
            order = sorted(dumps, key=lambda i: (i != due, i))
            for i in order:
                lines.append(f"--- worker process #{i} (pid {workers[i].pid}), every thread, most recent call first:")
                lines.append(dumps[i])
        helpers: list[threading.Thread | None] = []
        if self._helpers is not None and inner is not None:
            try:
                helpers = list(self._helpers(inner))
            except Exception:  # noqa: BLE001 - best effort
                helpers = []
        del inner
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        idents = [self.ident] + [t.ident for t in helpers if t is not None and t.ident is not None]
        seen: set[int] = set()
        for ident in idents:
            if ident in seen or not ident:
                continue
            seen.add(ident)
            role = " (waiting for the batch)" if ident == self.ident else ""
            lines.append(f"--- this process (pid {os.getpid()}), thread {names.get(ident, ident)!r}{role}, "
                         "most recent call last:")
            lines.append(_thread_stack(frames, ident))
        del frames
        return "\n".join(lines)


def _nothing() -> None:
    return None


def _due_worker(inner: Any) -> int | None:
    """torch's worker id whose batch the consumer waits for (None: unknown)."""
    try:
        info = inner._task_info.get(inner._rcvd_idx)
    except AttributeError:
        return None
    return info[0] if info is not None and len(info) == 1 else None


def _loop(watch: Watch) -> None:
    """Thread body: wake when the current wait reaches its next report time (T, 2T, 4T, ... after it
    began), and at least every T/4 (a new wait may have begun meanwhile); never raises."""
    first = watch.limit
    tracked, due = 0.0, first
    while not watch.stopped.is_set():
        since = watch.since
        if since != tracked:
            tracked, due = since, first
        if not since:
            watch.stopped.wait(first / 4)
            continue
        waited = time.monotonic() - since
        if waited < due:
            watch.stopped.wait(min(due - waited, first / 4))
            continue
        try:
            watch.report(since)
        except Exception:  # noqa: BLE001 - a diagnostic must never end the watch silently
            _log.warning("fastdata.DataLoader: the stall watchdog could not describe a %.1f s wait",
                         time.monotonic() - since, exc_info=True)
        while due <= time.monotonic() - since:
            due *= 2
