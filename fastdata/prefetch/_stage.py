"""Staging of one batch for ``CUDAPrefetcher``: the CPU pass-through and the CUDA copy engine.

Memory-safety design of the CUDA stager (read this before changing anything):

* Pinned staging ring, ``depth + 1`` slots, each one pinned byte buffer that grows (to the next power
  of two) only when a batch is bigger than any before. All pageable tensors of a batch are packed into
  the slot at aligned offsets and sent with ONE ``non_blocking`` copy. Before a slot is overwritten the
  producer waits on the event recorded right after that slot's copy, so pinned memory is never rewritten
  while the DMA engine still reads it. Tensors that are already pinned (DataLoader ``pin_memory=True``)
  are copied directly; they are kept referenced by the slot until the same event has completed.
* Device memory: each batch gets fresh memory from PyTorch's caching allocator, allocated on the side
  stream, and at hand-over every output tensor gets ``record_stream(consumer_stream)``. We chose this
  over an event-guarded ring of device buffers because the consumer owns its batches: training code may
  keep a batch (or a view of it) for logging, gradient accumulation or a later step, and a ring would
  silently overwrite it; with ``record_stream`` a block is reused only after all consumer work queued
  before the last reference died has finished, whatever the consumer does. In steady state the caching
  allocator serves these from cached blocks, so there is no ``cudaMalloc`` per batch.
* Backpressure: at each hand-over the consumer records an event on its stream (it marks the end of the
  previous batch's work) and posts it back; before staging batch ``j`` the producer waits until batch
  ``j - depth - 1`` is done on the GPU. Device memory held for batches is therefore bounded by about
  ``(depth + 1) x batch bytes`` even when the host runs far ahead of the GPU, and a consumer that frees
  its batches lets the allocator reuse the same blocks every step (flat ``memory_reserved``).
* Ordering: copies and transforms run on one persistent side stream per device (cached for the life of
  the process: a stream per epoch would grow reserved memory); the consumer's current stream waits on
  the batch's ready event, which costs the host nothing.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from fastdata.prefetch._queue import POLL_S, Stats, perf_counter
from fastdata.prefetch.tree import Path, map_tensors, tensor_leaves

# Offsets of packed tensors inside a staging buffer: keeps every dtype view legal and the device
# views aligned for vectorised kernels (the caching allocator itself aligns blocks to 512 bytes).
ALIGN = 128
# Smallest staging slot; slots grow to the next power of two, as PyTorch's pinned allocator rounds
# to one anyway, so a slowly growing batch size costs O(log) reallocations, not one per batch.
MIN_SLOT_BYTES = 1 << 16

_STREAMS: dict[int, torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The process-wide copy stream of a CUDA device (created once, reused by every prefetcher)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = _STREAMS[index] = torch.cuda.Stream(device=index)
        return stream


class Item:
    """A staged batch waiting in the channel."""

    __slots__ = ("batch", "ready", "nbytes", "tensors", "state")

    def __init__(self, batch: Any, ready: Any = None, nbytes: int = 0, tensors: tuple = ()) -> None:
        self.batch = batch
        self.ready = ready  # torch.cuda.Event recorded after the copy and transform, or None on CPU
        self.nbytes = nbytes
        self.tensors = tensors  # device tensors to protect with record_stream at hand-over
        self.state: Any = None  # the wrapped loader's state_dict() right after this batch


class CpuStager:
    """Thread prefetch only: batches pass through (same objects) unless a transform is given."""

    pinned_bytes = 0
    pinned_allocs = 0

    def __init__(self, transform: Callable[[Any], Any] | None, skip: Callable[[Path], bool] | None) -> None:
        self._transform = transform
        self._skip = skip

    def begin_epoch(self, depth: int) -> None:
        return None

    def stage(self, batch: Any, index: int, stop: threading.Event, marks: Any) -> Item | None:
        if any(t.device.type != "cpu" for _, t in tensor_leaves(batch, skip=self._skip)):
            batch = map_tensors(batch, lambda t, _p: t.cpu(), skip=self._skip)
        if self._transform is not None:
            batch = self._transform(batch)
        return Item(batch)

    def handover(self, item: Item, marks: Any) -> Any:
        return item.batch

    def end_epoch(self) -> None:
        return None

    def release(self) -> None:
        return None


class Marks:
    """Consumer-stream events posted back to the producer: the GPU-side backpressure of one epoch."""

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._events: deque[torch.cuda.Event] = deque()
        self._cv = threading.Condition()
        self._done = 0  # batches known finished on the consumer stream (producer-side only)
        self.handed = 0  # batches handed over (consumer-side only)

    def post(self, event: torch.cuda.Event) -> None:
        with self._cv:
            self._events.append(event)
            self._cv.notify_all()

    def wait_room(self, index: int, stop: threading.Event) -> None:
        """Block until batch ``index - depth - 1`` is done on the GPU (or ``stop``)."""
        while index - self._done > self._depth and not stop.is_set():
            with self._cv:
                if not self._events:
                    self._cv.wait(POLL_S)
                    continue
                event = self._events.popleft()
            event.synchronize()
            self._done += 1


class _Slot:
    __slots__ = ("buf", "start", "end", "nbytes", "refs", "pending")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.nbytes = 0
        self.refs: list[torch.Tensor] = []  # pinned source tensors copied directly
        self.pending = False  # events recorded, timing not yet folded into the stats


class CudaStager:
    """Pinned ring + side-stream copies + optional transform (see the module docstring)."""

    def __init__(
        self,
        device: torch.device,
        *,
        slots: int,
        transform: Callable[[Any], Any] | None,
        skip: Callable[[Path], bool] | None,
        stats: Stats,
    ) -> None:
        self.device = device
        self.stream = side_stream(device)
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._transform = transform
        self._skip = skip
        self._stats = stats
        self.lock = threading.Lock()  # an orphaned producer of an earlier epoch must never stage concurrently
        self.pinned_bytes = 0
        self.pinned_allocs = 0

    def begin_epoch(self, depth: int) -> Marks:
        return Marks(depth)

    def stage(self, batch: Any, index: int, stop: threading.Event, marks: Marks) -> Item | None:
        t0 = perf_counter()
        marks.wait_room(index, stop)
        t1 = perf_counter()
        with self.lock:
            if stop.is_set():
                return None
            item = self._stage_locked(batch)
        self._stats.add(throttle_s=t1 - t0, stage_s=perf_counter() - t1)
        return item

    def _stage_locked(self, batch: Any) -> Item:
        leaves = [t for _, t in tensor_leaves(batch, skip=self._skip)]
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        self._recycle(slot)
        plan, total, nbytes = self._plan(leaves)
        self._ensure_capacity(slot, total)
        with torch.no_grad():
            self._pack(slot, plan, leaves)
            self._order_after_producer(plan, leaves)
            with torch.cuda.stream(self.stream):
                slot.start.record(self.stream)
                moved = self._copy(slot, plan, leaves, total)
                slot.end.record(self.stream)
                slot.nbytes, slot.pending = nbytes, True
                it = iter(moved)
                out = map_tensors(batch, lambda _t, _p: next(it), skip=self._skip)
                if self._transform is not None:
                    out = self._transform(out)
                ready = torch.cuda.Event()
                ready.record(self.stream)
        tensors = tuple(t for _, t in tensor_leaves(out) if t.device == self.device)
        self._stats.add_batch_bytes(nbytes)
        return Item(out, ready, nbytes, tensors)

    def _order_after_producer(self, plan: list[tuple[str, int]], leaves: list[torch.Tensor]) -> None:
        """Batch tensors already on the device were made on this thread's current stream (the wrapped
        iterable runs here): the side stream, and through its ready event the consumer, must wait for
        that work; and the transform reads them on the side stream, so their memory is protected there."""
        kept = [t for (kind, _), t in zip(plan, leaves) if kind == "keep"]
        if not kept:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._transform is not None:
            for t in kept:
                t.record_stream(self.stream)

    def _plan(self, leaves: list[torch.Tensor]) -> tuple[list[tuple[str, int]], int, int]:
        """Per leaf (kind, offset): keep (already there), pack (pageable), direct (pinned), other."""
        plan: list[tuple[str, int]] = []
        total = nbytes = 0
        for t in leaves:
            size = t.numel() * t.element_size()
            if t.device == self.device:
                plan.append(("keep", 0))
                continue
            nbytes += size
            if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
                plan.append(("other", 0))
            elif t.is_pinned():
                plan.append(("direct", 0))
            else:
                plan.append(("pack", total))
                total += -(-size // ALIGN) * ALIGN
        return plan, total, nbytes

    def _ensure_capacity(self, slot: _Slot, total: int) -> None:
        if total == 0 or (slot.buf is not None and slot.buf.numel() >= total):
            return
        capacity = max(MIN_SLOT_BYTES, 1 << (total - 1).bit_length())
        old = slot.buf.numel() if slot.buf is not None else 0
        slot.buf = None  # free first: its copy has completed (_recycle) and peak pinned memory stays lower
        slot.buf = _pinned_empty(capacity)
        self.pinned_bytes += capacity - old
        self.pinned_allocs += 1

    def _pack(self, slot: _Slot, plan: list[tuple[str, int]], leaves: list[torch.Tensor]) -> None:
        for (kind, offset), t in zip(plan, leaves):
            if kind == "pack" and t.numel():
                _view(slot.buf, offset, t).copy_(t)

    def _copy(self, slot: _Slot, plan: list, leaves: list[torch.Tensor], total: int) -> list[torch.Tensor]:
        dev = None
        if total:
            dev = _device_empty(total, self.device)
            dev.copy_(slot.buf[:total], non_blocking=True)
        moved = []
        for (kind, offset), t in zip(plan, leaves):
            if kind == "keep":
                moved.append(t)
            elif kind == "pack":
                if t.numel():
                    moved.append(_view(dev, offset, t))
                else:
                    moved.append(_device_empty(0, self.device).view(t.dtype).as_strided(t.shape, _dense_strides(t)))
            else:
                if kind == "direct":
                    slot.refs.append(t)
                moved.append(_to_device(t, self.device))
        return moved

    def _recycle(self, slot: _Slot) -> None:
        """Wait until the slot's last copy finished; fold its timing into the stats; drop its refs."""
        if slot.pending:
            slot.end.synchronize()
            self._fold(slot)
        slot.refs = []

    def _fold(self, slot: _Slot) -> None:
        self._stats.add(copy_s=slot.start.elapsed_time(slot.end) / 1e3, timed_bytes=slot.nbytes)
        slot.pending = False

    def handover(self, item: Item, marks: Marks) -> Any:
        """Consumer side: order the current stream after the copy and protect the memory."""
        stream = torch.cuda.current_stream(self.device)
        if marks.handed:
            # blocking: the producer sleeps in Marks.wait_room instead of spinning a core that the
            # loader's workers could use (it waits there whenever the GPU is the bottleneck)
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
            marks.post(done)
        marks.handed += 1
        stream.wait_event(item.ready)
        for t in item.tensors:
            t.record_stream(stream)
        return item.batch

    def end_epoch(self) -> None:
        """Fold the timing of finished copies (called with the producer stopped)."""
        with self.lock:
            for slot in self._slots:
                if slot.pending and slot.end.query():
                    self._fold(slot)

    def release(self) -> None:
        with self.lock:
            for slot in self._slots:
                self._recycle(slot)
                slot.buf = None
            self.pinned_bytes = 0


# Allocation and transfer primitives, module-level so tests can run the whole stager on a CPU-only
# machine with stand-ins (tests/test_prefetch.py::test_cuda_stager_logic_on_cpu).
def _pinned_empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _device_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)  # on the current (side) stream


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when it is non-overlapping and dense (keeps channels_last etc.), else contiguous."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]))
    expected = 1
    for d in order:
        if t.shape[d] != 1 and t.stride(d) != expected:
            return _contiguous_strides(t.shape)
        expected *= t.shape[d]
    return tuple(t.stride())


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``buf`` (bytes) at ``offset`` with ``like``'s dtype, shape and dense strides."""
    size = like.numel() * like.element_size()
    return buf[offset : offset + size].view(like.dtype).as_strided(like.shape, _dense_strides(like))
