"""The device decode stage's threads and streams (:class:`~fastdata.gpu.DecodeImages`, ``decode_threads=K``).

- :class:`DecodeThreads`: ``K`` daemon threads named ``fastdata-nvjpeg-<k>`` that make the stage's
  decode calls, in order of submission (a :class:`fastdata.loader.Pool`: paused, that is joined after their
  current call, before any ``os.fork`` of this process, and restarted on demand). Created on first use, and
  anew in a forked child; ended by ``close()``, when their owner is collected, and at interpreter exit.
- :class:`DecodeStreams`: the streams of one device and priority that calls decode on, one per call in flight
  (so at most ``K``), created once and handed out again: no stream per batch, and no two calls at once on one
  stream (a decoder that waits for its stream, as TorchCodec does, waits for its own call only).
- :meth:`DecodeThreads.result` waits for a call, restarting threads a fork elsewhere paused meanwhile.
Design note: docs/design/gpu-decode.md ("Decode threads").
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from fastdata._runtime import at_exit
from fastdata.loader import Pool

__all__ = ["MAX_DECODE_THREADS", "THREAD_NAME", "DecodeStreams", "DecodeThreads", "check_decode_threads"]

THREAD_NAME = "fastdata-nvjpeg"
MAX_DECODE_THREADS = 32  # TorchCodec keeps 32 nvJPEG decoders per device: more calls at once would create new ones
_POLL_S = 1.0  # how often a wait for a call checks that the threads run (a fork elsewhere pauses them)
_LIVE: weakref.WeakSet[Pool] = weakref.WeakSet()  # the pools of this module, ended at interpreter exit


def check_decode_threads(threads: Any) -> int:
    """``decode_threads`` validated: an int from 1 to :data:`MAX_DECODE_THREADS` (a ValueError naming it)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_DECODE_THREADS:
        raise ValueError(f"DecodeImages: decode_threads must be an int from 1 to {MAX_DECODE_THREADS} (threads "
                         f"making device decode calls at once; TorchCodec keeps {MAX_DECODE_THREADS} decoders per "
                         f"device), got {threads!r}")
    return threads


class DecodeThreads:
    """``threads`` decode threads, started on first use (see the module docstring)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: Pool | None = None
        self._pid: int | None = None
        self._end: weakref.finalize | None = None  # ends the threads when this object is collected
        self._lock = threading.Lock()

    def _current(self) -> Pool:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():  # a pool's threads do not survive fork
                self._pool, self._pid = Pool(self.threads, name=THREAD_NAME), os.getpid()
                _LIVE.add(self._pool)
                self._end = weakref.finalize(self, self._pool.close, False)
            return self._pool

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._current().submit(fn, *args)

    def result(self, future: Future[Any]) -> Any:
        """The call's result (its exception, with its traceback, re-raised here; ``CancelledError`` for a call
        that :meth:`close` cancelled before it started)."""
        # done(), not wait()'s answer: a call cancelled in the queue never counts as done for wait()
        while not future.done():
            if not wait([future], timeout=_POLL_S, return_when=FIRST_COMPLETED).done and not future.done():
                self._current().ensure_running()  # a fork in another thread paused the threads: restart them
        return future.result()

    def close(self) -> None:
        """End the threads after their current call and wait for them; queued calls are cancelled. The next
        :meth:`submit` starts new ones."""
        with self._lock:
            pool, end, self._pool, self._end = self._pool, self._end, None, None
        if end is not None:
            end.detach()
        if pool is not None and self._pid == os.getpid():
            pool.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"threads": self.threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["threads"])  # type: ignore[misc]


class DecodeStreams:
    """The decode streams of one device and priority: :meth:`take` one for a call, :meth:`give` it back after."""

    def __init__(self, device: torch.device, priority: int) -> None:
        self.device = device
        self.priority = priority
        self.streams: list[torch.cuda.Stream] = []  # every stream made, for the life of the stage
        self._free: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    def take(self) -> torch.cuda.Stream:
        with self._lock:
            if self._free:
                return self._free.pop()
            stream = torch.cuda.Stream(self.device, priority=self.priority)
            self.streams.append(stream)
            return stream

    def give(self, stream: torch.cuda.Stream) -> None:
        with self._lock:
            self._free.append(stream)


def _close_at_exit() -> None:
    """atexit: end the decode threads still running, joined after their current call (a daemon thread ended
    inside a codec library while the interpreter finalizes can abort the process)."""
    for pool in list(_LIVE):
        pool.close()


at_exit(__name__, "end the device decode threads after their current call (inside a codec at finalization they "
        "can abort the process)", _close_at_exit)
