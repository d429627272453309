"""Hand-off between the prefetch thread and the consumer: a bounded, closable FIFO and the counters.

Every blocking call waits in short slices, so a stop request, a closed channel or a dead producer
is noticed within ``POLL_S`` and a KeyboardInterrupt reaches the consumer promptly.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from fastdata._util import quantile
from typing import Any

# Wake-up period of every blocking wait. Only bounds how late a stop/close is noticed; wake-ups
# on new data are immediate (notify), so this does not add latency to the data path.
POLL_S = 0.05
# Per-batch consumer waits kept for the percentiles (a sliding window, 8 bytes each).
WAIT_WINDOW = 100_000


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


END = _Sentinel("end of epoch")
CLOSED = _Sentinel("channel closed")


class Failure:
    """An exception raised in the producer thread, carried to the consumer with its traceback."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Channel:
    """Bounded FIFO from one producer thread to one consumer; ``close()`` wakes both sides."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: deque[Any] = deque()
        self._cv = threading.Condition()
        self._closed = False

    def put(self, item: Any) -> bool:
        """Append ``item``, waiting while full; False (item dropped) once the channel is closed."""
        with self._cv:
            while len(self._items) >= self._capacity and not self._closed:
                self._cv.wait(POLL_S)
            if self._closed:
                return False
            self._items.append(item)
            self._cv.notify_all()
            return True

    def get(self, producer_alive: Callable[[], bool]) -> Any:
        """Next item, ``CLOSED`` once closed; RuntimeError if the producer died without a word."""
        with self._cv:
            while not self._items:
                if self._closed:
                    return CLOSED
                if not producer_alive():
                    raise RuntimeError("fastdata prefetch thread exited without finishing the epoch")
                self._cv.wait(POLL_S)
            item = self._items.popleft()
            self._cv.notify_all()
            return item

    def close(self) -> list[Any]:
        """Close and return what was still queued (dropped by the caller)."""
        with self._cv:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._cv.notify_all()
            return left


class Stats:
    """Thread-safe counters behind ``CUDAPrefetcher.stats()``."""

    _FLOATS = ("wait_s", "load_s", "stage_s", "throttle_s", "copy_s")
    _INTS = ("batches", "epochs", "bytes", "timed_bytes", "queued_bytes", "peak_batch_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            for name in self._FLOATS:
                setattr(self, name, 0.0)
            for name in self._INTS:
                setattr(self, name, 0)
            self.waits: deque[float] = deque(maxlen=WAIT_WINDOW)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, value in amounts.items():
                setattr(self, name, getattr(self, name) + value)

    def add_batch_bytes(self, nbytes: int) -> None:
        with self._lock:
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
        del out["timed_bytes"]
        return out


def perf_counter() -> float:
    return time.perf_counter()
