"""Run an iterator in a background thread, a bounded number of items ahead of its consumer.

Used by the conversion to overlap reading, checking and decoding inputs (file reads, Pillow's
decoders and resizing release the GIL) with encoding, hashing and writing the shard (hashlib and
file writes release it too). Order is preserved, so output stays deterministic.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()
_POLL_S = 0.1  # how often a blocked side re-checks that the other side is still there


def readahead(items: Iterator[T], depth: int = 32, *, name: str = "fastdata-readahead") -> Iterator[T]:
    """Yield ``items`` as produced by a background thread, at most ``depth`` ahead.

    An exception in the producer is re-raised here with its original traceback. Closing this
    generator early (or an exception in the consumer) stops the producer, closes ``items`` and
    joins the thread before returning.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth!r}")
    buf: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry: tuple[Any, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                buf.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_DONE, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            put((None, e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, error = buf.get(timeout=_POLL_S)
            except queue.Empty:
                if not thread.is_alive() and buf.empty():
                    raise RuntimeError(f"{name}: producer thread ended without a result") from None
                continue
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()
