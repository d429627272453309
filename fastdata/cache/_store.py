"""One cache store: fixed-shape per-sample arrays in preallocated, memory-mapped files.

Layout of a store directory (``<cache dir>/<key>/``)::

    meta.json       {"cache_format", "key", "fingerprint", "num_samples", "fields": null | [...]}
                    written atomically (temporary file + os.replace); "fields" is null until the
                    first put defines the layout: [{"name", "dtype", "shape", "file"}, ...]
    field-000.bin   one file per field: num_samples x sample_nbytes, preallocated, row i = sample i
    valid.bin       num_samples bytes; byte i is 1 once sample i is completely written
    open.lock       flock: shared while any process has the store open; eviction needs exclusive
    layout.lock     flock: exclusive while the first put creates the field files
    last_used       empty file; its mtime is the store's last use (for LRU eviction)

Crash safety. ``put`` writes a sample's rows with ``pwrite`` and only after every byte of every
field has been handed to the kernel does it ``pwrite`` the sample's valid byte. Data written with
``pwrite`` lives in the page cache, which survives the death of the writing process, so a fill
killed at any point (``kill -9`` included) leaves each sample either complete and flagged or
unflagged (recomputed on the next miss); readers serve only flagged samples. This argument holds
for process crashes, not power loss: the kernel may write the valid page back to disk before the
data pages. With ``fsync=True`` each put ``fdatasync``s the field files before setting the flag, so
a flag that reached the disk implies its data did too (a lost flag only costs a recomputation);
this costs a disk flush per sample (use it for fills that must survive power loss, not by default).
"""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import operator
import os
import shutil
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fastdata.cache._io import DISK_FULL, preallocate, pwrite_all, write_json_atomic
from fastdata.errors import CacheError



class StoreOwner(Protocol):
    """What a store needs from the :class:`~fastdata.cache.Cache` that opened it."""

    directory: Path
    fsync: bool

    def make_room(self, nbytes: int, *, keep: str) -> None:
        """Evict other stores so that ``nbytes`` more fit under the cache's byte limit."""

CACHE_FORMAT_VERSION = 1
META_NAME = "meta.json"
VALID_NAME = "valid.bin"
OPEN_LOCK = "open.lock"
LAYOUT_LOCK = "layout.lock"
LAST_USED = "last_used"
REFUSED = "refused"  # meta.json key: why the first put could not allocate the store (it holds nothing)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ_ONLY_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_readonly_warning_silenced = False
_live_stores: weakref.WeakSet[Store] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A lock held by another thread of the parent at fork time would stay held forever in the child.
    for store in list(_live_stores):
        store._mutex = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class FieldLayout:
    """Shape and dtype of one cached field; every sample of a store has the same."""

    name: str
    dtype: str  # numpy dtype string, e.g. "|u1", "<f4"
    shape: tuple[int, ...]
    file: str

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "file": self.file}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FieldLayout:
        return cls(str(d["name"]), str(d["dtype"]), tuple(int(s) for s in d["shape"]), str(d["file"]))


def read_meta(path: Path) -> dict[str, Any]:
    """The ``meta.json`` of the store directory ``path``; CacheError naming the file if unreadable."""
    file = path / META_NAME
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CacheError(f"cache store {path}: cannot read {META_NAME}: {e}") from e
    if not isinstance(meta, dict):
        raise CacheError(f"cache store {path}: {META_NAME} is not a JSON object")
    return meta


def parse_fields(path: Path, meta: Mapping[str, Any]) -> list[FieldLayout] | None:
    raw = meta.get("fields")
    if raw is None:
        return None
    try:
        fields = [FieldLayout.from_json(d) for d in raw]
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"cache store {path}: {META_NAME} has a malformed 'fields' entry: {e}") from e
    problem = _layout_problem(fields)
    if problem is not None:
        raise CacheError(f"cache store {path}: {META_NAME} has a malformed 'fields' entry: {problem} "
                         "(a corrupt store; remove it with `fastdata cache rm`)")
    return fields


def _layout_problem(fields: list[FieldLayout]) -> str | None:
    """What is wrong with a layout read from meta.json (None: it is one ``_create_layout`` writes)."""
    if not fields:
        return "no fields"
    if len({f.name for f in fields}) != len(fields):
        return f"a field is listed twice ({[f.name for f in fields]})"
    for k, f in enumerate(fields):
        if f.file != f"field-{k:03d}.bin":  # never a path outside the store
            return f"field {f.name!r} has file {f.file!r}, expected 'field-{k:03d}.bin'"
        try:
            dtype = np.dtype(f.dtype)
        except TypeError as e:
            return f"field {f.name!r} has dtype {f.dtype!r}: {e}"
        if dtype.kind not in "biufc":
            return f"field {f.name!r} has dtype {f.dtype!r}, not a numeric or bool dtype"
        if any(s < 0 for s in f.shape) or f.nbytes < 1:
            return f"field {f.name!r} has shape {list(f.shape)} ({f.nbytes} bytes per sample)"
    return None


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
        lock_path = self.path / OPEN_LOCK
        for _ in range(1000):
            try:
                fd = os.open(lock_path, os.O_RDONLY | _O_CLOEXEC)
            except FileNotFoundError:
                self._create_dir()
                if self.path.is_dir() and not lock_path.exists():
                    raise CacheError(f"cache store {self.path}: no {OPEN_LOCK} (not made by fastdata, or damaged); "
                                     "remove it with `fastdata cache rm`") from None
                continue
            except OSError as e:  # e.g. a store of another user
                raise CacheError(f"cache store {self.path}: cannot open {OPEN_LOCK}: {e}") from e
            # An evictor holds the exclusive lock only while it renames the store away.
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError as e:  # a file system without flock (some FUSE mounts)
                os.close(fd)
                raise CacheError(f"cache store {self.path}: cannot lock {OPEN_LOCK}: {e} (the cache needs a "
                                 "local file system with flock)") from e
            try:
                st = os.stat(lock_path)
                same = (st.st_ino, st.st_dev) == (os.fstat(fd).st_ino, os.fstat(fd).st_dev)
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the store was evicted while we waited: create it anew
        raise CacheError(f"cache store {self.path}: could not open it (it keeps being removed)")

    def _create_dir(self) -> None:
        """Create the store directory complete (locks, meta.json) and rename it into place, so no
        process ever sees a half-made store; when several race, the first rename wins."""
        root = self.cache.directory
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cache directory {root}: cannot create it: {e}") from e
        tmp = root / f".tmp-{self.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            for name in (OPEN_LOCK, LAYOUT_LOCK, LAST_USED):
                (tmp / name).touch()
            meta = {"cache_format": CACHE_FORMAT_VERSION, "key": self.key, "fingerprint": self.fingerprint,
                    "num_samples": self.num_samples, "fields": None, "created": time.time()}
            write_json_atomic(tmp / META_NAME, meta, fsync=self.cache.fsync)
            try:
                os.rename(tmp, self.path)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        except OSError as e:
            raise CacheError(f"cache store {self.path}: cannot create it: {e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

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
            return os.open(self.path / name, os.O_RDWR | _O_CLOEXEC)
        except OSError as e:
            if e.errno not in _READ_ONLY_ERRNOS:
                raise
            self._read_only = True
            return os.open(self.path / name, os.O_RDONLY | _O_CLOEXEC)

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
            lock_fd = os.open(self.path / LAYOUT_LOCK, os.O_RDONLY | _O_CLOEXEC)
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
                self._allocate(fields)
            except CacheError as e:
                self._layout_error = e
                self._mark_refused(e)
                raise
            meta = dict(read_meta(self.path))
            meta.pop(REFUSED, None)
            meta["fields"] = [f.to_json() for f in fields]
            meta["sample_nbytes"] = sum(f.nbytes for f in fields)
            try:
                write_json_atomic(self.path / META_NAME, meta)
            except OSError as e:
                self._release(fields)
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

    def _mark_refused(self, error: CacheError) -> None:
        """Record in meta.json why the layout could not be allocated: ``Cache.list`` removes such an empty
        store once no process has it open (best effort: the disk may be full)."""
        try:
            meta = dict(read_meta(self.path))
            meta[REFUSED] = str(error)
            write_json_atomic(self.path / META_NAME, meta, fsync=False)
        except (OSError, CacheError):
            pass

    def _allocate(self, fields: list[FieldLayout]) -> None:
        n = self.num_samples
        need = sum(n * f.nbytes for f in fields) + n
        self.cache.make_room(need, keep=self.key)
        files = [(f.file, n * f.nbytes) for f in fields] + [(VALID_NAME, n)]
        for name, nbytes in files:
            path = self.path / name
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o644)
                try:
                    preallocate(fd, nbytes)
                    if self.cache.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                self._release(fields)  # give the space back
                if e.errno in DISK_FULL:
                    raise CacheError(f"cache store {self.path}: disk full: cannot reserve {need} bytes "
                                     f"({n} samples x {need // n} bytes) for {name}: {e.strerror}") from e
                raise CacheError(f"cache store {self.path}: cannot create {name}: {e}") from e

    def _release(self, fields: list[FieldLayout]) -> None:
        """Delete the files ``_allocate`` made for ``fields`` (a layout that was not written)."""
        for name in [f.file for f in fields] + [VALID_NAME]:
            (self.path / name).unlink(missing_ok=True)
