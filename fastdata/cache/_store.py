"""One cache store: fixed-shape per-sample arrays in preallocated, memory-mapped files.

Invariants: a sample is served only once its valid byte is set, and ``put`` sets it only after every
byte of every field was handed to the kernel (with ``fsync=True``, after ``fdatasync``), so a fill
killed at any point leaves each sample complete and flagged or unflagged (recomputed on the next
miss). The first put defines the layout (``_layout``); later puts must match it. A store is
picklable and reopens its files lazily in each process (after fork too). What the folder holds is
``_layout``'s docstring; how it is created and reserved, ``_files``'. Design note (the crash-safety
argument and its limits): ``docs/design/cache-store.md``.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import operator
import os
import threading
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdata._runtime import at_fork
from fastdata.cache._files import (
    O_CLOEXEC,
    acquire_open_lock,
    allocate_files,
    create_store_dir,
    mark_refused,
    release_files,
)
from fastdata.cache._io import DISK_FULL, pwrite_all, write_json_atomic
from fastdata.cache._layout import (
    CACHE_FORMAT_VERSION,
    LAST_USED,
    LAYOUT_LOCK,
    META_NAME,
    REFUSED,
    VALID_NAME,
    FieldLayout,
    StoreOwner,
    parse_fields,
    read_meta,
)
from fastdata.errors import CacheError

__all__ = ["Store"]

_READ_ONLY_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})

_readonly_warning_silenced = False
_live_stores: weakref.WeakSet[Store] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A lock held by another thread of the parent at fork time would stay held forever in the child.
    for store in list(_live_stores):
        store._mutex = threading.RLock()


at_fork(__name__, "fresh store locks in the child (a parent thread may hold one)", after_in_child=_after_fork_in_child)


def _readonly_tensor(arr: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over a read-only memory map. torch warns once per process that it cannot
    mark tensors read-only; the cache documents that instead, so that first warning is silenced."""
    global _readonly_warning_silenced
    if not _readonly_warning_silenced:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        _readonly_warning_silenced = True
        return t
    return torch.from_numpy(arr)


def _as_array(field: str, value: Any, index: int, path: Path) -> np.ndarray:
    """A C-contiguous, native-endian numpy array for ``value`` (numpy array, tensor or scalar)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        try:
            return value.contiguous().numpy()
        except TypeError as e:
            raise CacheError(
                f"cache store {path}: field {field!r} of sample {index} has dtype {value.dtype}, "
                "which has no numpy equivalent"
            ) from e
    arr = np.asarray(value)
    if arr.dtype.kind not in "biufc":
        raise CacheError(
            f"cache store {path}: field {field!r} of sample {index} has dtype {arr.dtype}; "
            "only numeric and bool arrays can be cached"
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)


class Store:
    """Per-sample fixed-shape arrays of one (dataset, deterministic transform) pair, memory-mapped.

    Obtain one from :meth:`fastdata.cache.Cache.open_store`. Safe to use from several threads and
    processes at once; picklable (it reopens its files lazily in each process, so it can go into
    DataLoader workers). While a process has the store open it holds a shared lock that keeps
    eviction away.
    """

    def __init__(self, cache: StoreOwner, key: str, *, fingerprint: str, num_samples: int) -> None:
        self.cache = cache
        self.key = key
        self.path = cache.directory / key
        self.fingerprint = fingerprint
        self.num_samples = num_samples
        self._mutex = threading.RLock()
        self._reset()
        _live_stores.add(self)

    # ----- per-process state ---------------------------------------------------------------
    def _reset(self) -> None:
        self._pid: int | None = None
        self._lock_fd: int | None = None
        self._fields: list[FieldLayout] | None = None
        self._fds: dict[str, int] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._valid: np.ndarray | None = None
        self._valid_fd: int | None = None
        self._meta_stat: tuple[int, int] | None = None
        self._layout_error: CacheError | None = None
        self._read_only = False

    def __getstate__(self) -> dict[str, Any]:
        return {"cache": self.cache, "key": self.key, "fingerprint": self.fingerprint,
                "num_samples": self.num_samples}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cache"], state["key"], fingerprint=state["fingerprint"],  # type: ignore[misc]
                      num_samples=state["num_samples"])

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, fingerprint={self.fingerprint!r}, num_samples={self.num_samples})"

    def _ensure_open(self) -> None:
        pid = os.getpid()
        if self._pid == pid:
            return
        with self._mutex:
            if self._pid == pid:
                return
            # After fork: the parent's descriptors and maps are dropped, not closed (they are the
            # parent's); this process takes its own shared lock and maps.
            self._reset()
            self._lock_fd = self._acquire_open_lock()
            try:
                self._touch()
                self._check_meta(read_meta(self.path))
                self._pid = pid
                self._refresh_layout()
            except BaseException:
                fds = [*self._fds.values(), self._valid_fd, self._lock_fd]
                self._reset()
                for fd in fds:
                    if fd is not None:
                        os.close(fd)
                raise

    def _acquire_open_lock(self) -> int:
        return acquire_open_lock(self.path, self._create_dir)

    def _create_dir(self) -> None:
        meta = {"cache_format": CACHE_FORMAT_VERSION, "key": self.key, "fingerprint": self.fingerprint,
                "num_samples": self.num_samples, "fields": None}
        create_store_dir(self.path, meta, fsync=self.cache.fsync)

    def _touch(self) -> None:
        try:
            os.utime(self.path / LAST_USED)
        except OSError:  # read-only cache directory: LRU order just does not advance
            pass

    def _check_meta(self, meta: Mapping[str, Any]) -> None:
        expect = {"cache_format": CACHE_FORMAT_VERSION, "key": self.key, "fingerprint": self.fingerprint,
                  "num_samples": self.num_samples}
        for name, value in expect.items():
            if meta.get(name) != value:
                raise CacheError(
                    f"cache store {self.path}: {META_NAME} has {name}={meta.get(name)!r}, expected {value!r} "
                    "(a foreign or corrupt store; remove it with `fastdata cache rm`)"
                )

    def _refresh_layout(self) -> bool:
        """Map the field files if another process defined the layout since we last looked.

        ``self._valid`` is set last, so a thread that sees it set sees a complete mapping.
        """
        if self._valid is not None:
            return True
        with self._mutex:
            if self._valid is not None:
                return True
            try:
                st = os.stat(self.path / META_NAME)
            except FileNotFoundError as e:
                raise CacheError(f"cache store {self.path}: {META_NAME} disappeared") from e
            if self._meta_stat == (st.st_ino, st.st_mtime_ns):
                return False
            meta = read_meta(self.path)
            self._meta_stat = (st.st_ino, st.st_mtime_ns)
            fields = parse_fields(self.path, meta)
            if fields is None:
                return False
            self._map(fields)
            return True

    def _open_rw(self, name: str) -> int:
        """Open a store file for pwrite, or read-only (then puts fail) on a read-only cache."""
        try:
            return os.open(self.path / name, os.O_RDWR | O_CLOEXEC)
        except OSError as e:
            if e.errno not in _READ_ONLY_ERRNOS:
                raise
            self._read_only = True
            return os.open(self.path / name, os.O_RDONLY | O_CLOEXEC)

    def _map(self, fields: list[FieldLayout]) -> None:
        n = self.num_samples
        fds: dict[str, int] = {}
        arrays: dict[str, np.ndarray] = {}
        try:
            for f in fields:
                fd = self._open_rw(f.file)
                fds[f.name] = fd
                size = os.fstat(fd).st_size
                if size != n * f.nbytes:
                    raise CacheError(f"cache store {self.path}: {f.file} has {size} bytes, expected {n * f.nbytes} "
                                     f"({n} samples x {f.nbytes} bytes of field {f.name!r})")
                # the array (and every tensor viewing it) keeps the mapping alive; it is unmapped
                # when the last of them is garbage collected, never while in use
                m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                arrays[f.name] = np.frombuffer(m, dtype=f.dtype).reshape(n, *f.shape)
            valid_fd = self._open_rw(VALID_NAME)
            fds["\0valid"] = valid_fd
            vsize = os.fstat(valid_fd).st_size
            if vsize != n:
                raise CacheError(f"cache store {self.path}: {VALID_NAME} has {vsize} bytes, expected {n}")
            valid = np.frombuffer(mmap.mmap(valid_fd, n, access=mmap.ACCESS_READ), dtype=np.uint8)
            if int(valid.max()) > 1:  # puts write 0 and 1 only: anything else is not a valid map
                bad = int(np.flatnonzero(valid > 1)[0])
                raise CacheError(f"cache store {self.path}: {VALID_NAME} holds byte {int(valid[bad])} for sample {bad} "
                                 "(only 0 and 1 are written): a corrupt store; remove it with `fastdata cache rm`")
        except OSError as e:
            for fd in fds.values():
                os.close(fd)
            raise CacheError(f"cache store {self.path}: cannot open its files: {e}") from e
        except CacheError:
            for fd in fds.values():
                os.close(fd)
            raise
        self._valid_fd = fds.pop("\0valid")
        self._fds = fds
        self._arrays = arrays
        self._fields = fields
        self._valid = valid  # last: marks the mapping complete

    # ----- public API ----------------------------------------------------------------------
    @property
    def fields(self) -> list[FieldLayout] | None:
        """The field layout, or None while no sample has been put yet."""
        self._ensure_open()
        return list(self._fields) if self._refresh_layout() and self._fields is not None else None

    def __len__(self) -> int:
        return self.num_samples

    def _index(self, index: int) -> int:
        i = operator.index(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"cache store {self.path}: index {index} out of range for {self.num_samples} samples")
        return i

    def _indices(self, indices: Any) -> np.ndarray:
        arr = np.asarray(indices)
        if arr.size and arr.dtype.kind not in "iu":  # a bool mask or floats would be cast to wrong rows
            raise TypeError(f"cache store {self.path}: indices must be integers, got dtype {arr.dtype}")
        idx = arr.astype(np.int64, copy=False).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.num_samples):
            bad = idx[(idx < 0) | (idx >= self.num_samples)][0]
            raise IndexError(f"cache store {self.path}: index {bad} out of range for {self.num_samples} samples")
        return idx

    def is_valid(self, index: int) -> bool:
        """Whether sample ``index`` is filled (cheap: one byte of a shared memory map)."""
        self._ensure_open()
        i = self._index(index)
        if self._valid is None and not self._refresh_layout():
            return False
        assert self._valid is not None
        return bool(self._valid[i])

    def get(self, index: int) -> dict[str, torch.Tensor] | None:
        """Sample ``index`` as ``{field: tensor}``, or None if it is not filled yet.

        The tensors are zero-copy views of a read-only memory map: never modify them in place
        (that faults); copy first or use out-of-place operations (collation copies anyway).
        """
        self._ensure_open()
        i = self._index(index)
        if self._valid is None and not self._refresh_layout():
            return None
        if not self._valid[i]:  # type: ignore[index]
            return None
        return {name: _readonly_tensor(arr[i, ...]) for name, arr in self._arrays.items()}

    def get_batch(
        self, indices: Any, *, out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Samples ``indices`` gathered into ``{field: (len(indices), *shape) tensor}`` with one copy,
        or None if any of them is not filled. ``out`` (optional) receives the rows, e.g. reused or
        pinned buffers with at least ``len(indices)`` rows.

        This is the fast path for fully cached data: no per-sample tensors, no collation.
        """
        self._ensure_open()
        idx = self._indices(indices)
        if self._valid is None and not self._refresh_layout():
            return None
        if not self._valid[idx].all():  # type: ignore[index]
            return None
        rows = torch.from_numpy(idx)
        result = {}
        for name, arr in self._arrays.items():
            src = _readonly_tensor(arr)
            if out is not None and name in out:
                dst = out[name][: len(idx)]
                if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype or len(dst) != len(idx):
                    raise CacheError(f"cache store {self.path}: out[{name!r}] has shape {tuple(out[name].shape)} "
                                     f"dtype {out[name].dtype}, expected (>= {len(idx)}, *{tuple(src.shape[1:])}) "
                                     f"dtype {src.dtype}")
                # rows land in `dst` (a view of out[name]); index_select runs on torch's threads
                result[name] = torch.index_select(src, 0, rows, out=dst)
            else:
                result[name] = torch.index_select(src, 0, rows)
        return result

    def put(self, index: int, outputs: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Store sample ``index`` (once: an already valid sample is left as it is).

        The first put of a store defines its fields, shapes and dtypes; later puts must match.
        Raises CacheError naming the store on a mismatch or when the disk is full (the samples
        filled so far stay valid and readable).
        """
        self._ensure_open()
        i = self._index(index)
        if not isinstance(outputs, Mapping) or not outputs:
            raise CacheError(f"cache store {self.path}: put({i}) needs a non-empty mapping of field -> array, "
                             f"got {type(outputs).__name__}")
        arrays = {str(k): _as_array(str(k), v, i, self.path) for k, v in outputs.items()}
        if self._valid is None and not self._refresh_layout():
            with self._mutex:
                self._create_layout(arrays, i)
        self._check(arrays, i)
        assert self._valid is not None and self._valid_fd is not None and self._fields is not None
        if self._valid[i]:
            return
        if self._read_only:
            raise CacheError(f"cache store {self.path}: read-only (no write permission); cannot fill sample {i}")
        field = ""
        try:
            for f in self._fields:
                field = f.name
                flat = arrays[f.name].reshape(-1).view(np.uint8)
                pwrite_all(self._fds[f.name], memoryview(flat), i * f.nbytes)
            if self.cache.fsync:
                for fd in self._fds.values():
                    os.fdatasync(fd)
            field = VALID_NAME
            pwrite_all(self._valid_fd, memoryview(b"\x01"), i)
        except OSError as e:
            if e.errno in DISK_FULL:
                raise CacheError(
                    f"cache store {self.path}: disk full while writing sample {i} ({field}): {e.strerror}; "
                    f"the {self.num_valid()} samples already filled stay valid and usable"
                ) from e
            raise CacheError(f"cache store {self.path}: cannot write sample {i} ({field}): {e}") from e

    def field_arrays(self) -> dict[str, np.ndarray] | None:
        """The read-only memory maps ``{field: (num_samples, *shape) array}``, or None before the first
        put. For gathers that must not run on torch's intra-op threads (``fastdata.DataLoader``'s
        cached fast path copies rows with numpy on its own threads). Rows that ``missing()`` reports
        hold no sample: check first."""
        self._ensure_open()
        if self._valid is None and not self._refresh_layout():
            return None
        return dict(self._arrays)

    def missing(self, indices: Any) -> np.ndarray:
        """The entries of ``indices`` that are not filled (int64, in the given order; empty: all filled)."""
        self._ensure_open()
        idx = self._indices(indices)
        if self._valid is None and not self._refresh_layout():
            return idx
        return idx[self._valid[idx] == 0]  # type: ignore[index]

    def num_valid(self) -> int:
        """Number of filled samples."""
        self._ensure_open()
        if self._valid is None and not self._refresh_layout():
            return 0
        return int(np.count_nonzero(self._valid))

    def close(self) -> None:
        """Release this process's files and shared lock (safe to call twice; a later get reopens).

        Tensors returned by :meth:`get` stay valid: each keeps its own reference to the mapping.
        """
        with self._mutex:
            if self._pid != os.getpid():
                self._reset()
                return
            self._touch()
            fds = [*self._fds.values(), self._valid_fd, self._lock_fd]
            self._reset()
            for fd in fds:
                if fd is not None:
                    os.close(fd)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    # ----- layout --------------------------------------------------------------------------
    def _check(self, arrays: Mapping[str, np.ndarray], index: int) -> None:
        assert self._fields is not None
        names = {f.name for f in self._fields}
        if set(arrays) != names:
            missing, extra = sorted(names - set(arrays)), sorted(set(arrays) - names)
            raise CacheError(f"cache store {self.path}: sample {index} has fields {sorted(arrays)}, the store has "
                             f"{sorted(names)} (missing {missing}, unexpected {extra})")
        for f in self._fields:
            a = arrays[f.name]
            if a.shape != f.shape or a.dtype.str != f.dtype:
                raise CacheError(
                    f"cache store {self.path}: field {f.name!r} of sample {index}: expected shape {f.shape} "
                    f"dtype {np.dtype(f.dtype).name}, got shape {a.shape} dtype {a.dtype.name} "
                    "(the deterministic transform must give one fixed shape and dtype per field)"
                )

    def _create_layout(self, arrays: Mapping[str, np.ndarray], index: int) -> None:
        if self._layout_error is not None:  # e.g. the disk is full: fail fast on every later put
            raise self._layout_error
        fields = [FieldLayout(name, arrays[name].dtype.str, tuple(arrays[name].shape), f"field-{k:03d}.bin")
                  for k, name in enumerate(sorted(arrays))]
        for f in fields:
            if f.nbytes == 0:
                raise CacheError(f"cache store {self.path}: field {f.name!r} of sample {index} has no bytes "
                                 f"(shape {f.shape})")
        try:
            lock_fd = os.open(self.path / LAYOUT_LOCK, os.O_RDONLY | O_CLOEXEC)
        except OSError as e:
            raise CacheError(f"cache store {self.path}: cannot open {LAYOUT_LOCK} (damaged; remove it with "
                             f"`fastdata cache rm`): {e}") from e
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            except OSError as e:
                raise CacheError(f"cache store {self.path}: cannot lock {LAYOUT_LOCK}: {e} (the cache needs a "
                                 "local file system with flock)") from e
            self._meta_stat = None
            if self._refresh_layout():  # another process won the race; its layout is the store's
                return
            try:
                allocate_files(self.path, fields, self.num_samples, fsync=self.cache.fsync,
                               make_room=lambda need: self.cache.make_room(need, keep=self.key))
            except CacheError as e:
                self._layout_error = e
                mark_refused(self.path, e)
                raise
            meta = dict(read_meta(self.path))
            meta.pop(REFUSED, None)
            meta["fields"] = [f.to_json() for f in fields]
            meta["sample_nbytes"] = sum(f.nbytes for f in fields)
            try:
                write_json_atomic(self.path / META_NAME, meta)
            except OSError as e:
                release_files(self.path, fields)
                full = e.errno in DISK_FULL
                err = CacheError(f"cache store {self.path}: {'disk full: ' if full else ''}cannot write the layout "
                                 f"into {META_NAME}: {e}")
                if full:
                    self._layout_error = err
                raise err from e
            self._meta_stat = None
            if not self._refresh_layout():  # pragma: no cover - we just wrote it
                raise CacheError(f"cache store {self.path}: layout vanished after it was written")
        finally:
            os.close(lock_fd)
