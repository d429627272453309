"""HDF5 shards (h5py), in a documented layout that plain h5py users can read.

``shard-000000.h5`` with ``n`` samples: root attributes ``fastdata_format = "hdf5"``,
``fastdata_version``, ``num_samples``, ``fastdata_shard`` (its file name, checked against the
manifest on open); a dataset ``__key__`` of ``n`` UTF-8 keys; one dataset per field, named like the
field, with attribute ``kind`` and row ``i`` belonging to sample ``i`` (fixed-shape arrays as
``(n, *shape)`` chunked along axis 0; other arrays, bytes, text and JSON as vlen uint8 rows; ints as
int64, floats as float64). No compression. The full layout, with a plain-h5py reading example:
``docs/design/shard-formats.md``.

:class:`HDF5ShardReader` returns arrays for ``array`` fields, ``int``/``float`` for scalars and
``bytes`` for bytes/text/json fields (the same bytes a tar shard would hold).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastdata._util import npy_lock
from fastdata.errors import ShardError
from fastdata.manifest import KINDS, FieldInfo, ShardInfo, sha256_file
from fastdata.shards._fields import FieldTracker, value_info
from fastdata.shards._keys import check_key, is_meta, npy_bytes

__all__ = ["HDF5_VERSION", "HDF5ShardReader", "write_hdf5_shard"]

HDF5_VERSION = 1
_CHUNK_BYTES = 1 << 20  # ~1 MiB chunks: the HDF5 guidance range; whole chunks are read per block
_BLOCK_BYTES = 16 << 20  # iter_range reads this much of fixed-size fields per block
_MAX_BLOCK_ROWS = 256
_NATIVE_KINDS = "biufc"  # array dtypes stored as HDF5 numbers; others (str, bytes, datetime) as .npy rows


def _h5py() -> Any:
    import h5py

    return h5py


def write_hdf5_shard(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]],
                     fields: Sequence[FieldInfo] | None = None) -> ShardInfo:
    """Write ``samples`` as one HDF5 shard in the documented layout (atomic: temp name, then rename).

    ``fields`` fixes the layout (e.g. the manifest's fields); by default it is inferred from the
    samples. Every sample must have every field.
    """
    h5py = _h5py()
    path = Path(path)
    samples = list(samples)
    keys = [check_key(s.get("__key__")) for s in samples]
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"duplicate key {key!r} in shard {path}")
        seen.add(key)
        if not key.isascii():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"key {key!r} in shard {path} is not valid UTF-8 (from a file name in another "
                                 "encoding?): HDF5 stores keys as UTF-8 strings; tar shards keep such names") from None
    if fields is None:
        tracker = FieldTracker()
        for s in samples:
            tracker.add(s)
        fields = tracker.fields()
    names = {f.name for f in fields}
    for s, key in zip(samples, keys):
        have = {k for k in s if not is_meta(k)}
        if have != names:
            missing, extra = sorted(names - have), sorted(have - names)
            raise ValueError(f"sample {key!r} in shard {path}: HDF5 shards need every field in every sample "
                             f"(missing {missing}, unexpected {extra})")
    tmp = path.with_name(path.name + ".tmp")
    try:
        with h5py.File(tmp, "w", libver="earliest", track_order=False) as f:
            f.attrs["fastdata_format"] = "hdf5"
            f.attrs["fastdata_version"] = HDF5_VERSION
            f.attrs["num_samples"] = len(samples)
            f.attrs["fastdata_shard"] = path.name
            f.create_dataset("__key__", data=np.array(keys, dtype=object),
                             dtype=h5py.string_dtype("utf-8"), track_times=False)
            for info in fields:
                try:
                    _write_field(f, info, [s[info.name] for s in samples], keys)
                except TypeError as e:  # h5py/NumPy on a dtype HDF5 has no type for (str, datetime, structured)
                    if repr(info.name) in str(e):
                        raise
                    raise TypeError(f"field {info.name!r} in shard {path}: HDF5 cannot store {info.kind} values of "
                                    f"dtype {info.dtype} ({e}); tar shards can") from e
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ShardInfo(name=path.name, num_samples=len(samples), bytes=path.stat().st_size,
                     sha256=sha256_file(path), index=None)


def _write_field(f: Any, info: FieldInfo, values: list[Any], keys: list[str]) -> None:
    h5py = _h5py()
    n = len(values)
    for value, key in zip(values, keys):
        kind = value_info(info.name, value, key=key)[0]
        if kind != info.kind and not (info.kind == "float" and kind == "int"):
            raise ValueError(f"field {info.name!r} of sample {key!r} is {kind!r}, expected {info.kind!r}")
        if info.kind == "int":
            check_value(info.name, value, key)
    # a fixed dtype HDF5 has no native type the reader accepts (str, bytes, datetime, void) goes in .npy rows
    fixed = info.kind == "array" and info.dtype is not None and info.shape is not None \
        and np.dtype(info.dtype).kind in _NATIVE_KINDS
    if fixed:
        shape = tuple(info.shape)  # type: ignore[arg-type]
        dtype = np.dtype(info.dtype)
        row = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        rows = max(1, min(n, _CHUNK_BYTES // row))
        ds = f.create_dataset(info.name, shape=(n, *shape), dtype=dtype,  # HDF5 chunks have no 0-length axis
                              chunks=(rows, *shape) if n and all(shape) else None, track_times=False)
        for a in range(0, n, rows):
            block = values[a:a + rows]
            for value, key in zip(block, keys[a:a + rows]):
                if value.shape != shape or value.dtype != dtype:
                    raise ValueError(f"field {info.name!r} of sample {key!r} has shape {value.shape} {value.dtype}, "
                                     f"expected {shape} {dtype}")
            ds[a:a + len(block)] = np.stack(block)
    elif info.kind in ("int", "float"):
        dtype = np.int64 if info.kind == "int" else np.float64
        ds = f.create_dataset(info.name, data=np.array(values, dtype=dtype), chunks=(max(1, n),) if n else None,
                              track_times=False)
    else:
        encoded = [_vlen_bytes(info, v, k) for v, k in zip(values, keys)]
        data = np.empty(n, dtype=object)
        for j, b in enumerate(encoded):
            data[j] = np.frombuffer(b, dtype=np.uint8)
        ds = f.create_dataset(info.name, shape=(n,), dtype=h5py.vlen_dtype(np.uint8),
                              chunks=(max(1, min(n, 1024)),) if n else None, track_times=False)
        if n:
            # write_direct: slice assignment of an object array whose rows all have the same
            # length makes h5py broadcast it as a 2-D array and fail
            ds.write_direct(data)
        if info.kind == "array":
            ds.attrs["encoding"] = "npy"
    ds.attrs["kind"] = info.kind


def check_value(field: str, value: Any, key: str) -> None:
    """What :func:`write_hdf5_shard` would refuse of one value whatever the other samples hold (an
    int beyond int64: ValueError; a dict/list that is not JSON: TypeError), naming field and key."""
    if isinstance(value, (int, np.integer)) and not -(1 << 63) <= int(value) < 1 << 63:
        raise ValueError(f"field {field!r} of sample {key!r} is {value}, beyond int64 (HDF5 stores ints as int64); "
                         "store it as text, or use format='tar'")
    if isinstance(value, (dict, list)):
        _json_bytes(field, value, key)


def _json_bytes(field: str, value: Any, key: str) -> bytes:
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"field {field!r} of sample {key!r} is not JSON-serialisable: {e}") from e


def _vlen_bytes(info: FieldInfo, value: Any, key: str) -> bytes:
    if info.kind == "array":
        return npy_bytes(value, field=info.name, key=key)
    if info.kind == "json":
        return _json_bytes(info.name, value, key)
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class HDF5ShardReader:
    """Random and sequential access to an HDF5 shard in the documented layout.

    The file is opened lazily in each process (a handle is never used across fork) and the layout
    is validated on open (ShardError naming the file and the dataset that is missing or mistyped).
    ``rdcc_nbytes``/``rdcc_nslots`` set h5py's per-dataset chunk cache: the default 4 MiB holds a few
    whole chunks of every field, so per-sample ``read(i)`` in chunk order does not re-read chunks.

    ``expect`` (the manifest's :class:`~fastdata.manifest.ShardInfo`) and ``fields`` (the manifest's
    :class:`~fastdata.manifest.FieldInfo` list) are checked on open, cheaply: byte size, sample
    count, the ``fastdata_shard`` name attribute (a swapped or renamed shard), every manifest
    field present with its kind, fixed array shapes and dtypes equal to the manifest's (arrays
    stored as ``.npy`` bytes are checked as they are read), no field the manifest does not list.
    A mismatch is a :class:`ShardError` naming the shard, field and shapes.
    """

    def __init__(self, path: str | os.PathLike[str], *, rdcc_nbytes: int = 4 << 20, rdcc_nslots: int = 10007,
                 expect: ShardInfo | None = None, fields: Sequence[FieldInfo] | None = None):
        if rdcc_nbytes < 0 or rdcc_nslots < 1:
            raise ValueError(f"rdcc_nbytes must be >= 0 and rdcc_nslots >= 1, got {rdcc_nbytes}, {rdcc_nslots}")
        self.path = os.fspath(path)
        self.rdcc_nbytes = rdcc_nbytes
        self.rdcc_nslots = rdcc_nslots
        self._expect = expect
        self._expect_fields = None if fields is None else tuple(fields)
        self._file: Any = None
        self._pid: int | None = None
        self._keys: tuple[str, ...] | None = None
        self._layout: dict[str, tuple[str, bool]] = {}  # field -> (kind, stored as .npy bytes)
        self._npy_shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}  # .npy fields with a fixed manifest shape

    def _open(self) -> Any:
        if self._file is None or self._pid != os.getpid():
            h5py = _h5py()
            try:
                f = h5py.File(self.path, "r", rdcc_nbytes=self.rdcc_nbytes, rdcc_nslots=self.rdcc_nslots)
            except OSError as e:
                raise ShardError(f"{self.path}: cannot open as HDF5: {e}") from e
            try:
                with _h5_errors(self.path, "reading its layout"):
                    self._keys, self._layout = _validate(f, self.path)
                    self._npy_shapes = self._check_expected(f)
            except BaseException:
                f.close()
                raise
            self._file, self._pid = f, os.getpid()
        return self._file

    def _check_expected(self, f: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Compare the open file with the manifest's ShardInfo and fields; ShardError naming the mismatch."""
        replaced = "the shard was replaced or changed after the manifest was written (run verify)"
        expect, keys = self._expect, self._keys or ()
        if expect is not None:
            size = os.path.getsize(self.path)
            if size != expect.bytes:
                raise ShardError(f"{self.path}: has {size} bytes but the manifest says {expect.bytes}; {replaced}")
            if len(keys) != expect.num_samples:
                raise ShardError(f"{self.path}: has {len(keys)} samples but the manifest says "
                                 f"{expect.num_samples}; {replaced}")
            written = _attr(f, "fastdata_shard")
            if written is not None and written != expect.name:
                raise ShardError(f"{self.path}: was written as shard {written!r}, but the manifest lists it as "
                                 f"{expect.name!r}; {replaced}")
        npy: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        if self._expect_fields is None:
            return npy
        listed = {info.name for info in self._expect_fields}
        unknown = sorted(set(self._layout) - listed)
        if unknown:
            raise ShardError(f"{self.path}: holds fields {unknown} that the manifest does not list "
                             f"(manifest fields: {sorted(listed)}); {replaced}")
        for info in self._expect_fields:
            if info.name not in self._layout:
                raise ShardError(f"{self.path}: has no dataset for field {info.name!r} listed in the manifest "
                                 f"(fields here: {sorted(self._layout)}); {replaced}")
            kind, is_npy = self._layout[info.name]
            if kind != info.kind:
                raise ShardError(f"{self.path}: field {info.name!r} is {kind!r} here but {info.kind!r} in the "
                                 f"manifest; {replaced}")
            if kind != "array" or info.shape is None or info.dtype is None:
                continue
            try:
                want = (tuple(info.shape), np.dtype(info.dtype))
            except TypeError as e:
                raise ShardError(f"{self.path}: the manifest gives field {info.name!r} dtype {info.dtype!r}, which "
                                 f"is not a NumPy dtype ({e}); the manifest was edited or is damaged") from None
            if is_npy:
                npy[info.name] = want
                continue
            ds = f[info.name]
            if (tuple(ds.shape[1:]), ds.dtype) != want:
                raise ShardError(f"{self.path}: field {info.name!r} has rows of shape {tuple(ds.shape[1:])} "
                                 f"{ds.dtype}, the manifest says {want[0]} {want[1]}; {replaced}")
        return npy

    def _checked(self, name: str, value: Any, key: str) -> Any:
        want = self._npy_shapes.get(name)
        if want is not None and (value.shape, value.dtype) != want:
            raise ShardError(f"{self.path}: sample {key!r} field {name!r} has shape {value.shape} {value.dtype}, "
                             f"the manifest says {want[0]} {want[1]}")
        return value

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def keys(self) -> tuple[str, ...]:
        """Sample keys in shard order (from dataset ``__key__``)."""
        self._open()
        assert self._keys is not None
        return self._keys

    @property
    def fields(self) -> dict[str, str]:
        """``{field: kind}`` of the shard."""
        self._open()
        return {name: kind for name, (kind, _) in self._layout.items()}

    def _selected(self, fields: Collection[str] | None) -> list[tuple[str, str, bool]]:
        if isinstance(fields, str):
            fields = (fields,)
        return [(name, kind, npy) for name, (kind, npy) in self._layout.items() if fields is None or name in fields]

    def read(self, i: int, fields: Collection[str] | None = None) -> dict[str, Any]:
        """Sample ``i``: ``{"__key__": key, field: value}`` (only ``fields`` when given)."""
        f = self._open()
        n = len(self.keys)
        if not 0 <= i < n:
            raise IndexError(f"{self.path}: sample index {i} out of range for {n} samples")
        out: dict[str, Any] = {"__key__": self.keys[i]}
        name = None
        try:
            for name, kind, npy in self._selected(fields):
                value = _convert(f[name][i], kind, npy)
                out[name] = self._checked(name, value, out["__key__"]) if self._npy_shapes else value
        except _H5_ERRORS as e:
            raise _corrupt(self.path, f"reading field {name!r} of sample {i} ({out['__key__']!r})", e) from e
        return out

    def iter_range(self, start: int = 0, stop: int | None = None,
                   fields: Collection[str] | None = None) -> Iterator[dict[str, Any]]:
        """Samples ``start..stop-1``, read as contiguous blocks of rows (not per-sample indexing).

        Fixed-shape arrays are views into the block read; copy them if you keep many.
        """
        f = self._open()
        keys = self.keys
        n = len(keys)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise IndexError(f"{self.path}: range {start}:{stop} out of bounds for {n} samples")
        selected = self._selected(fields)
        with _h5_errors(self.path, "reading its layout"):
            row_bytes = sum(int(np.prod(f[name].shape[1:], dtype=np.int64)) * f[name].dtype.itemsize
                            for name, kind, npy in selected if kind == "array" and not npy)
        rows = max(1, min(_MAX_BLOCK_ROWS, _BLOCK_BYTES // max(1, row_bytes)))
        for a in range(start, stop, rows):
            b = min(stop, a + rows)
            blocks = []
            for name, kind, npy in selected:
                with _h5_errors(self.path, f"reading field {name!r} of samples {a}..{b - 1}"):
                    blocks.append((name, kind, npy, f[name][a:b]))
            for j in range(b - a):
                out: dict[str, Any] = {"__key__": keys[a + j]}
                name = None
                try:
                    for name, kind, npy, block in blocks:
                        value = _convert(block[j], kind, npy)
                        out[name] = self._checked(name, value, out["__key__"]) if self._npy_shapes else value
                except _H5_ERRORS as e:  # a message is built only on failure: this loop is the hot path
                    raise _corrupt(self.path, f"reading field {name!r} of sample {a + j} ({keys[a + j]!r})", e) from e
                yield out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.iter_range()

    def close(self) -> None:
        """Close the HDF5 file (reopened on next use; safe to call twice)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None
        self._pid = None

    def __enter__(self) -> HDF5ShardReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "rdcc_nbytes": self.rdcc_nbytes, "rdcc_nslots": self.rdcc_nslots,
                "expect": self._expect, "fields": self._expect_fields}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], rdcc_nbytes=state["rdcc_nbytes"],  # type: ignore[misc]
                      rdcc_nslots=state["rdcc_nslots"], expect=state.get("expect"), fields=state.get("fields"))

    def __repr__(self) -> str:
        return f"HDF5ShardReader({self.path!r})"


# What h5py (or NumPy, parsing stored ``.npy`` bytes) raises on a corrupt file, depending on the
# damaged structure; a ShardError (raised by the checks themselves) is none of these.
_H5_ERRORS = (OSError, KeyError, RuntimeError, ValueError)


def _corrupt(path: str, what: str, e: BaseException) -> ShardError:
    return ShardError(f"{path}: {what}: {type(e).__name__}: {e}; the shard is corrupt or was changed (run verify)")


@contextlib.contextmanager
def _h5_errors(path: str, what: str) -> Iterator[None]:
    """:data:`_H5_ERRORS` inside the block as a ShardError naming the shard and ``what`` it was doing."""
    try:
        yield
    except _H5_ERRORS as e:
        raise _corrupt(path, what, e) from e


def _convert(value: Any, kind: str, npy: bool) -> Any:
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "array" and not npy:
        return value if isinstance(value, np.ndarray) else np.asarray(value)  # a 0-d row reads as a scalar
    raw = value.tobytes()
    if npy:
        try:
            with npy_lock():  # the header parse is not thread-safe (decode_threads)
                # read_array, not np.load: that takes zip bytes for an .npz and anything else for a pickle
                return np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - NumPy raises EOFError, tokenize.TokenError, ... on damaged bytes
            raise ValueError(f"its stored .npy bytes do not parse ({type(e).__name__}: {e})") from e
    return raw


def _validate(f: Any, path: str) -> tuple[tuple[str, ...], dict[str, tuple[str, bool]]]:
    """Check the documented layout; return keys and ``{field: (kind, npy)}``."""
    h5py = _h5py()

    def bad(msg: str) -> ShardError:
        return ShardError(f"{path}: not a fastdata HDF5 shard: {msg}")

    fmt = _attr(f, "fastdata_format")
    if fmt != "hdf5":
        raise bad(f"root attribute 'fastdata_format' is {fmt!r}, expected 'hdf5'")
    version = _attr(f, "fastdata_version")
    if version != HDF5_VERSION:
        raise bad(f"root attribute 'fastdata_version' is {version!r}, expected {HDF5_VERSION}")
    if "__key__" not in f:
        raise bad("dataset '__key__' is missing")
    key_ds = f["__key__"]
    if not isinstance(key_ds, h5py.Dataset) or key_ds.ndim != 1 or h5py.check_string_dtype(key_ds.dtype) is None:
        raise bad(f"dataset '__key__' must be a 1-D string dataset, got {_describe(key_ds)}")
    n = key_ds.shape[0]
    num = _attr(f, "num_samples")
    if num != n:
        raise bad(f"root attribute 'num_samples' is {num!r} but dataset '__key__' has {n} rows")
    layout: dict[str, tuple[str, bool]] = {}
    for name, ds in f.items():
        if name == "__key__":
            continue
        if not isinstance(ds, h5py.Dataset):
            raise bad(f"{name!r} must be a dataset, got a group")
        kind = _attr(ds, "kind")
        if kind not in KINDS:
            raise bad(f"dataset {name!r} has attribute 'kind' {kind!r}, expected one of {list(KINDS)}")
        if ds.ndim < 1 or ds.shape[0] != n:
            raise bad(f"dataset {name!r} has shape {ds.shape}, expected {n} rows (one per key)")
        vlen = h5py.check_vlen_dtype(ds.dtype)
        npy = kind == "array" and vlen is not None
        ok = {
            "array": (vlen == np.uint8 and ds.ndim == 1) if vlen is not None else ds.dtype.kind in _NATIVE_KINDS,
            "int": ds.ndim == 1 and ds.dtype.kind in "biu",
            "float": ds.ndim == 1 and ds.dtype.kind in "fiu",
        }.get(kind, vlen == np.uint8 and ds.ndim == 1)
        if not ok:
            raise bad(f"dataset {name!r} of kind {kind!r} has the wrong type: {_describe(ds)}")
        layout[name] = (kind, npy)
    keys = tuple(key_ds.asstr()[:].tolist())
    if len(set(keys)) != len(keys):  # each would be served twice under one key
        seen: dict[str, int] = {}
        for i, key in enumerate(keys):
            j = seen.setdefault(key, i)
            if j != i:
                raise bad(f"dataset '__key__' holds key {key!r} twice (rows {j} and {i})")
    return keys, layout


def _attr(obj: Any, name: str) -> Any:
    """An HDF5 attribute as a plain Python value (None when absent)."""
    value = obj.attrs.get(name)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def _describe(ds: Any) -> str:
    return f"shape {getattr(ds, 'shape', None)} dtype {getattr(ds, 'dtype', type(ds).__name__)}"
