"""``fastdata.ShardWriter``: write samples into a folder of shards plus ``manifest.json``."""
from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fastdata._util import INT_SUFFIXES
from fastdata.errors import FastdataError
from fastdata.io import is_url, local_path
from fastdata.manifest import FieldInfo, Manifest, ShardInfo
from fastdata.shards import _tarfmt
from fastdata.shards._fields import FieldTracker
from fastdata.shards._formats import shard_format
from fastdata.shards._keys import check_key, is_meta
from fastdata.shards._progress import remove_outputs

__all__ = ["ShardWriter", "shard_name"]

def shard_name(number: int, format: str) -> str:
    """``shard-000000.tar`` / ``shard-000000.h5``."""
    return f"shard-{number:06d}{shard_format(format).suffix}"


def _check_readable(name: str, value: Any, key: str) -> None:
    """Refuse a value the field's suffix would not read back (every read of the sample would fail): a float in an
    int field (``cls``: a float label becomes "3.0", which no int decoding reads) or a str that is no int; anything
    but an array or bytes in ``.npy``; a str that is not JSON in ``.json``. Bytes are stored as given, unchecked."""
    ext = name.rsplit(".", 1)[-1].lower()
    where = f"field {name!r} of sample {key!r}"
    if ext in INT_SUFFIXES:
        if isinstance(value, (float, np.floating)):
            raise TypeError(f"{where} holds ints (a '{ext}' field is read back as an int), got {value!r} "
                            f"({type(value).__name__}): write int(value)")
        if isinstance(value, str):
            try:
                int(value)
            except ValueError:
                raise ValueError(f"{where} holds ints (a '{ext}' field is read back as an int), got {value[:40]!r}: "
                                 "not an int (store a class name under another field, e.g. 'label.txt')") from None
    if ext == "npy" and not isinstance(value, (np.ndarray, bytes, bytearray, memoryview)):
        raise TypeError(f"{where} holds an array (a '.npy' field is read back with np.load), got a "
                        f"{type(value).__name__}: write np.asarray(value)")
    if ext in ("json", "jsn") and isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where}: {value[:40]!r} is not JSON ({e}), which a '.{ext}' field is read back as: "
                             "write the dict/list itself, or json.dumps(...)") from None


class ShardWriter:
    """Write samples (dicts with ``"__key__"``) into ``dest`` as tar or HDF5 shards.

    Rolls to a new shard before a sample would push the current one past ``max_bytes`` (a single
    larger sample gets a shard of its own) or when it holds ``max_samples``. Each shard is written
    under a temporary name and renamed when complete; ``manifest.json`` is written last, by
    :meth:`close`. After an exception inside ``with``, finished shards stay but no manifest is written.
    Keys must be unique across the whole folder (ValueError naming the key); HDF5 samples must all
    have the fields of the first one (ValueError naming key and fields: a manifest field missing
    from a shard could not be read); a value its field's suffix would not read back (a float in ``cls``,
    anything but an array or its bytes in ``.npy``) is a TypeError naming key and field; a sample rejected
    by :meth:`write` leaves no key or field behind. HDF5 shards are assembled in memory (a copy of each
    sample, up to ``max_bytes``), so keep ``max_bytes`` moderate for HDF5. A non-empty ``dest`` is
    refused unless ``overwrite=True``, which removes the shards, indexes and manifest already there
    (other files stay). ``extra`` is stored as the manifest's free-form ``extra`` object.
    """

    def __init__(self, dest: str | os.PathLike[str], *, format: str = "tar", max_bytes: int = 256 << 20,
                 max_samples: int | None = None, overwrite: bool = False, extra: dict | None = None):
        self._spec = shard_format(format)  # ValueError naming the formats (also for a list, which is unhashable)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                        or max_samples < 1):
            raise ValueError(f"max_samples must be None or an int >= 1, got {max_samples!r}")
        if not isinstance(overwrite, bool):  # overwrite="no" is truthy: it would remove the shards already there
            raise ValueError(f"overwrite must be True or False, got {overwrite!r}")
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"extra must be None or a dict (the manifest's free-form 'extra' object), got {extra!r}")
        if not isinstance(dest, (str, os.PathLike)) or not os.fspath(dest):
            raise ValueError(f"dest must be a non-empty path, got {dest!r}")
        text = os.fspath(dest)
        if isinstance(text, str) and is_url(text):
            raise ValueError(f"dest {text!r} is a URL; ShardWriter writes a local folder (write there, then upload)")
        # file:// and "~/out" as Manifest.load, Cache and ShardedDataset read them (not folders 'file:' or '~')
        self.dest = Path(os.path.abspath(local_path(text) if isinstance(text, str) else text))  # chdir-proof
        self.format = format
        self.max_bytes = max_bytes
        self.max_samples = max_samples
        self.extra = dict(extra or {})
        try:  # it goes into manifest.json: refuse now, not at close() after every shard is written
            json.dumps(self.extra)
        except (TypeError, ValueError) as e:
            raise TypeError(f"ShardWriter extra= must hold JSON values (str, int, float, bool, None, lists, "
                            f"dicts), it is stored in manifest.json: {e}") from None
        _prepare(self.dest, overwrite)
        self._shards: list[ShardInfo] = []
        self._skipped: list[dict[str, str]] = []
        self._keys: set[str] = set()
        self._fields = FieldTracker()
        self._tar: Any = None  # TarShardWriter of the current tar shard
        self._h5: list[dict[str, Any]] = []  # buffered samples of the current HDF5 shard
        self._h5_bytes = 0
        self._h5_names: frozenset[str] | None = None  # the fields of every HDF5 sample (those of the first)
        self._closed = False
        self.manifest: Manifest | None = None

    @property
    def shards(self) -> tuple[ShardInfo, ...]:
        """Shards finished so far."""
        return tuple(self._shards)

    @property
    def num_samples(self) -> int:
        """Samples written so far (finished shards plus the current one)."""
        return len(self._keys)

    def write(self, sample: dict[str, Any]) -> None:
        """Add one sample; ValueError for a missing, invalid or duplicate key."""
        if self._closed:
            raise ValueError(f"ShardWriter for {self.dest} is closed")
        if not isinstance(sample, dict) or "__key__" not in sample:
            raise ValueError(f"a sample must be a dict with a '__key__', got {type(sample).__name__}")
        key = check_key(sample["__key__"])
        if key in self._keys:
            raise ValueError(f"duplicate key {key!r}: already written to {self.dest}")
        for name, value in sample.items():
            _check_readable(name, value, key)
        if not self._spec.buffered:  # tar: streamed into the open shard
            self._write_tar(sample)
        else:  # HDF5, the only buffered format: these checks are its own (see ShardFormat.buffered)
            names = frozenset(k for k in sample if not is_meta(k))
            if self._h5_names is not None and names != self._h5_names:
                raise ValueError(f"sample {key!r}: HDF5 shards need the same fields in every sample, but it lacks "
                                 f"{sorted(self._h5_names - names)} and adds {sorted(names - self._h5_names)} "
                                 f"(earlier samples have {sorted(self._h5_names)}); use format='tar'")
            from fastdata.shards.hdf5 import check_value

            for name, value in sample.items():
                if not is_meta(name):
                    check_value(name, value, key)
            self._fields.add(sample)
            self._write_h5(sample)
            self._h5_names = names
        self._keys.add(key)

    def _write_tar(self, sample: dict[str, Any]) -> None:
        from fastdata.shards.tar import TarShardWriter, encode_sample

        enc = encode_sample(sample)  # a sample that cannot be stored leaves no trace in the manifest
        self._fields.add(sample)
        cur = self._tar
        if cur is not None and cur.num_samples and (
            _tar_file_size(cur.bytes_written + enc.size) > self.max_bytes
            or (self.max_samples is not None and cur.num_samples >= self.max_samples)
        ):
            self._finish()
        if self._tar is None:
            self._tar = TarShardWriter(self.dest / shard_name(len(self._shards), "tar"))
        self._tar.add(enc)

    def _write_h5(self, sample: dict[str, Any]) -> None:
        # buffered until the shard is written: take a copy, the caller may reuse its dict and buffers
        sample = {k: _owned(v) for k, v in sample.items()}
        size = sum(_nbytes(v) for k, v in sample.items() if not is_meta(k))
        if self._h5 and (self._h5_bytes + size > self.max_bytes
                         or (self.max_samples is not None and len(self._h5) >= self.max_samples)):
            self._finish()
        self._h5.append(sample)
        self._h5_bytes += size

    def _finish(self) -> None:
        if self._tar is not None:
            self._shards.append(self._tar.close())
            self._tar = None
        if self._h5:
            path = self.dest / shard_name(len(self._shards), self.format)
            self._shards.append(self._spec.write(path, self._h5, fields=self._h5_fields()))
            self._h5, self._h5_bytes = [], 0

    def _h5_fields(self) -> tuple[FieldInfo, ...]:
        tracker = FieldTracker()
        for s in self._h5:
            tracker.add(s)
        return tracker.fields()

    def skip(self, source: str, reason: str) -> None:
        """Record an input that was not written (listed in ``manifest.json`` under ``skipped``)."""
        self._skipped.append({"source": str(source), "reason": str(reason)})

    def close(self) -> Manifest:
        """Finish the last shard and write ``manifest.json``; returns the manifest (idempotent)."""
        if self.manifest is not None:
            return self.manifest
        self._finish()
        self._closed = True
        manifest = Manifest(format=self.format, shards=tuple(self._shards), fields=self._fields.fields(),
                            skipped=tuple(self._skipped), extra=self.extra)
        manifest.save(self.dest)
        self.manifest = manifest  # only once saved: a failed close() must not return it as written later
        return manifest

    def abort(self) -> None:
        """Drop the shard in progress without writing a manifest."""
        self._closed = True
        if self._tar is not None:
            self._tar.abort()
            self._tar = None
        self._h5 = []

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _tar_file_size(content: int) -> int:
    return content + len(_tarfmt.end_of_archive(content))


def _owned(value: Any) -> Any:
    """A copy of a mutable sample value (arrays, bytearray/memoryview, JSON objects); others as is."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (dict, list)):
        return copy.deepcopy(value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return len(value)
    return 8


class _DestNotEmpty(FastdataError, FileExistsError):
    """ShardWriter's destination is not empty (a FileExistsError, as before, and a FastdataError)."""


class _DestNotFolder(FastdataError, NotADirectoryError):
    """ShardWriter's destination is a file (a NotADirectoryError, as before, and a FastdataError)."""


def _prepare(dest: Path, overwrite: bool) -> None:
    """Create ``dest``; refuse a non-empty one unless ``overwrite`` (then remove only what fastdata writes)."""
    if dest.exists() and not dest.is_dir():
        raise _DestNotFolder(f"destination {dest} exists and is not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in dest.iterdir())
    if existing and not overwrite:
        raise _DestNotEmpty(f"destination {dest} is not empty (found {existing[:3]}); pass overwrite=True")
    if existing:
        remove_outputs(dest)
