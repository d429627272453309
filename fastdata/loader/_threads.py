"""The thread decoder of :class:`fastdata.DataLoader` (``decode_threads=N``): no worker processes.

Worker processes pay for every batch twice: the worker collates it into fresh shared memory and
the main process receives, unpickles and (with ``pin_memory``) copies it again. Pillow and
libjpeg-turbo release the GIL while decoding and resampling, so a pool of threads in the loading
process decodes in parallel too, and each sample can land straight in its batch's buffer.

Same batches as the worker path. Each of the ``num_workers`` virtual workers walks the index
sequence a worker process would walk (a dataset :class:`~fastdata.dataset.Cursor`, resume stages
included); batches are dealt round-robin over the virtual workers from the one that yields first,
skipping exhausted ones; each yields its own partial last batch unless ``drop_last``; a sample
skipped by ``on_error`` shifts the batch boundary exactly as in a worker. Each batch carries
(virtual worker, position after it), so ``state_dict()`` is exact and a state saved on either path
resumes on the other. Only the pool's thread count (``decode_threads``) is free: it changes speed,
never batches. (Random transforms drawing from a global RNG see a different order of draws than
in worker processes, which are seeded per worker; content is then not reproducible either way.)

Scheduling. The consumer's ``next()`` dispatches the samples of the coming batches (predicted by
the same round-robin) to the pool in chunks, keeping about ``LOOKAHEAD + 1`` batches in flight,
then takes the current batch's results in sequence order. Nothing runs in the consumer thread but
the dispatch, the collation of small fields and a copy for a sample that did not land in place.

Writing in place. Once the first sample of an epoch shows its tensor fields (shape, dtype), each
dispatched sample is told the batch row it will most likely occupy (its *predicted ordinal*: the
number of samples of its virtual worker dispatched before it since the last re-base) and the pool
thread copies its tensors there. A skipped sample makes the later samples' true rows smaller than
predicted; those are copied to their true rows by the consumer. This is race-free because
predictions only grow along a virtual worker's sequence and are never below the true ordinal: a
row is written speculatively only by the one sample predicted for it, which is consumed (its task
finished) before any later sample's true row is filled, and a batch's buffer is handed over only
after every sample predicted into it has been consumed. Predictions re-base to the true count
whenever the virtual worker has nothing in flight.

Buffer ownership. ``python benchmarks/decode_stage.py --buffers`` fills 64 or 256 rows of
3x224x224 uint8 into a batch while the consumer holds the previous two batches; on the 2-core dev
box (busy, load ~12) a fresh tensor per batch took 11.8 ms per 64 and 46 ms per 256 rows, a
reused one 4.2 and 23 ms (first-touch page faults; 3.5-4.0 vs 1.5 ms and 16 vs 6 ms in a quieter
moment). So CPU batch memory comes from a ring whose
buffers are reused only when provably free: not assigned to a batch in flight and no tensor but
the ring's own refers to its storage (``torch._C._storage_Use_Count``; the consumer always gets
views, so any batch, slice or NumPy array it keeps pins the buffer; a test guards this torch
behaviour), and never once its storage moved to shared memory (a batch put on a torch.multiprocessing
queue: the receiving process maps it). When every ring buffer is held, a fresh one is allocated. Pinned memory
(``pin_memory=True``) is not ringed: a consumer may drop a pinned batch while a ``non_blocking``
copy still reads it, which only torch's caching host allocator knows (it records an event on the
copy's stream and reuses the block after it completes); so pinned buffers are fresh
``torch.empty(pin_memory=True)`` per batch, which that allocator serves from its cache.

Threads. The pool's threads are daemons named ``fastdata-decode-<k>``, hold no reference to the
iterator (dropping it, an early ``break``, ``close()`` or the end of the epoch stops and joins
them; after a ``timeout=`` error they are told to stop and end after their current chunk, unjoined,
so the error comes at the timeout as on the worker path), and are paused (joined after their current chunk) before any ``os.fork`` of this process,
so a DataLoader with worker processes elsewhere never forks while they run; they restart on the
next ``next()``. An exception in a pool thread reaches the consumer at the batch where the worker
path would raise it, as the same exception object with its traceback and a note naming the thread,
virtual worker, sample and batch.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from fastdata._util import add_note
from fastdata.dataset import BatchSchedule, EpochStart, ShardedDataset, Turn
from fastdata.errors import MissingFieldError
from fastdata.loader._cached import FastBatch

__all__ = ["LOOKAHEAD", "ThreadBatches", "check_threads", "collate", "static_reason", "thread_batches"]

# Batches dispatched beyond the one the consumer waits for: the threads keep decoding while the
# consumer works on a batch, at (LOOKAHEAD + 1) batches of memory (torch's prefetch_factor is 2 too).
LOOKAHEAD = 2
# Ring buffers kept per field beyond those in flight: batches the consumer (or a prefetcher) may
# still hold; more are allocated fresh (and dropped) rather than waited for.
RING_SPARE = 4
# Tensor fields smaller than this are collated normally; bigger ones are written in place.
MIN_INPLACE_BYTES = 1024
_POLL_S = 0.1  # how often a waiting consumer checks that the pool is alive
_JOIN_S = 10.0  # how long close() waits for a thread stuck in a user transform before leaving it (daemon)


def check_threads(value: Any) -> int:
    """Validate ``decode_threads``: an int >= 0 (0: worker processes as usual)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decode_threads must be an int >= 0 (0: decode in worker processes), got {value!r}")
    return value


def collate(collate_fn: Callable[[Any], Any], data: Any) -> Any:
    """``collate_fn(data)``; StopIteration from it is a RuntimeError: raised in ``__next__`` (or in a
    worker's fetch) it would be taken for the end of the data, the rest of the epoch lost silently."""
    try:
        return collate_fn(data)
    except StopIteration as stop:
        raise RuntimeError("collate_fn raised StopIteration") from stop
    except KeyError as missing:
        text = _differing_fields(data)
        if text is None:
            raise
        raise MissingFieldError(
            f"the samples of one batch hold different fields ({text}), and the collate needs the same ones "
            "in every sample (a KeyError). Image fields sharing a base name are alternatives (a folder of "
            ".jpg and .png files gives samples with `jpg` or `png`): re-encode the images to one format, "
            "give them one field name in a sample_transform, or pass a collate_fn that handles both"
        ) from missing
    except RuntimeError as err:  # torch's "stack expects each tensor to be equal size": which field, which samples
        text = _differing_shapes(data) if "equal size" in str(err) else None
        if text is None:
            raise
        raise RuntimeError(
            f"the samples of one batch hold {text}, and the collate stacks a field's values into one tensor: give "
            "them one size with preprocess= (e.g. fastdata.ResizeCenterCrop(224)) or transform=, or pass a "
            f"collate_fn that keeps them apart ({err})") from err


def _differing_shapes(data: Any) -> str | None:
    """The first field (or tuple position) whose arrays or tensors differ in shape between two samples of ``data``,
    described, or None."""
    if not isinstance(data, list) or not data:
        return None
    if all(isinstance(s, Mapping) for s in data):
        names, label = list(data[0]), lambda j, s: repr(s.get("__key__", f"#{j}"))
        what = "field {!r}"
    elif all(isinstance(s, (tuple, list)) and len(s) == len(data[0]) for s in data):  # (image, label) samples
        names, label = list(range(len(data[0]))), lambda j, s: f"sample {j} of the batch"
        what = "element {} of each sample"
    else:
        return None
    arrays = (torch.Tensor, np.ndarray)
    for name in names:
        first = data[0][name]
        if not isinstance(first, arrays):
            continue
        for j, other in enumerate(data[1:], 1):
            v = other.get(name) if isinstance(other, Mapping) else other[name]
            if isinstance(v, arrays) and tuple(v.shape) != tuple(first.shape):
                return (f"{what.format(name)} in different shapes ({label(0, data[0])}: {tuple(first.shape)}; "
                        f"{label(j, other)}: {tuple(v.shape)})")
    return None


def _differing_fields(data: Any) -> str | None:
    """The first two samples of ``data`` whose field sets differ, described, or None."""
    if not isinstance(data, list) or not all(isinstance(s, Mapping) for s in data):
        return None
    first = data[0] if data else None
    for other in data[1:]:
        if other.keys() != first.keys():
            return "; ".join(f"{s.get('__key__', '?')!s}: {sorted(k for k in s if not str(k).startswith('__'))}"
                             for s in (first, other))
    return None


def static_reason(ds: Any, *, batch_size: int | None, worker_init_fn: Any) -> str | None:
    """Why ``decode_threads`` cannot serve this loader (None: it can)."""
    if not isinstance(ds, ShardedDataset):
        return f"it needs a fastdata.ShardedDataset, got a {type(ds).__name__}"
    if ds.streaming:
        return "a streaming (URL) source has no random access; use worker processes (decode_threads=0)"
    if batch_size is None:
        return "batch_size=None (no automatic batching) is not supported"
    if worker_init_fn is not None:
        return "worker_init_fn= cannot run: no worker processes are started"
    return None


def thread_batches(ds: ShardedDataset, start: EpochStart, *, threads: int, batch_size: int, drop_last: bool,
                   collate_fn: Callable[[Any], Any], pin: str | None, pin_rows: str | None = None,
                   timeout: float = 0) -> ThreadBatches:
    """The batches of ``start``'s epoch decoded in ``threads`` threads (see the module docstring).

    ``pin``: pin every tensor of a batch (``pin_memory=True``); ``pin_rows``: allocate the batch
    rows samples are written into page-locked (default: as ``pin``)."""
    seam = ds.loader_seam
    if seam.has_cache:
        seam.cache_store()  # opened here once, not raced by the pool's first loads
    seqs = seam.sequences_at(start)
    n = len(seqs)
    # one live cursor per virtual worker: the dataset's reader cache keeps the shards each walk
    # reads open (thread-safe: a reader is never closed under a reading thread);
    # with one worker ds.state_dict() follows, as with num_workers=0 on the worker path
    cursors = [seam.cursor(start, w, seq=seq, live=n == 1) for w, seq in enumerate(seqs)]
    batches = ThreadBatches(cursors, first=start.first, threads=threads, batch_size=batch_size, drop_last=drop_last,
                            collate_fn=collate_fn, pin=pin, pin_rows=pin_rows, carry=_CARRY.setdefault(ds, {}),
                            timeout=timeout, record_skips=seam.record_deferred_skips)
    return batches


# What one epoch leaves to the next of the same dataset: the sample layout (so the first batches
# land in place too) and the buffer rings (their pages are already faulted in).
_CARRY: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


# ----- the pool ---------------------------------------------------------------------------------
_POOLS: weakref.WeakSet[_Pool] = weakref.WeakSet()


def _pause_before_fork() -> None:
    for pool in list(_POOLS):
        pool.pause()


def _resume_after_fork() -> None:
    """In the parent after a fork: paused pools may start their threads again."""
    for pool in list(_POOLS):
        pool.resume()


if hasattr(os, "register_at_fork"):  # pragma: no branch
    os.register_at_fork(before=_pause_before_fork, after_in_parent=_resume_after_fork)


class _Pool:
    """Daemon threads running submitted calls in order of submission; pausable for fork."""

    def __init__(self, threads: int, name: str = "fastdata-decode"):
        self.size = threads
        self.name = name
        self._tasks: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._stopping = False  # threads exit after their current task (pause or close)
        self._paused = False  # between os.fork's before and after hooks: no (re)start, even from another thread
        self._closed = False
        self._pid = os.getpid()
        _POOLS.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("fastdata decode pool is closed")
            self._tasks.append((fut, fn, args))
            self._cv.notify()
        self.ensure_running()
        return fut

    def ensure_running(self) -> None:
        """(Re)start the threads (after a fork pause); only in the process that created the pool."""
        if self._pid != os.getpid():
            raise RuntimeError("a fastdata decode_threads iterator cannot be used in a forked child process; "
                               "iterate the DataLoader in the child instead")
        with self._cv:
            if self._closed or self._paused or (self._threads and all(t.is_alive() for t in self._threads)):
                return
            self._stopping = False
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < self.size:
                t = threading.Thread(target=_run, args=(self._tasks, self._cv, self._should_stop),
                                     name=f"{self.name}-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)

    def _should_stop(self) -> bool:
        return self._stopping

    def _join(self) -> None:
        me = threading.current_thread()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + _JOIN_S  # one wait for all of them: not _JOIN_S per stuck thread
        for t in threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t is not me and t.is_alive()]
        if stuck:
            warnings.warn(f"fastdata decode thread(s) {', '.join(stuck)} did not finish their task within "
                          f"{_JOIN_S:g} s (a transform that blocks?); left running as daemons", RuntimeWarning,
                          stacklevel=3)
        with self._cv:
            self._threads = [t for t in self._threads if t.is_alive()]

    def pause(self) -> None:
        """Join the threads after their current task; queued tasks wait until :meth:`resume`."""
        if self._pid == os.getpid():
            with self._cv:
                self._paused = True
            if self._threads:
                self._join()

    def resume(self) -> None:
        """Allow :meth:`ensure_running` to start the threads again (they start on demand)."""
        with self._cv:
            self._paused = False

    def close(self, join: bool = True) -> None:
        """Cancel queued tasks and join the threads (safe to call twice). ``join=False``: only tell
        them to exit after their current task (after a timeout: the consumer must not wait for them)."""
        with self._cv:
            self._closed = True
            tasks, self._tasks = list(self._tasks), deque()
            if not join:
                self._stopping = True
                self._cv.notify_all()
        for fut, _, _ in tasks:
            fut.cancel()
        if join and self._pid == os.getpid():
            self._join()

    @property
    def alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)


def _run(tasks: deque[Any], cv: threading.Condition, should_stop: Callable[[], bool]) -> None:
    """Thread body: holds only the queue, so a dropped iterator lets its pool be collected."""
    # One intra-op thread for torch ops in transforms, as in a DataLoader worker process (the
    # setting is per thread: the caller's own torch ops keep theirs); otherwise every pool thread
    # entering a parallel region would open its own OpenMP team over all cores.
    torch.set_num_threads(1)
    while True:
        with cv:
            while not tasks and not should_stop():
                cv.wait()
            if should_stop():
                return
            fut, fn, args = tasks.popleft()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            fut.set_exception(e)
        del fut, fn, args


def _shut(pool: _Pool, buffers: _Buffers, walks: list[_Walk], join: bool) -> None:
    """Close an iterator's pool and give the buffers of its batches in flight back to the ring (held
    only by the iterator and its finalizer: never references the iterator itself)."""
    pool.close(join)
    running = pool.alive > 0  # timed out, or stuck past _JOIN_S: a thread may still write into its rows
    for walk in walks:
        if not running:
            for bufs, _ in walk.buffers.values():
                buffers.release(bufs)
        walk.buffers.clear()  # with a thread running: left busy in the ring, never handed out again
        walk.pending.clear()
        walk.results.clear()


# ----- batch memory -----------------------------------------------------------------------------
Spec = dict[Any, tuple[tuple[int, ...], torch.dtype]]  # field (dict key or tuple index) -> (shape, dtype)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_users(t: torch.Tensor) -> int:
    """References to ``t``'s storage (-1 where this torch cannot tell: then nothing is reused)."""
    if _USE_COUNT is None:
        return -1
    return _USE_COUNT(t.untyped_storage()._cdata)


class _Buffers:
    """Batch buffers per field: a ring of provably free CPU buffers, or fresh pinned ones."""

    def __init__(self, pin: str | None, in_flight: int):
        self.pin = pin
        self.cap = in_flight + RING_SPARE
        # two iterators of one dataset may share the ring; reentrant: an iterator's finalizer gives its
        # buffers back from whatever code the garbage collector interrupts, take() included
        self._lock = threading.RLock()
        self._ring: dict[tuple[Any, tuple[int, ...], torch.dtype], list[tuple[torch.Tensor, int]]] = {}
        self._busy: set[int] = set()  # id() of ring tensors assigned to batches in flight
        self.allocated = 0  # tensors allocated (ring and fresh), for tests and stats

    def take(self, spec: Spec, rows: int) -> dict[Any, torch.Tensor]:
        with self._lock:
            return {name: self._one(name, (rows, *shape), dtype) for name, (shape, dtype) in spec.items()}

    def _one(self, name: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pin is not None:
            self.allocated += 1
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        ring = self._ring.setdefault((name, shape, dtype), [])
        # a batch sent through a torch.multiprocessing queue moved its storage (the ring's buffer) into
        # shared memory that the receiving process maps: never write there again
        ring[:] = [(t, base) for t, base in ring if id(t) in self._busy or not t.is_shared()]
        for t, base in ring:
            if base >= 0 and id(t) not in self._busy and _storage_users(t) == base:
                self._busy.add(id(t))
                return t
        t = torch.empty(shape, dtype=dtype)
        self.allocated += 1
        if len(ring) < self.cap:
            ring.append((t, _storage_users(t)))
            self._busy.add(id(t))
        return t

    def release(self, bufs: dict[Any, torch.Tensor]) -> None:
        """The batch left our hands (handed over as views, or discarded)."""
        with self._lock:
            for t in bufs.values():
                self._busy.discard(id(t))


def _copyable(v: Any) -> bool:
    """A tensor a row copy (``Tensor.numpy()``, or torch's for bfloat16) writes as ``default_collate`` would
    stack it: a plain strided CPU tensor (not conjugate/negative views, quantized or sparse: collated by torch)."""
    return (isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.layout == torch.strided
            and not v.requires_grad and not v.is_quantized and not v.is_conj() and not v.is_neg())


class _Layout:
    """The fields of a sample written in place: top-level tensors (big enough) of a plain dict,
    tuple or list (``default_collate`` turns a tuple sample into a list batch)."""

    __slots__ = ("fields", "kind", "length")

    def __init__(self, kind: type, length: int, fields: Spec):
        self.kind, self.length, self.fields = kind, length, fields

    @classmethod
    def of(cls, sample: Any) -> _Layout | None:
        kind = type(sample)
        if kind is dict:
            items = sample.items()
        elif kind is tuple or kind is list:
            items = enumerate(sample)
        else:
            return None
        fields = {k: (tuple(v.shape), v.dtype) for k, v in items
                  if _copyable(v) and v.numel() * v.element_size() >= MIN_INPLACE_BYTES}
        return cls(kind, len(sample), fields) if fields else None

    def fits(self, sample: Any, bufs: dict[Any, torch.Tensor]) -> bool:
        if type(sample) is not self.kind or (self.kind is not dict and len(sample) != self.length):
            return False
        for key, buf in bufs.items():
            v = sample.get(key) if self.kind is dict else sample[key]
            if not _copyable(v) or v.shape != buf.shape[1:] or v.dtype != buf.dtype:
                return False
        return True

    def collate(self, samples: list[Any], bufs: dict[Any, torch.Tensor], pinned: Callable[[Any], Any]) -> Any:
        """``default_collate(samples)`` with the in-place fields taken from ``bufs``."""
        n = len(samples)
        if self.kind is dict:
            return {k: bufs[k][:n] if k in bufs else pinned(default_collate([s[k] for s in samples]))
                    for k in samples[0]}
        # default_collate transposes sequences with zip(): each field's values arrive as a tuple
        return [bufs[i][:n] if i in bufs else pinned(default_collate(tuple(s[i] for s in samples)))
                for i in range(self.length)]


Rows = tuple[dict[Any, torch.Tensor], dict[Any, "np.ndarray | None"]]  # a batch's buffers and NumPy views


def _rows(bufs: dict[Any, torch.Tensor]) -> Rows:
    """The buffers with their NumPy views, made once per batch (None for dtypes NumPy lacks)."""
    arrays: dict[Any, np.ndarray | None] = {}
    for key, t in bufs.items():
        try:
            arrays[key] = t.numpy()
        except TypeError:  # bfloat16
            arrays[key] = None
    return bufs, arrays


def _write(sample: Any, layout: _Layout, rows: Rows, row: int) -> bool:
    """Copy the sample's in-place fields into ``row``; False when the sample does not fit the layout."""
    bufs, arrays = rows
    if not layout.fits(sample, bufs):
        return False
    for key, arr in arrays.items():
        v = sample[key]
        if arr is not None:  # NumPy copies without the GIL and without torch's intra-op threads
            np.copyto(arr[row], v.numpy())
        else:
            bufs[key][row].copy_(v)
    return True


# ----- the iterator ------------------------------------------------------------------------------
class _Item:
    """One sample's outcome: the sample (None: skipped, with its skip record), where it was written, or the error."""

    __slots__ = ("error", "g", "pos", "sample", "skip", "written")

    def __init__(self, pos: int, g: int, sample: Any = None, written: int = -1, error: BaseException | None = None,
                 skip: dict[str, Any] | None = None):
        self.pos, self.g, self.sample, self.written, self.error, self.skip = pos, g, sample, written, error, skip


Dest = tuple[_Layout, Rows, int, int]  # (layout, batch buffers, row, predicted ordinal)


def _load_chunk(cursor: Any, items: list[tuple[int, int, int, int]], dests: list[Dest | None]) -> list[_Item]:
    """Pool task: load samples (pos, g, shard, i) of one virtual worker, writing each in place when
    told where. Stops at the first exception (the consumer raises it there)."""
    out: list[_Item] = []
    for (pos, g, shard, i), dest in zip(items, dests):
        try:
            try:
                sample = cursor.load(shard, i, g)
            except StopIteration as stop:  # re-raised in __next__ it would end the epoch silently; in a worker
                # the dataset's generator turns it into this RuntimeError (PEP 479)
                raise RuntimeError("generator raised StopIteration (while loading a sample)") from stop
            if sample is None:  # skipped: the consumer records it when it reaches this sample
                out.append(_Item(pos, g, skip=cursor.pop_skip(g)))
                continue
            written = -1
            if dest is not None and _write(sample, dest[0], dest[1], dest[2]):
                written = dest[3]
            out.append(_Item(pos, g, sample, written))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer at this sample
            add_note(e, f"(in thread {threading.current_thread().name} of fastdata.DataLoader(decode_threads=...), "
                     f"virtual worker {cursor.worker}, sample {g}, position {pos} of its sequence)")
            out.append(_Item(pos, g, error=e))
            break
    return out


class _Walk:
    """The consumer-side state of one virtual worker."""

    def __init__(self, cursor: Any, seq: np.ndarray):
        self.cursor = cursor
        self.seq = seq
        self.dispatched = int(cursor.pos)  # next position to dispatch
        self.pending: deque[tuple[Future[list[_Item]], int]] = deque()  # (chunk, its sample count)
        self.results: deque[_Item] = deque()  # outcomes of the chunk being consumed
        self.in_flight = 0  # samples dispatched and not consumed
        self.taken = 0  # samples consumed into batches (true ordinal of the next one)
        self.predicted = 0  # predicted ordinal of the next dispatched sample
        self.buffers: dict[int, Rows] = {}  # batch ordinal -> its buffers

    @property
    def left(self) -> int:
        return len(self.seq) - self.dispatched


class ThreadBatches:
    """The batches of one epoch, decoded in a thread pool, in the worker path's order.

    Iterates :class:`FastBatch` (batch, virtual worker, position after the batch). ``cursors`` are the
    virtual workers' dataset cursors (their ``seq`` and ``pos``); ``first`` yields first.
    """

    def __init__(self, cursors: Sequence[Any], *, first: int, threads: int, batch_size: int, drop_last: bool,
                 collate_fn: Callable[[Any], Any], pin: str | None, pin_rows: str | None = None,
                 carry: dict[Any, Any] | None = None, timeout: float = 0,
                 record_skips: Callable[[list[dict[str, Any]]], None] | None = None):
        self._walks = [_Walk(c, c.seq) for c in cursors]
        for c in cursors:  # loaded ahead: skips are recorded (and counted) in batch order, as from workers
            c.defer_skips = True
        self._record_skips = record_skips
        self._n = len(cursors)
        self._b = batch_size
        self._deal = BatchSchedule(self._n, batch_size, drop_last).deal(first)
        self._collate = collate_fn
        self._inplace = collate_fn is default_collate
        self._pin = pin
        self._threads = threads
        self._chunk = max(1, min(8, batch_size // (4 * threads)))
        self._carry = {} if carry is None else carry
        self._layout: _Layout | None = self._carry.get("layout") if self._inplace else None
        pin_rows = pin_rows or pin
        self._buffers = self._carry.setdefault(("buffers", pin_rows), _Buffers(pin_rows, LOOKAHEAD + 1))
        self._batches = 0
        self._in_place = self._copied = 0
        self._timeout = timeout  # DataLoader(timeout=): seconds one wait for the pool may take (0: none)
        self._pool: _Pool | None = _Pool(threads)
        # also when the iterator is dropped without close() (an early break): the buffers of the batches in
        # flight go back to the dataset's ring, which later epochs reuse
        self._finalizer = weakref.finalize(self, _shut, self._pool, self._buffers, self._walks, True)
        self._timed_out = False  # a wait ran past timeout=: close() leaves the threads to end on their own
        # the loader's positions per virtual worker, set with num_workers > 0: a walk that yields no more
        # batches after skipping samples (all its last ones, or a partial batch drop_last drops) moves its
        # position to its end here, as a worker process's report-only result does on the worker path
        self.positions: list[int] | None = None

    # -- public
    def __iter__(self) -> ThreadBatches:
        return self

    def __next__(self) -> FastBatch:
        if self._pool is None:
            raise StopIteration
        try:
            while (w := self._deal.next()) is not None:
                self._dispatch(w)
                rows, pos, skipped = self._take(self._walks[w])
                turn = self._deal.settle(w, len(rows), skipped)
                if turn is Turn.BATCH:
                    batch = self._assemble(self._walks[w], rows)
                    self._batches += 1
                    return FastBatch(batch, w, pos)
                if turn is Turn.END and self.positions is not None:  # as a worker process reports its end
                    self.positions[w] = pos
                self._discard(self._walks[w])
        except BaseException:
            self.close()
            raise
        self.close()
        raise StopIteration

    def close(self) -> None:
        """Stop and join the pool's threads (safe to call twice; also on garbage collection)."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            if self._timed_out:  # raise the timeout now, as the worker path does, not after a join
                self._finalizer.detach()
                _shut(pool, self._buffers, self._walks, False)
            else:
                self._finalizer()

    @property
    def threads_alive(self) -> int:
        return 0 if self._pool is None else self._pool.alive

    def pool_threads(self) -> list[threading.Thread]:
        """The pool's threads (for the stall watchdog's stacks)."""
        return [] if self._pool is None else list(self._pool._threads)

    @property
    def stats(self) -> dict[str, int]:
        """``batches`` yielded; samples ``in_place`` (written by a pool thread into their row) and
        ``copied`` (by the consumer); batch buffers ``allocated``."""
        return {"batches": self._batches, "in_place": self._in_place, "copied": self._copied,
                "allocated": self._buffers.allocated}

    # -- dispatch
    def _dispatch(self, w: int) -> None:
        """Keep about LOOKAHEAD + 1 predicted batches in flight, from batch of worker ``w`` on."""
        budget = (LOOKAHEAD + 1) * self._b - sum(walk.in_flight for walk in self._walks)
        have = [walk.in_flight for walk in self._walks]
        active = list(self._deal.active)
        for _ in range((LOOKAHEAD + 1) * self._n):
            if budget <= 0 or not any(active):
                return
            if active[w]:
                walk = self._walks[w]
                need = self._b - min(self._b, have[w])
                have[w] = max(0, have[w] - self._b)
                d = min(need, walk.left, budget)
                if d > 0:
                    self._submit(walk, d)
                    budget -= d
                if need > d and walk.left == 0:
                    active[w] = False  # predicted to end with this batch
                elif need > d:
                    return  # out of budget
            w = (w + 1) % self._n

    def _submit(self, walk: _Walk, count: int) -> None:
        pool = self._pool
        if pool is None:
            raise RuntimeError("fastdata.DataLoader(decode_threads=...) iterator is closed")
        if walk.in_flight == 0:
            walk.predicted = walk.taken  # re-base: nothing in flight can collide
        lo = walk.dispatched
        shards, local = walk.cursor.locate(lo, lo + count)
        gs = walk.seq[lo : lo + count].tolist()
        items = list(zip(range(lo, lo + count), gs, shards.tolist(), local.tolist()))
        for k in range(0, count, self._chunk):
            part = items[k : k + self._chunk]
            dests = [self._dest(walk, walk.predicted + j) for j in range(len(part))]
            walk.predicted += len(part)
            walk.pending.append((pool.submit(_load_chunk, walk.cursor, part, dests), len(part)))
        walk.dispatched += count
        walk.in_flight += count

    def _dest(self, walk: _Walk, ordinal: int) -> Dest | None:
        if self._layout is None or not self._inplace:
            return None
        b = ordinal // self._b
        rows = walk.buffers.get(b)
        if rows is None:
            rows = walk.buffers[b] = _rows(self._buffers.take(self._layout.fields, self._b))
        return self._layout, rows, ordinal % self._b, ordinal

    # -- consumption
    def _next_item(self, walk: _Walk) -> _Item | None:
        """The next sample outcome of ``walk`` in sequence order (None: its sequence is done)."""
        while not walk.results:
            if not walk.pending:
                if walk.left == 0:
                    return None
                self._submit(walk, min(walk.left, self._b))  # a skip left the prediction short
            fut, _ = walk.pending.popleft()
            walk.results.extend(self._wait(fut))
            if not walk.results:  # pragma: no cover - a chunk always yields or raises
                raise RuntimeError("fastdata decode thread returned no result")
        walk.in_flight -= 1
        return walk.results.popleft()

    def _wait(self, fut: Future[list[_Item]]) -> list[_Item]:
        pool = self._pool
        if pool is None:
            raise RuntimeError("fastdata.DataLoader(decode_threads=...) iterator is closed")
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            pool.ensure_running()  # after a fork pause
            try:
                return fut.result(timeout=_POLL_S)
            except TimeoutError:
                if deadline is not None and time.monotonic() > deadline:
                    self._timed_out = True
                    raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds (a decode_threads "
                                       "thread spent that long on one chunk of samples)") from None

    def _take(self, walk: _Walk) -> tuple[list[Any], int, bool]:
        """The next ``batch_size`` samples of ``walk`` that load (fewer at its end), the position after,
        and whether samples were skipped on the way."""
        rows: list[Any] = []
        skips: list[dict[str, Any]] = []
        pos = int(walk.cursor.pos)
        while len(rows) < self._b:
            item = self._next_item(walk)
            if item is None:
                pos = len(walk.seq)
                break
            pos = item.pos + 1
            if item.error is not None:
                add_note(item.error, f"(fastdata.DataLoader batch {self._batches}, virtual worker {walk.cursor.worker})")
                raise item.error
            if item.sample is None:  # skipped under on_error
                if item.skip is not None:
                    skips.append(item.skip)
                continue
            if self._layout is None and self._inplace:
                self._layout = self._carry["layout"] = _Layout.of(item.sample)
                if self._layout is None:
                    self._inplace = False
            rows.append((item.sample, item.written == walk.taken))
            walk.taken += 1
        walk.cursor.pos = pos
        if skips and self._record_skips is not None:
            self._record_skips(skips)  # dataset.skipped; SkipBudgetError past max_skips, at this batch
        return rows, pos, bool(skips)

    def _assemble(self, walk: _Walk, rows: list[tuple[Any, bool]]) -> Any:
        b = (walk.taken - len(rows)) // self._b  # batches start at multiples of batch_size
        samples = [s for s, _ in rows]
        buffers = walk.buffers.pop(b, None)
        layout = self._layout
        if not self._inplace or layout is None:
            if buffers is not None:
                self._buffers.release(buffers[0])
            return self._pinned(collate(self._collate, samples))
        if buffers is None:
            buffers = _rows(self._buffers.take(layout.fields, self._b))
        try:
            for j, (s, in_place) in enumerate(rows):
                if not in_place and not _write(s, layout, buffers, j):
                    batch = collate(default_collate, samples)  # the error for samples that do not match
                    # they matched each other: the layout (e.g. carried from an epoch with another
                    # transform) is stale; the next dispatches use theirs
                    self._layout = self._carry["layout"] = _Layout.of(samples[0])
                    self._inplace = self._layout is not None
                    return self._pinned(batch)
            copied = sum(not in_place for _, in_place in rows)
            self._copied += copied
            self._in_place += len(rows) - copied
            return layout.collate(samples, buffers[0], self._pinned)
        finally:
            self._buffers.release(buffers[0])

    def _pinned(self, value: Any) -> Any:
        return _pin_memory(value, self._pin) if self._pin is not None else value

    def _discard(self, walk: _Walk) -> None:
        for bufs, _ in walk.buffers.values():
            self._buffers.release(bufs)
        walk.buffers.clear()

