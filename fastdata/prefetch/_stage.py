"""Staging of one batch for ``CUDAPrefetcher``: the CPU pass-through and the CUDA copy engine.

``CudaStager`` packs a batch's pageable tensors into one slot of a pinned staging ring (``depth + 1``
slots, ``PackPool`` threads doing numpy copies with the GIL released), sends each slot with ONE
``non_blocking`` copy on the device's persistent side stream (``side_stream``), runs the device
transform there, and hands the batch over with ``record_stream`` on the consumer's stream.
``CpuStager`` does the same with no copy. Read docs/design/prefetch.md ("Memory safety") before
changing anything here.

Invariants:
* a pinned slot is repacked only after the event recorded right after its copy has completed, and
  an already-pinned source tensor stays referenced by its slot until then;
* a slot only grows, to its largest batch rounded up to 1/32 of that batch's power of two;
* device memory of a handed-over batch is reused only after the consumer's work queued before its
  last reference died (``record_stream``), whatever the consumer keeps;
* the producer takes a credit (``_queue.Pipe``) before staging: at most ``depth`` staged batches
  wait, and batch ``j`` waits until the GPU finished the consumer's work on batch ``j - depth - 1``;
* one side stream per device and priority for the life of the process.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastdata._runtime import thread
from fastdata._util import usable_cores
from fastdata.prefetch._queue import Stats, perf_counter
from fastdata.prefetch.tree import Path, held_tensors, map_tensors, tensor_leaves

# Offsets of packed tensors inside a staging buffer: keeps every dtype view legal and the device
# views aligned for vectorised kernels (the caching allocator itself aligns blocks to 512 bytes).
ALIGN = 128
# Smallest staging slot.
MIN_SLOT_BYTES = 1 << 16
# A slot's capacity is its largest batch rounded up to this fraction of the batch's power of two
# (so at most 1/16 more than the batch: the power of two is less than twice the batch).
SLOT_GRANULE_DIV = 32
# Packs smaller than this run in the producer thread alone (a hand-off to the pack threads costs more
# than it saves).
PARALLEL_PACK_BYTES = 4 << 20
# No pack thread gets less than this.
MIN_PACK_CHUNK = 1 << 20

_STREAMS: dict[tuple[int, bool], torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()
# CUDAPrefetcher(stream_priority=...)
STREAM_PRIORITIES = ("normal", "high")


def side_stream(device: torch.device, high_priority: bool = False) -> torch.cuda.Stream:
    """The process-wide copy stream of a CUDA device (created once per priority, reused by every
    prefetcher). ``high_priority``: the device's highest stream priority (torch clamps the value
    to the device's range), so its kernels are scheduled ahead of normal-priority work queued."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        stream = _STREAMS.get((index, high_priority))
        if stream is None:
            priority = -(1 << 10) if high_priority else 0
            stream = _STREAMS[(index, high_priority)] = torch.cuda.Stream(device=index, priority=priority)
        return stream


def default_pack_threads() -> int:
    """A quarter of the usable cores, at most 4 (1 on small machines): the pack is short bursts;
    the rest stays with the training loop and the loader's workers."""
    return max(1, min(4, usable_cores() // 4))


def slot_capacity(nbytes: int) -> int:
    """Capacity of a slot that must hold ``nbytes``: rounded up to 1/32 of its power of two, so
    never more than ``nbytes * 17 / 16`` (and at least ``MIN_SLOT_BYTES``)."""
    if nbytes <= MIN_SLOT_BYTES:
        return MIN_SLOT_BYTES
    granule = max(4096, (1 << (nbytes - 1).bit_length()) // SLOT_GRANULE_DIV)
    return -(-nbytes // granule) * granule


class Item:
    """A staged batch waiting in the pipe."""

    __slots__ = ("batch", "ready", "nbytes", "tensors", "state")

    def __init__(self, batch: Any, ready: Any = None, nbytes: int = 0, tensors: tuple = ()) -> None:
        self.batch = batch
        self.ready = ready  # torch.cuda.Event recorded after the copy and transform, or None on CPU
        self.nbytes = nbytes
        self.tensors = tensors  # one device tensor per storage, protected with record_stream at hand-over
        self.state: Any = None  # the wrapped loader's state_dict() right after this batch


class CpuStager:
    """Thread prefetch only: batches pass through (same objects) unless a transform is given."""

    pinned_bytes = 0
    pinned_allocs = 0
    pack_threads = 0

    def __init__(self, transform: Callable[[Any], Any] | None, skip: Callable[[Path], bool] | None) -> None:
        self._transform = transform
        self._skip = skip

    def begin_thread(self) -> None:
        return None

    def stage(self, batch: Any, credit: Any) -> Item:
        if any(t.device.type != "cpu" for _, t in tensor_leaves(batch, skip=self._skip)):
            batch = map_tensors(batch, lambda t, _p: t.cpu(), skip=self._skip)
        if self._transform is not None:
            batch = self._transform(batch)
        return Item(batch)

    def handover(self, item: Item) -> tuple[Any, Any]:
        return item.batch, None

    def fold(self) -> None:
        return None

    def release(self) -> None:
        return None


# --- parallel pack -------------------------------------------------------------------------------


def _run_copies(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)  # a plain memcpy; numpy releases the GIL for it


def _pack_worker(tasks: queue.SimpleQueue) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        pairs, done = task
        try:
            _run_copies(pairs)
        except BaseException as e:  # noqa: BLE001  handed to the producer, which re-raises it
            done.put(e)
        else:
            done.put(None)


def _stop_workers(tasks: queue.SimpleQueue, n: int) -> None:
    for _ in range(n):
        tasks.put(None)


class PackPool:
    """Byte-range copies split over ``threads`` threads (the calling thread is one of them).

    numpy's copy is a single memcpy per range and releases the GIL; it never touches torch's
    intra-op thread pool, so the pack cannot oversubscribe the cores the training loop uses.
    Worker threads start on first use (again in a forked child) and stop with ``close()`` or when
    the pool is garbage collected.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._tasks: queue.SimpleQueue | None = None
        self._pid = -1
        self._finalizer: Any = None

    def _ensure(self) -> queue.SimpleQueue:
        if self._tasks is None or self._pid != os.getpid():
            self._tasks = queue.SimpleQueue()
            self._pid = os.getpid()
            for i in range(self.threads - 1):
                thread(_pack_worker, args=(self._tasks,), name=f"fastdata-pack-{i}").start()
            self._finalizer = weakref.finalize(self, _stop_workers, self._tasks, self.threads - 1)
        return self._tasks

    def copy(self, pairs: list[tuple[np.ndarray, np.ndarray]], total: int) -> None:
        """Copy every ``src`` into its ``dst`` (equal-length uint8 arrays); ``total`` bytes in all."""
        parts = min(self.threads, total // MIN_PACK_CHUNK)
        if parts <= 1 or total < PARALLEL_PACK_BYTES:
            _run_copies(pairs)
            return
        chunks = _split(pairs, total, parts)
        tasks = self._ensure()
        done: queue.SimpleQueue = queue.SimpleQueue()
        for chunk in chunks[1:]:
            tasks.put((chunk, done))
        error: BaseException | None = None
        try:
            _run_copies(chunks[0])
        except BaseException as e:  # noqa: BLE001  re-raised once the workers are done with the slot
            error = e
        for _ in chunks[1:]:
            result = done.get()
            error = error or result
        if error is not None:
            raise error

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._tasks, self._finalizer = None, None


def _split(pairs: list[tuple[np.ndarray, np.ndarray]], total: int, parts: int) -> list[list]:
    """``parts`` lists of (dst, src) slices with about ``total / parts`` bytes each."""
    per = -(-total // parts)
    chunks: list[list] = [[]]
    room = per
    for dst, src in pairs:
        start, n = 0, len(src)
        while start < n:
            take = min(room, n - start)
            chunks[-1].append((dst[start : start + take], src[start : start + take]))
            start += take
            room -= take
            if room == 0 and len(chunks) < parts:
                chunks.append([])
                room = per
    return [c for c in chunks if c]


def _byte_array(t: torch.Tensor, strides: tuple[int, ...]) -> np.ndarray | None:
    """A uint8 numpy view of ``t``'s memory if ``t`` is dense (``strides``, from ``_dense_strides``,
    are its own: any dimension order), else None."""
    if strides != t.stride() or t.is_conj() or t.is_neg():
        return None
    if t.requires_grad:
        t = t.detach()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()


# --- CUDA stager ---------------------------------------------------------------------------------


class _Slot:
    __slots__ = ("buf", "array", "start", "end", "nbytes", "refs", "pending")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.array: np.ndarray | None = None  # numpy view of buf
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.nbytes = 0
        self.refs: list[torch.Tensor] = []  # pinned source tensors copied directly
        self.pending = False  # events recorded, timing not yet folded into the stats


class CudaStager:
    """Pinned ring + parallel pack + side-stream copies + optional transform (see the module docstring)."""

    def __init__(
        self,
        device: torch.device,
        *,
        slots: int,
        transform: Callable[[Any], Any] | None,
        skip: Callable[[Path], bool] | None,
        stats: Stats,
        pack_threads: int,
        high_priority: bool = False,
    ) -> None:
        self.device = device
        self.stream = side_stream(device, high_priority)
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._transform = transform
        self._skip = skip
        self._stats = stats
        self._pool = PackPool(pack_threads)
        self.pack_threads = pack_threads
        self.lock = threading.Lock()  # an orphaned producer of an earlier run must never stage concurrently
        self.pinned_bytes = 0
        self.pinned_allocs = 0
        # a prefetcher dropped without close(): its registered slots are still unregistered (after their copies)
        self._finalizer = weakref.finalize(self, _free_slots, self._slots)

    def begin_thread(self) -> None:
        """In the producer thread, once: no autograd, and the side stream as its current stream (both
        thread-local), so staging a batch needs no context managers."""
        torch.set_grad_enabled(False)
        _set_current_stream(self.stream)

    def stage(self, batch: Any, credit: Any) -> Item:
        t0 = perf_counter()
        if credit is not None:
            credit.synchronize()  # the consumer's work on batch j - depth - 1 has finished on the GPU
        t1 = perf_counter()
        with self.lock:
            item, pack_s, packed, copy_s, timed = self._stage_locked(batch)
        self._stats.add_staged(throttle_s=t1 - t0, stage_s=perf_counter() - t1, pack_s=pack_s, packed=packed,
                               copy_s=copy_s, timed=timed, nbytes=item.nbytes)
        return item

    def _stage_locked(self, batch: Any) -> tuple[Item, float, int, float, int]:
        leaves = [t for _, t in tensor_leaves(batch, skip=self._skip)]
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        copy_s, timed = self._recycle(slot)
        plan, total, nbytes = self._plan(leaves)
        self._ensure_capacity(slot, total)
        t0 = perf_counter()
        packed = self._pack(slot, plan, leaves)
        pack_s = perf_counter() - t0
        current = torch.cuda.current_stream(self.device)
        if current != self.stream:  # the iterable switched streams (and did not switch back)
            self._order_after_producer(plan, leaves, current)
            _set_current_stream(self.stream)
        slot.start.record(self.stream)
        moved, owned = self._copy(slot, plan, leaves, total)
        slot.end.record(self.stream)
        slot.nbytes, slot.pending = nbytes, True
        it = iter(moved)
        out = map_tensors(batch, lambda _t, _p: next(it), skip=self._skip)
        if self._transform is not None:
            out = self._transform(out)
            owned = self._storages(out)
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return Item(out, ready, nbytes, tuple(owned)), pack_s, packed, copy_s, timed

    def _storages(self, out: Any) -> list[torch.Tensor]:
        """One tensor per distinct device storage in ``out`` (record_stream acts on the storage), those
        inside objects such as a ragged ``ImageBatch`` included (``tree.HOLDS_TENSORS``)."""
        seen: dict[int, torch.Tensor] = {}
        for t in held_tensors(out):
            if t.device == self.device:
                seen.setdefault(t.untyped_storage().data_ptr(), t)
        return list(seen.values())

    def _order_after_producer(self, plan: list[tuple[str, int, Any]], leaves: list[torch.Tensor], current: Any) -> None:
        """Batch tensors already on the device were made by the wrapped iterable in this thread, whose
        current stream is normally the side stream (``begin_thread``): then copies, transform and the
        ready event are ordered after them already. If the iterable switched this thread to another
        stream, the side stream waits for that one, and the transform's reads are protected there.
        (Device tensors made by other threads must be complete on their streams before the iterable
        yields them.)"""
        kept = [t for (kind, _, _), t in zip(plan, leaves) if kind == "keep"]
        if not kept:
            return
        self.stream.wait_stream(current)
        if self._transform is not None:
            for t in kept:
                t.record_stream(self.stream)

    def _plan(self, leaves: list[torch.Tensor]) -> tuple[list[tuple[str, int, Any]], int, int]:
        """Per leaf (kind, offset, dense strides): keep (already there), pack (pageable), direct
        (pinned), other (moved by ``.to``)."""
        plan: list[tuple[str, int, Any]] = []
        total = nbytes = 0
        device = self.device
        for t in leaves:
            if t.device == device:
                plan.append(("keep", 0, None))
                continue
            size = t.numel() * t.element_size()
            nbytes += size
            if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
                plan.append(("other", 0, None))
            elif t.is_pinned():
                plan.append(("direct", 0, None))
            else:
                plan.append(("pack", total, _dense_strides(t)))
                total += -(-size // ALIGN) * ALIGN
        return plan, total, nbytes

    def _ensure_capacity(self, slot: _Slot, total: int) -> None:
        if total == 0 or (slot.buf is not None and slot.buf.numel() >= total):
            return
        capacity = slot_capacity(total)
        old = slot.buf.numel() if slot.buf is not None else 0
        if slot.buf is not None:  # free first (its copy has completed: _recycle): peak pinned memory stays lower
            buf, slot.buf, slot.array = slot.buf, None, None
            _pinned_free(buf)
            del buf
        slot.buf = _pinned_empty(capacity)
        slot.array = slot.buf.numpy()
        self.pinned_bytes += capacity - old
        self.pinned_allocs += 1

    def _pack(self, slot: _Slot, plan: list[tuple[str, int, Any]], leaves: list[torch.Tensor]) -> int:
        """Copy the pageable tensors into the slot; returns the bytes copied by the pool."""
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        total = 0
        array = slot.array
        for (kind, offset, strides), t in zip(plan, leaves):
            if kind != "pack" or not t.numel():
                continue
            src = _byte_array(t, strides)
            if src is None:  # overlapping or gapped (expand, slicing with a step): torch lays it out
                _view(slot.buf, offset, t, strides).copy_(t)
                continue
            assert array is not None
            pairs.append((array[offset : offset + len(src)], src))
            total += len(src)
        if pairs:
            self._pool.copy(pairs, total)
        return total

    def _copy(self, slot: _Slot, plan: list[tuple[str, int, Any]], leaves: list[torch.Tensor], total: int
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dev = None
        owned: list[torch.Tensor] = []
        device = self.device
        if total:
            dev = _device_empty(total, device)
            dev.copy_(slot.buf[:total], non_blocking=True)
            if dev.device == device:
                owned.append(dev)
        moved = []
        for (kind, offset, strides), t in zip(plan, leaves):
            if kind == "pack":
                if t.numel():
                    moved.append(_view(dev, offset, t, strides))
                else:
                    moved.append(_device_empty(0, device).view(t.dtype).as_strided(t.shape, strides))
            elif kind == "keep":
                moved.append(t)
                owned.append(t)
            else:
                if kind == "direct":
                    slot.refs.append(t)
                out = _to_device(t, device)
                moved.append(out)
                if out.device == device:
                    owned.append(out)
        return moved, owned

    def _recycle(self, slot: _Slot) -> tuple[float, int]:
        """Wait until the slot's last copy finished; drop its refs. Returns its (copy seconds, bytes)."""
        timing = (0.0, 0)
        if slot.pending:
            slot.end.synchronize()
            timing = self._timing(slot)
        slot.refs = []
        return timing

    @staticmethod
    def _timing(slot: _Slot) -> tuple[float, int]:
        slot.pending = False
        return slot.start.elapsed_time(slot.end) / 1e3, slot.nbytes

    def handover(self, item: Item) -> tuple[Any, Any]:
        """Consumer side: the credit event (end of the consumer's work so far), then order the current
        stream after the copy and protect the memory. Returns (batch, credit)."""
        stream = torch.cuda.current_stream(self.device)
        # blocking: the producer sleeps in credit.synchronize() instead of spinning a core that the
        # loader's workers could use (it waits there whenever the GPU is the bottleneck)
        done = torch.cuda.Event(blocking=True)
        done.record(stream)
        stream.wait_event(item.ready)
        for t in item.tensors:
            t.record_stream(stream)
        return item.batch, done

    def fold(self) -> None:
        """Fold the timing of finished copies (called with the producer stopped)."""
        with self.lock:
            for slot in self._slots:
                if slot.pending and slot.end.query():
                    copy_s, timed = self._timing(slot)
                    self._stats.add(copy_s=copy_s, timed_bytes=timed)

    def release(self) -> None:
        with self.lock:
            self._finalizer()
            self.pinned_bytes = 0
        self._pool.close()


def _free_slots(slots: list[_Slot]) -> None:
    """Wait for each slot's last copy, then unregister and drop its buffer."""
    for slot in slots:
        try:
            if slot.pending:
                slot.end.synchronize()
                slot.pending = False
            slot.refs = []
            if slot.buf is not None:
                buf, slot.buf, slot.array = slot.buf, None, None
                _pinned_free(buf)
        except Exception as e:  # noqa: BLE001  e.g. at interpreter exit, after CUDA shut down
            warnings.warn(f"CUDAPrefetcher: freeing a pinned staging slot failed: {e!r}", RuntimeWarning, stacklevel=1)


# Allocation and transfer primitives, module-level so tests can run the whole stager on a CPU-only
# machine with stand-ins (tests/prefetch/test_stager.py::test_cuda_stager_logic_on_cpu).
_REGISTERED: dict[int, Any] = {}  # data_ptr -> the mmap behind a cudaHostRegister'ed slot
_REGISTERED_LOCK = threading.Lock()


def _pinned_empty(nbytes: int) -> torch.Tensor:
    """A page-locked byte buffer of exactly ``nbytes`` (page-rounded): registered anonymous memory,
    else PyTorch's pinned allocator (which rounds up to a power of two)."""
    buf = _registered_empty(nbytes)
    if buf is None:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return buf


def _registered_empty(nbytes: int) -> torch.Tensor | None:
    try:
        cudart = torch.cuda.cudart()
        register, unregister = cudart.cudaHostRegister, cudart.cudaHostUnregister
    except (AttributeError, RuntimeError, AssertionError):
        return None
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    area = mmap.mmap(-1, size)
    buf = torch.frombuffer(area, dtype=torch.uint8)
    ptr = buf.data_ptr()
    if int(register(ptr, size, 0)) != 0:  # e.g. the locked-memory limit: use PyTorch's allocator
        return None
    if not buf.is_pinned():  # registered but not seen as pinned: copies would not be asynchronous
        unregister(ptr)
        return None
    with _REGISTERED_LOCK:
        _REGISTERED[ptr] = (area, unregister)
    return buf[:nbytes] if nbytes < size else buf


def _pinned_free(buf: torch.Tensor) -> None:
    """Unregister a buffer from ``_pinned_empty`` (its copies have completed); the memory goes with ``buf``."""
    with _REGISTERED_LOCK:
        entry = _REGISTERED.pop(buf.data_ptr(), None)
    if entry is not None:
        entry[1](buf.data_ptr())


def _set_current_stream(stream: Any) -> None:
    torch.cuda.set_stream(stream)


def _device_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)  # on the current (side) stream


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when it is non-overlapping and dense (keeps channels_last etc.), else contiguous."""
    if t.is_contiguous():
        return t.stride()
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


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor, strides: tuple[int, ...] | None = None) -> torch.Tensor:
    """A view of ``buf`` (bytes) at ``offset`` with ``like``'s dtype, shape and dense strides."""
    size = like.numel() * like.element_size()
    if strides is None:
        strides = _dense_strides(like)
    return buf[offset : offset + size].view(like.dtype).as_strided(like.shape, strides)
