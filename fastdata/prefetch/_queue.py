"""Hand-off between the prefetch thread and the consumer: the item pipe, the credits and the counters.

The pipe is a C ``queue.SimpleQueue`` (no Python-level lock on the hot path); the bound on what the
producer may hold comes from *credits*, not from the pipe's length: the producer takes one credit
before it stages a batch and the consumer returns one at every hand-over, carrying an event that
marks the end of the consumer's work queued so far (see ``_stage.py``). Every blocking call waits
in short slices, so a stop request or a dead thread is noticed within ``POLL_S`` and a
KeyboardInterrupt reaches the consumer promptly.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fastdata._util import quantile
from fastdata.errors import FastdataError

# Wake-up period of every blocking wait. Only bounds how late a stop/close is noticed; wake-ups
# on new data are immediate, so this does not add latency to the data path.
POLL_S = 0.05
# Per-batch consumer waits kept for the percentiles (a sliding window, 8 bytes each).
WAIT_WINDOW = 100_000


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


END = _Sentinel("end of epoch")
CLOSED = _Sentinel("pipe closed")


class Failure:
    """An exception raised in the producer thread, carried to the consumer with its traceback."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class EpochStart:
    """First item of every epoch: its number in the run, the loader's state before it, its epoch value."""

    __slots__ = ("number", "state", "epoch_value")

    def __init__(self, number: int, state: Any, epoch_value: Any) -> None:
        self.number, self.state, self.epoch_value = number, state, epoch_value


class Stopped(FastdataError):
    """Raised inside the producer when its run was stopped while it waited (never leaves the thread)."""


class Pipe:
    """Producer -> consumer items plus consumer -> producer credits of one producer run."""

    def __init__(self, credits: list[Any]) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.credits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for c in credits:
            self.credits.put(c)
        self.stop = threading.Event()

    def get(self, producer_alive: Callable[[], bool]) -> Any:
        """Next item; ``CLOSED`` once stopped; RuntimeError if the producer died without a word."""
        try:
            return self.items.get_nowait()
        except queue.Empty:
            pass
        while True:
            if self.stop.is_set():
                return CLOSED
            try:
                return self.items.get(timeout=POLL_S)
            except queue.Empty:
                if not producer_alive():
                    try:  # it may have put its last item right before exiting
                        return self.items.get_nowait()
                    except queue.Empty:
                        if self.stop.is_set():  # stopped (by another thread) while we waited
                            return CLOSED
                        raise RuntimeError("fastdata prefetch thread exited without finishing the epoch") from None

    def take_credit(self) -> Any:
        """Producer side: wait for a credit (raises ``Stopped`` when the run is stopped)."""
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                return self.credits.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def drain(self) -> list[Any]:
        """Stop the run and return what was still queued (dropped by the caller)."""
        self.stop.set()
        left = []
        while True:
            try:
                left.append(self.items.get_nowait())
            except queue.Empty:
                return left


class Stats:
    """Thread-safe counters behind ``CUDAPrefetcher.stats()``."""

    _FLOATS = ("wait_s", "load_s", "stage_s", "pack_s", "throttle_s", "copy_s")
    _INTS = ("batches", "epochs", "lookahead_epochs", "lookahead_discarded", "bytes", "timed_bytes",
             "queued_bytes", "peak_batch_bytes", "packed_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero the counters; ``queued_bytes`` is a gauge (bytes staged now) and keeps its value."""
        with self._lock:
            queued = getattr(self, "queued_bytes", 0)
            for name in self._FLOATS:
                setattr(self, name, 0.0)
            for name in self._INTS:
                setattr(self, name, 0)
            self.queued_bytes = queued  # zeroing it made it negative once the staged batches were handed over
            self.waits: deque[float] = deque(maxlen=WAIT_WINDOW)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, value in amounts.items():
                setattr(self, name, getattr(self, name) + value)

    def add_staged(self, *, throttle_s: float, stage_s: float, pack_s: float, packed: int, copy_s: float,
                   timed: int, nbytes: int) -> None:
        """One staged batch (one lock round trip on the producer's hot path)."""
        with self._lock:
            self.throttle_s += throttle_s
            self.stage_s += stage_s
            self.pack_s += pack_s
            self.packed_bytes += packed
            self.copy_s += copy_s
            self.timed_bytes += timed
            self.bytes += nbytes
            self.queued_bytes += nbytes
            self.peak_batch_bytes = max(self.peak_batch_bytes, nbytes)

    def add_wait(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.batches += 1
            self.wait_s += seconds
            self.queued_bytes -= nbytes
            self.waits.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {n: getattr(self, n) for n in (*self._INTS, *self._FLOATS)}
            waits = sorted(self.waits)
        out["wait_p50_s"] = quantile(waits, 0.50)
        out["wait_p99_s"] = quantile(waits, 0.99)
        out["wait_max_s"] = waits[-1] if waits else 0.0
        out["copy_gbps"] = out["timed_bytes"] / out["copy_s"] / 1e9 if out["copy_s"] > 0 else 0.0
        out["pack_gbps"] = out["packed_bytes"] / out["pack_s"] / 1e9 if out["pack_s"] > 0 else 0.0
        del out["timed_bytes"]
        return out


def perf_counter() -> float:
    return time.perf_counter()
