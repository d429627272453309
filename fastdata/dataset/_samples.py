"""SampleLoader: one sample of a ShardedDataset read, decoded, preprocessed (cache hit or fill) and transformed.

It owns what turns a (shard, position) into the sample a walk yields: the shard readers of this process
(shared by every walk), the cache store, the decoder, the field checks (``on_missing``) and the error
policy (``on_error``, whose records go to the dataset's SkipLog). A copy for another process (pickled,
or ``copy.copy``) keeps the configuration and opens its own readers and store. With a cache, a
sample's keys keep one order, hit or miss: ``__key__``, the other fields as read, then the image
fields sorted by name.
"""
from __future__ import annotations

import hashlib
import os
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fastdata.cache import Store
from fastdata.dataset._cursor import Cursor
from fastdata.dataset._options import DatasetOptions
from fastdata.dataset._packed import EncodedImage, key_index
from fastdata.dataset._readers import ReaderCache, fork_count
from fastdata.dataset._source import Source
from fastdata.decode import SampleDecoder, image_to_tensor, is_image_field, suffix
from fastdata.errors import (
    CacheError,
    FastdataError,
    MissingFieldError,
    ShardError,
    SkipBudgetError,
)
from fastdata.shards import missing_fields, required_fields
from fastdata.transforms import accepts_generator, sample_generator

__all__ = ["SampleLoader"]


def _image_decoders(decode: bool | Mapping[str, Any]) -> str:
    """What the cache key adds for image fields not decoded by the default decoder ("" for none): the
    store holds preprocess= of their output. A decoder is named by its ``fingerprint`` attribute, else
    by module and qualified name (as ``Deterministic`` keys on name and version, never on the code),
    plus a digest of its code for a lambda or a local function, whose names tell nothing apart."""
    if decode is True:
        return ""
    if decode is False:
        return "|decode=False"
    names = []
    for field, fn in sorted(decode.items()):
        if is_image_field(field):
            fp = getattr(fn, "fingerprint", None)
            name = "raw" if fn is None else fp if isinstance(fp, str) else (
                f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}")
            code = getattr(fn, "__code__", None)
            if not isinstance(fp, str) and "<" in name and isinstance(code, types.CodeType):
                name += f"#{_code_digest(code)}"  # every lambda is '<lambda>': its code tells them apart
            names.append(f"{field}={name}")
    return f"|decode {','.join(names)}" if names else ""


def _code_digest(code: types.CodeType) -> str:
    """A digest of a function's bytecode, names and constants (not its file or line numbers)."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames)).encode())
        for k in c.co_consts:
            if isinstance(k, types.CodeType):
                feed(k)
            else:
                h.update(repr(k).encode())

    feed(code)
    return h.hexdigest()[:16]


class SampleLoader:
    """How the samples of one dataset are loaded in this process (see the module docstring).

    It keeps what ``__init__`` derived from the options (decoder, required fields) and this process's
    readers and store; the dataset's attributes (``fields``, ``preprocess``, ``transform``,
    ``on_error``, ...) are read at each load from ``ds``, so that changing them takes effect.
    """

    def __init__(self, options: DatasetOptions, source: Source):
        self.source = source
        self.cache = options.cache
        self._open_shards = options.shuffle.open_shards if options.shuffle else 1  # type: ignore[union-attr]
        fields = None if options.fields is None else frozenset(options.fields)
        known = fields if fields is not None else source.fields
        # groups of field names a sample needs one of each (image formats are alternatives)
        self.required = required_fields(known) if known is not None and options.on_missing != "allow" else ()
        # the groups without image fields: what a read of the uncached fields must find (a cache hit holds the rest)
        self._required_uncached = tuple(g for g in self.required if not any(is_image_field(f) for f in g))
        first = options.preprocess if options.preprocess is not None else options.transform
        # the first image transform declares accepts_pil: without preprocess= that is transform=,
        # which then gets the decoder's PIL images as they are (no tensor conversion before it)
        self.pil_to_transform = options.preprocess is None and bool(getattr(options.transform, "accepts_pil", False))
        self.decoder = SampleDecoder(
            options.decode, allow_pickle=options.allow_pickle, draft_size=getattr(first, "target_size", None),
            images_as_pil=bool(getattr(first, "accepts_pil", False)), max_pixels=options.max_pixels,
        )
        self._reset()

    # ----- this process's state -----------------------------------------------------------------
    def _reset(self) -> None:
        self._walks: weakref.WeakSet[Cursor] = weakref.WeakSet()  # live walks reading through the readers
        self._readers = ReaderCache()
        self._store: Any = None
        self._store_pid: int | None = None
        self._uncached: tuple[Any, frozenset[str]] | None = None
        self._takes: dict[int, tuple[Any, bool]] = {}  # id(fn) -> (fn, whether it has a generator parameter)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_walks", "_readers", "_store", "_store_pid", "_uncached", "_takes"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def track(self, cursor: Cursor) -> None:
        """A walk that reads through this process's readers (it widens :meth:`reader_floor`)."""
        self._walks.add(cursor)

    def reader_floor(self) -> int:
        """Readers kept open at least: the shard pieces one walk interleaves, times the walks live
        in this process (e.g. the virtual workers of an in-process loader), plus slack at piece ends."""
        return self._open_shards * max(1, len(self._walks)) + 2

    def cache_store(self, ds: Any) -> Store | None:
        """The cache store ``ds`` reads and fills (None without ``cache=``).

        Opened once per process and held open: a store open in some process is never evicted,
        so the main process keeps it safe between epochs even when workers are not persistent.
        """
        if self.cache is None:
            return None
        if self._store is None or self._store_pid != os.getpid():
            from fastdata.cache import Cache

            cache = self.cache if isinstance(self.cache, Cache) else Cache(self.cache)
            fingerprint = f"{self.source.fingerprint}|{ds.preprocess.fingerprint}"
            # the store holds the image fields read: fields= selecting fewer than the source has
            # needs a store of its own (a store holding other fields would miss or add one on hits)
            images = sorted(f for f in ds.fields or () if is_image_field(f))
            if ds.fields is not None and images != sorted(f for f in self.source.fields or () if is_image_field(f)):
                fingerprint += f"|image fields {','.join(images)}"
            fingerprint += _image_decoders(self.decoder.decode)
            self._store = cache.open_store(fingerprint=fingerprint, num_samples=ds.num_samples)
            self._store_pid = os.getpid()
        return self._store

    # ----- one sample ---------------------------------------------------------------------------
    def load(self, ds: Any, shard: int, i: int, g: int, cursor: Cursor) -> Any:
        """Sample ``i`` of ``shard`` (global index ``g``) decoded, preprocessed (cache hit or fill) and
        transformed; None when ``on_error`` skipped it (recorded on ``cursor``)."""
        try:
            store = self.cache_store(ds)
            hit = store.get(g) if store is not None else None
            if hit is not None:
                sample = self._read_uncached(ds, shard, i, g, cursor)
                if sample is None:
                    return None  # lacks a required field: skipped under on_missing="skip"
                sample.update(hit)
            else:
                raw = self._read(shard, i, ds.fields, cursor)
                if self.required and self.lacks(ds, raw, self.required, shard, g, cursor):
                    return None
                sample = self.decode(ds, raw, shard, g, cursor.epoch)
                if not self.pil_to_transform:
                    sample = self.apply(ds.preprocess, sample)
                if store is not None:
                    # the order a hit gives: uncached fields as read, then cached ones in store order
                    outputs = {k: sample.pop(k) for k in sorted(k for k in sample if is_image_field(k))}
                    if outputs:
                        store.put(g, outputs)
                    sample.update(outputs)
        except (CacheError, MissingFieldError, SkipBudgetError):
            raise  # the store failed (e.g. disk full), on_missing="raise", the budget: on_error does not apply
        except (FastdataError, OSError, IndexError) as e:
            self.handle_error(ds, self._wrap_error(e, shard, i), e, shard, i, g, cursor)
            return None
        return self.randomize(ds, sample, shard, g, cursor.epoch)

    def randomize(self, ds: Any, sample: dict[str, Any], shard: int, g: int, epoch: int) -> Any:
        """``transform`` on each image field, then ``sample_transform``; each one that has a ``generator``
        parameter gets the sample's :func:`~fastdata.transforms.sample_generator` (a new one per call:
        every image field of a sample, an image and its mask, draws the same numbers). ``g < 0``: a
        streaming source, whose sample identity is a hash of shard and key."""
        fns = (ds.transform, ds.sample_transform)
        takes = [fn is not None and self._takes_generator(fn) for fn in fns]
        seeded = None
        if any(takes):
            index = g if g >= 0 else key_index(self.source.names[shard], str(sample.get("__key__", "?")))
            seeded = (ds.seed, epoch, index)
        sample = self.apply(fns[0], sample, seeded if takes[0] else None)
        if fns[1] is None:
            return sample
        return self.finish(ds, sample, shard, seeded if takes[1] else None)

    def _takes_generator(self, fn: Any) -> bool:
        hit = self._takes.get(id(fn))
        if hit is None or hit[0] is not fn:
            hit = self._takes[id(fn)] = (fn, accepts_generator(fn))
        return hit[1]

    def load_uncached(self, ds: Any, shard: int, i: int, g: int, cursor: Cursor) -> dict[str, Any] | None:
        """``__key__`` and the decoded fields the cache store does not hold, under the error policy
        (None: skipped). The cached fast path's read."""
        try:
            return self._read_uncached(ds, shard, i, g, cursor)
        except (CacheError, MissingFieldError, SkipBudgetError):  # CacheError: a node cache that cannot store
            raise
        except (FastdataError, OSError, IndexError) as e:
            self.handle_error(ds, self._wrap_error(e, shard, i), e, shard, i, g, cursor)
            return None

    def finish(self, ds: Any, sample: Any, shard: int, seeded: tuple[int, int, int] | None = None) -> Any:
        """``sample_transform(sample)`` (``seeded``: with ``generator=sample_generator(*seeded)``); None is
        refused: a sample dropped there would be counted nowhere, and a rank yielding fewer samples than
        ``len()`` breaks equal batch counts (DDP)."""
        out = (ds.sample_transform(sample) if seeded is None
               else ds.sample_transform(sample, generator=sample_generator(*seeded)))
        if out is None:
            key = sample.get("__key__", "?") if isinstance(sample, Mapping) else "?"
            raise TypeError(f"sample_transform returned None for sample {key!r} of shard {self.source.names[shard]}: "
                            "return the sample; samples cannot be filtered out there (fastdata counts every "
                            "sample: len(), exact resume, equal batches per rank). Use on_error='skip' for "
                            "unreadable samples, or a collate_fn that drops what you do not want")
        return out

    def decode(self, ds: Any, raw: dict[str, Any], shard: int, g: int, epoch: int) -> dict[str, Any]:
        """Decode a raw sample; with ``image_decode="device"`` image fields become EncodedImage
        (``g < 0``: a streaming source, the sample's identity is a hash of shard and key)."""
        name = self.source.names[shard]
        if ds.image_decode != "device":
            return self.decoder(raw, shard=name)
        key = str(raw.get("__key__", "?"))
        explicit = self.decoder.decode if isinstance(self.decoder.decode, Mapping) else {}
        encoded = {}
        for field_name, value in raw.items():
            if is_image_field(field_name) and field_name not in explicit and suffix(field_name) not in explicit:
                data = value.tobytes() if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1 \
                    else value
                if isinstance(data, (bytes, bytearray, memoryview)):
                    encoded[field_name] = EncodedImage(data, shard=name, key=key, epoch=epoch,
                                                       index=g if g >= 0 else key_index(name, key))
        rest = self.decoder({k: v for k, v in raw.items() if k not in encoded}, shard=name)
        return {k: encoded[k] if k in encoded else rest[k] for k in raw}

    @staticmethod
    def apply(fn: Callable[..., Any] | None, sample: dict[str, Any],
              seeded: tuple[int, int, int] | None = None) -> dict[str, Any]:
        """``fn`` on each image field (``seeded``: with ``generator=sample_generator(*seeded)``); images
        still PIL after it become uint8 (C, H, W) tensors."""
        for k, v in sample.items():
            if is_image_field(k):
                if fn is not None:
                    v = fn(v) if seeded is None else fn(v, generator=sample_generator(*seeded))
                if hasattr(v, "getbands"):  # still a PIL image
                    v = image_to_tensor(v)
                sample[k] = v
        return sample

    def _read(self, shard: int, i: int, fields: Any, cursor: Cursor | None) -> dict[str, Any]:
        """Sample ``i`` of ``shard`` read raw under a lease on its reader (``cursor``: the walk it is part of)."""
        cache = self._readers
        if cache.forks != fork_count():
            cache = self.reader_cache()
        lease = cache.acquire(shard, cursor, self)
        try:
            return lease.reader.read(i, fields=fields)
        finally:
            cache.release(lease)

    def reader_cache(self) -> ReaderCache:
        """This process's shard readers (a forked child starts with none: the parent's stay the parent's)."""
        cache = self._readers
        if cache.forks != fork_count():
            cache = self._readers = ReaderCache()
        return cache

    def _read_uncached(self, ds: Any, shard: int, i: int, g: int, cursor: Cursor) -> dict[str, Any] | None:
        """``__key__`` and the decoded fields of sample ``i`` of ``shard`` that the cache does not hold
        (None: it lacks a required one and ``on_missing="skip"`` skipped it)."""
        raw = self._read(shard, i, self._uncached_fields(ds), cursor)
        if self.required and self.lacks(ds, raw, self._required_uncached, shard, g, cursor):
            return None
        return self.decoder({k: v for k, v in raw.items() if not is_image_field(k)}, shard=self.source.names[shard])

    def _uncached_fields(self, ds: Any) -> frozenset[str] | None:
        known = ds.fields if ds.fields is not None else self.source.fields
        if known is None:
            return None  # unknown field names: read all, image fields are dropped undecoded
        if self._uncached is None or self._uncached[0] is not known:
            self._uncached = (known, frozenset(f for f in known if not is_image_field(f)))
        return self._uncached[1]

    # ----- the error policy ---------------------------------------------------------------------
    def lacks(self, ds: Any, raw: Mapping[str, Any], required: Sequence[frozenset[str]], shard: int, g: int,
              cursor: Cursor) -> bool:
        """Apply ``on_missing`` to a raw sample: False if it has every required field, True if it
        was skipped; MissingFieldError naming shard, key and fields for ``on_missing="raise"``."""
        missing = missing_fields(raw, required)
        if not missing:
            return False
        name, key = self.source.names[shard], str(raw.get("__key__", "?"))
        have = sorted(k for k in raw if not k.startswith("__"))
        err = MissingFieldError(f"{name}: sample {key!r} lacks field(s) {missing} (it has {have})")
        if ds.on_missing == "raise":
            raise MissingFieldError(f"{err}; pass on_missing='skip' or 'allow', or fields=[...] to read fewer")
        self.record_skip(ds, err, shard, g, cursor, key)
        return True

    def handle_error(self, ds: Any, err: FastdataError, cause: BaseException, shard: int, i: int, g: int,
                     cursor: Cursor, *, key: str | None = None) -> None:
        """Apply ``on_error`` to a failed sample: ``i`` of ``shard`` (``-1`` and ``key`` when streaming)."""
        if ds.on_error == "raise":
            if err is cause:
                raise err
            raise err from cause
        self.record_skip(ds, err, shard, g, cursor, self._key(shard, i) if key is None else key)

    def record_skip(self, ds: Any, err: FastdataError, shard: int, g: int, cursor: Cursor, key: str) -> None:
        """Record a skipped sample (see :meth:`SkipLog.add`)."""
        record = {"shard": self.source.names[shard], "key": key, "index": g, "epoch": cursor.epoch,
                  "reason": str(err)}
        ds._skips.add(ds, record, cursor)

    def _key(self, shard: int, i: int) -> str:
        """Key of sample ``i`` of ``shard`` for error reports (``#i`` when the shard's index is unreadable)."""
        try:
            cache = self.reader_cache()
            lease = cache.acquire(shard, None, self)
            try:
                return str(lease.reader.keys[i])
            finally:
                cache.release(lease)
        except Exception:  # noqa: BLE001 - the key is best effort for the report
            return f"#{i}"

    def _wrap_error(self, e: BaseException, shard: int, i: int) -> FastdataError:
        if isinstance(e, FastdataError):
            return e
        return ShardError(f"{self.source.names[shard]}: sample {self._key(shard, i)!r} (#{i}): "
                          f"{type(e).__name__}: {e}")
