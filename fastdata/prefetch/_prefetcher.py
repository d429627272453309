"""``CUDAPrefetcher``: overlap loading and host-to-device copies with compute.

A background thread pulls batches from the wrapped iterable, packs their tensors into a reused pinned
staging ring, copies them to the GPU on a persistent side stream and runs optional device transforms
there; the training thread only takes finished batches. Without CUDA (``device="cpu"`` or none
available) the same thread and queue give a CPU prefetcher with identical semantics. See
``fastdata/_prefetch_stage.py`` for the memory-safety design.
"""
from __future__ import annotations

import os
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fastdata.prefetch._queue import CLOSED, END, Channel, Failure, Stats, perf_counter
from fastdata.prefetch._stage import CpuStager, CudaStager
from fastdata.prefetch.tree import keys_matcher

__all__ = ["CUDAPrefetcher", "PrefetchOptions", "resolve_device"]

# How long break/close wait for the thread (it can only stop between two next() calls of the wrapped
# iterable) before warning and leaving the daemon thread to finish that call on its own.
JOIN_TIMEOUT_S = 10.0

_thread_ids = iter(range(1 << 62))


@dataclass(frozen=True)
class PrefetchOptions:
    """Validated options of ``CUDAPrefetcher`` (see its docstring)."""

    depth: int = 2  # double buffering: copy of batch i+1 and i+2 run while batch i computes
    keep_on_host: tuple[Any, ...] = ()
    transform: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {self.depth!r}")
        keep = self.keep_on_host
        if isinstance(keep, (str, int)):
            keep = (keep,)
        try:
            keep = tuple(keep)
        except TypeError:
            raise ValueError(
                f"keep_on_host must be a key or a sequence of keys (str or int), got {self.keep_on_host!r}"
            ) from None
        bad = [k for k in keep if isinstance(k, bool) or not isinstance(k, (str, int))]
        if bad:
            raise ValueError(f"keep_on_host keys must be str or int, got {bad[0]!r} in {self.keep_on_host!r}")
        object.__setattr__(self, "keep_on_host", keep)
        if self.transform is not None and not callable(self.transform):
            raise ValueError(f"transform must be callable or None, got {self.transform!r}")


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available else CPU; a bare ``"cuda"`` -> ``cuda:$LOCAL_RANK`` (or current)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, bool):
        raise ValueError(f"device must be a str, int, torch.device or None, got {device!r}")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a str, int, torch.device or None, got {device!r}") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    index = dev.index if dev.index is not None else _local_rank()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device index {index} (from device={device!r} / LOCAL_RANK) out of range: {count} GPUs")
    return torch.device("cuda", index)


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK")
    if value is None or value.strip() == "":
        return torch.cuda.current_device()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {value!r}") from None


class _Epoch:
    """One pass: the producer thread, its channel and its stop flag."""

    def __init__(self, thread: threading.Thread, channel: Channel, stop: threading.Event, marks: Any) -> None:
        self.thread, self.channel, self.stop, self.marks = thread, channel, stop, marks


class CUDAPrefetcher:
    """Iterate ``iterable`` with every tensor of every batch already on ``device``.

    Args:
        iterable: a DataLoader or any re-iterable of batches (tensors, possibly nested in dicts, lists,
            tuples, namedtuples and dataclasses; other values pass through untouched).
        device: ``None`` (CUDA when available, ``cuda:$LOCAL_RANK``; else CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``, an index or a ``torch.device``.
        depth: batches prepared ahead (queued and in flight). Held pinned and device memory is
            bounded by about ``(depth + 1) x batch bytes``.
        transform: ``batch -> batch`` applied after the move, on the side stream (CUDA) or in the
            background thread (CPU); e.g. ``fastdata.gpu.Normalize(...)``.
        keep_on_host: keys (dict keys, field names or indices) whose values stay where they are.

    Use it on one stream: the consumer's current stream at each ``next()`` waits for the batch.
    Iterating again starts a new epoch (an unfinished one is stopped first). Errors raised by the
    iterable or the transform are re-raised at the batch where they happened, with their traceback.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        *,
        device: str | int | torch.device | None = None,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        keep_on_host: Iterable[str | int] | str | int = (),
    ) -> None:
        if not isinstance(iterable, Iterable):
            raise ValueError(f"iterable must be iterable, got {type(iterable).__name__}")
        if isinstance(iterable, Iterator):
            warnings.warn(
                "CUDAPrefetcher wraps a one-shot iterator: only the first epoch will have batches",
                stacklevel=2,
            )
        self.options = PrefetchOptions(depth=depth, keep_on_host=keep_on_host, transform=transform)
        self.device = resolve_device(device)
        self._iterable = iterable
        self._stats = Stats()
        skip = keys_matcher(self.options.keep_on_host)
        if self.device.type == "cuda":
            self._stager: CpuStager | CudaStager = CudaStager(
                self.device, slots=depth + 1, transform=transform, skip=skip, stats=self._stats
            )
        else:
            self._stager = CpuStager(transform, skip)
        self._epoch: _Epoch | None = None
        self._closed = False
        self._state: Any = None  # the wrapped loader's state after the last batch handed over
        self._state_error: BaseException | None = None

    @property
    def iterable(self) -> Iterable[Any]:
        """The wrapped iterable (e.g. for its settings; iterating it directly bypasses the prefetch)."""
        return self._iterable

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # TypeError if the iterable has none

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("CUDAPrefetcher is closed")
        return self._run()

    def _run(self) -> Iterator[Any]:
        self._stop_epoch()
        epoch = self._start_epoch()
        try:
            while True:
                t0 = perf_counter()
                item = epoch.channel.get(epoch.thread.is_alive)
                waited = perf_counter() - t0
                if isinstance(item, Failure):
                    raise item.error
                if item is END or item is CLOSED:
                    return
                batch = self._stager.handover(item, epoch.marks)
                self._stats.add_wait(waited, item.nbytes)
                if item.state is not None:
                    self._state = item.state
                item = None  # the generator frame must not keep the batch alive past the consumer
                yield batch
                batch = None
        finally:
            if self._epoch is epoch:
                self._stop_epoch()

    def _start_epoch(self) -> _Epoch:
        source = iter(self._iterable)  # in the caller's thread: DataLoader starts/resets workers here
        snapshot = self._snapshot_fn()
        stop = threading.Event()
        channel = Channel(self.options.depth)
        marks = self._stager.begin_epoch(self.options.depth)
        thread = threading.Thread(
            target=_produce,
            args=(source, channel, stop, self._stager, marks, self._stats, self.device, snapshot),
            name=f"fastdata-prefetch-{next(_thread_ids)}",
            daemon=True,
        )
        self._epoch = _Epoch(thread, channel, stop, marks)
        self._stats.add(epochs=1)
        thread.start()
        return self._epoch

    def _snapshot_fn(self) -> Callable[[], Any] | None:
        """The wrapped loader's ``state_dict`` if it has a working one (checked once per epoch)."""
        fn = getattr(self._iterable, "state_dict", None)
        self._state, self._state_error = None, None
        if not callable(fn):
            return None
        try:
            self._state = fn()
        except (TypeError, NotImplementedError) as e:  # e.g. fastdata.DataLoader over a plain dataset
            self._state_error = e
            return None
        return fn

    def state_dict(self) -> Any:
        """The wrapped loader's ``state_dict()`` as of the last batch handed to the consumer.

        The background thread reads ahead, so the loader's own ``state_dict()`` counts batches
        still in flight; this one is snapshotted right after each batch was pulled and handed
        over with it, so resuming from it replays nothing and skips nothing.
        """
        if self._state_error is not None:
            return self._iterable.state_dict()  # type: ignore[attr-defined]  # raises its own error again
        if not callable(getattr(self._iterable, "state_dict", None)):
            raise TypeError(f"the wrapped {type(self._iterable).__name__} has no state_dict()")
        if self._epoch is None and self._state is None:
            return self._iterable.state_dict()  # type: ignore[attr-defined]
        return self._state

    def load_state_dict(self, state: Any) -> None:
        """Stop the current epoch and pass ``state`` to the wrapped loader's ``load_state_dict``."""
        fn = getattr(self._iterable, "load_state_dict", None)
        if not callable(fn):
            raise TypeError(f"the wrapped {type(self._iterable).__name__} has no load_state_dict()")
        self._stop_epoch()
        fn(state)
        self._state, self._state_error = None, None

    def _stop_epoch(self, *, wait: bool = True) -> None:
        epoch, self._epoch = self._epoch, None
        if epoch is None:
            return
        epoch.stop.set()
        for item in epoch.channel.close():
            self._stats.add(queued_bytes=-getattr(item, "nbytes", 0))
        if not wait or epoch.thread is threading.current_thread():
            return
        epoch.thread.join(JOIN_TIMEOUT_S)
        if epoch.thread.is_alive():
            warnings.warn(
                f"{epoch.thread.name}: the wrapped iterable's next() has not returned after {JOIN_TIMEOUT_S:.0f} s;"
                " the daemon thread will exit when it does",
                RuntimeWarning,
                stacklevel=3,
            )
        self._stager.end_epoch()

    def close(self) -> None:
        """Stop the background thread and free the staging buffers. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._stop_epoch()
        self._stager.release()

    def __enter__(self) -> CUDAPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            self._stop_epoch(wait=False)
        except Exception:  # noqa: BLE001  interpreter shutdown: nothing left to report to
            pass

    def stats(self) -> dict[str, Any]:
        """Counters since construction or ``reset_stats()``.

        ``batches``, ``epochs``; ``wait_s`` (total time the consumer waited in ``next()``),
        ``wait_p50_s``, ``wait_p99_s``, ``wait_max_s`` (per batch, last 100k batches); ``load_s``
        (thread time in the iterable's ``next()``), ``stage_s`` (thread time packing and issuing
        copies), ``throttle_s`` (thread time held back because ``depth`` batches were in flight on the
        GPU); ``bytes`` (host-to-device bytes issued), ``copy_s`` and ``copy_gbps`` (device time of the
        copies, from CUDA events; lags a few batches behind ``bytes`` during an epoch);
        ``pinned_bytes`` (staging memory held), ``pinned_allocs``, ``queued_bytes`` (device bytes
        staged but not yet handed over), ``peak_batch_bytes``, ``depth``, ``device``.
        """
        out = self._stats.snapshot()
        out.update(
            pinned_bytes=self._stager.pinned_bytes,
            pinned_allocs=self._stager.pinned_allocs,
            depth=self.options.depth,
            device=str(self.device),
        )
        return out

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after warm-up); memory figures are not counters and stay."""
        self._stats.reset()

    def __repr__(self) -> str:
        return f"CUDAPrefetcher({self._iterable!r}, device={str(self.device)!r}, depth={self.options.depth})"


def _produce(
    source: Iterator[Any],
    channel: Channel,
    stop: threading.Event,
    stager: CpuStager | CudaStager,
    marks: Any,
    stats: Stats,
    device: torch.device,
    snapshot: Callable[[], Any] | None,
) -> None:
    """Thread body. Holds no reference to the prefetcher, so dropping it stops the thread."""
    where = f"raised while setting up the thread for {device}"
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        index = 0
        while not stop.is_set():
            where = f"raised by the wrapped iterable at batch {index}"
            t0 = perf_counter()
            try:
                batch = next(source)
            except StopIteration:
                channel.put(END)
                return
            state = snapshot() if snapshot is not None else None
            stats.add(load_s=perf_counter() - t0)
            where = f"raised while staging batch {index} (transform or copy to {device})"
            item = stager.stage(batch, index, stop, marks)
            del batch
            if item is None:
                return
            item.state = state
            if not channel.put(item):
                stats.add(queued_bytes=-item.nbytes)
                return
            index += 1
    except BaseException as e:  # noqa: BLE001  travels to the consumer, traceback included
        _note(e, f"{where} (thread {threading.current_thread().name})")
        channel.put(Failure(e))
    finally:
        if isinstance(source, types.GeneratorType):
            _close_generator(source)


def _close_generator(source: types.GeneratorType) -> None:
    """Run a generator's cleanup in the thread that ran it (it may be stopped mid-epoch)."""
    try:
        source.close()
    except Exception as e:  # noqa: BLE001  nobody is waiting for this epoch any more
        warnings.warn(f"CUDAPrefetcher: closing the wrapped generator raised {e!r}", RuntimeWarning, stacklevel=1)


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(f"fastdata.CUDAPrefetcher: {text}")
