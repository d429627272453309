"""DatasetOptions: the keyword arguments of ShardedDataset, validated once.

Every check that needs only the arguments runs in ``__post_init__``; :meth:`DatasetOptions.check_source`
adds the ones that need the resolved source (streaming or indexed, its field names). Errors name the
argument and the value. The meaning of each option is documented on :class:`~fastdata.ShardedDataset`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastdata._util import check_index, check_int
from fastdata.dataset._source import Source
from fastdata.dataset._split import EVEN_POLICIES, ShuffleOptions
from fastdata.decode import DECODED_SUFFIXES, Decoder, check_max_pixels, suffix

__all__ = ["IMAGE_DECODE", "ON_ERROR", "ON_MISSING", "DatasetOptions"]

ON_ERROR = ("raise", "skip", "warn")
ON_MISSING = ("raise", "skip", "allow")
IMAGE_DECODE = ("cpu", "device")


@dataclass(frozen=True)
class DatasetOptions:
    """ShardedDataset's keywords, checked; ``shuffle`` becomes :class:`ShuffleOptions` or None, ``fields``
    a tuple, ``rank``/``world_size`` ints."""

    shuffle: bool | ShuffleOptions | None = False
    seed: int = 0
    decode: bool | Mapping[str, Decoder | None] = True
    preprocess: Callable[[Any], Any] | None = None
    transform: Callable[[Any], Any] | None = None
    sample_transform: Callable[[dict[str, Any]], Any] | None = None
    fields: Sequence[str] | None = None
    cache: Any = None
    rank: int | None = None
    world_size: int | None = None
    even: str = "pad"
    samples_per_epoch: int | None = None
    on_error: str = "raise"
    allow_pickle: bool = False
    image_decode: str = "cpu"
    on_missing: str = "raise"
    max_skips: int | float | None = None
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):  # True would pass as seed 1
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.on_missing not in ON_MISSING:
            raise ValueError(f"on_missing must be one of {ON_MISSING}, got {self.on_missing!r}")
        _check_max_skips(self.max_skips)
        check_max_pixels(self.max_pixels)
        object.__setattr__(self, "fields", _check_fields(self.fields))
        if self.even not in EVEN_POLICIES:
            raise ValueError(f"even must be one of {EVEN_POLICIES}, got {self.even!r}")
        check_int("samples_per_epoch", self.samples_per_epoch, 1, none_ok=True)
        self._check_dist()
        for name in ("preprocess", "transform", "sample_transform"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {fn!r}")
        if self.cache is not None and not isinstance(getattr(self.preprocess, "fingerprint", None), str):
            raise ValueError("cache= needs preprocess= with a fingerprint (ResizeCenterCrop(...) or "
                             f"Deterministic(fn, version=...)), got preprocess={self.preprocess!r}")
        shuffle = self.shuffle
        if shuffle is not None and not isinstance(shuffle, (bool, ShuffleOptions)):  # '' or [] passed as off
            raise TypeError(f"shuffle must be a bool or ShuffleOptions, got {shuffle!r}")
        object.__setattr__(self, "shuffle", ShuffleOptions() if shuffle is True else (shuffle or None))
        self._check_image_decode()

    def _check_dist(self) -> None:
        rank, world_size = self.rank, self.world_size
        if (rank is None) != (world_size is None):
            raise ValueError(f"pass both rank and world_size or neither, got rank={rank!r}, world_size={world_size!r}")
        if world_size is not None:  # int(1.5) or int("1") would pass a wrong or misspelt value on silently
            world_size = check_index("world_size", world_size, 1)
            rank = check_index("rank", rank, 0)
            if rank >= world_size:
                raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
            object.__setattr__(self, "rank", rank)
            object.__setattr__(self, "world_size", world_size)

    def _check_image_decode(self) -> None:
        if self.image_decode not in IMAGE_DECODE:
            raise ValueError(f"image_decode must be one of {IMAGE_DECODE}, got {self.image_decode!r}")
        if self.image_decode != "device":
            return
        if self.preprocess is not None or self.transform is not None or self.cache is not None:
            raise ValueError("image_decode='device' keeps images encoded for the device decode stage: it excludes "
                             "preprocess=, transform= and cache= (use fastdata.gpu transforms after DecodeImages)")
        if self.max_pixels is not None:  # the workers never decode: it would do nothing
            raise ValueError("image_decode='device' keeps images encoded, so max_pixels= would limit nothing here: "
                             "pass it to the stage that decodes them, fastdata.gpu.DecodeImages(max_pixels=...)")

    def check_source(self, source: Source) -> None:
        """The checks that need the resolved ``source``: what a streaming source cannot do, and field
        names (``fields=``, ``decode=`` keys) that match nothing in it."""
        if self.cache is not None and source.streaming:
            raise ValueError("cache= needs random access to samples; a streaming (URL) source has none")
        if isinstance(self.max_skips, float) and source.streaming and self.samples_per_epoch is None:
            raise ValueError("max_skips as a fraction needs the epoch's size: a streaming source needs "
                             "samples_per_epoch= (or pass a count)")
        if self.fields is not None and source.fields is not None:
            unknown = sorted(f for f in set(self.fields) - set(source.fields) if not f.startswith("__"))
            if unknown:
                raise ValueError(f"fields={list(self.fields)!r}: {unknown} not in this dataset; available fields: "
                                 f"{list(source.fields)}")
        decode = self.decode
        if isinstance(decode, Mapping) and source.fields:  # ".png" or "PNG" would match nothing, silently
            names = set(source.fields) | {suffix(f) for f in source.fields}
            # a suffix fastdata decodes may be absent ({"jpg": f, "png": f} shared by several datasets)
            unknown = [k for k in decode if k not in names and k not in DECODED_SUFFIXES]
            if unknown:
                raise ValueError(f"decode={{...}}: {unknown} match no field of this dataset (a key is a field name or "
                                 f"its last suffix, lower case, without the dot: 'png'); available fields: "
                                 f"{list(source.fields)}")
        elif isinstance(decode, Mapping):  # fields unknown (tar URLs): a leading dot still matches nothing but a
            dotted = [k for k in decode if isinstance(k, str) and k.startswith(".")]  # field '.png' ('png' does too)
            if dotted:
                raise ValueError(f"decode={{...}}: {dotted}: a key is a field name or its last suffix, lower case, "
                                 f"without the dot: {dotted[0][1:].lower()!r}")


def _check_max_skips(value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or (isinstance(value, int) and value < 0)
        or (isinstance(value, float) and not 0.0 < value < 1.0)
    ):
        raise ValueError(f"max_skips must be None, an int >= 0 or a float in (0, 1), got {value!r}")


def _check_fields(fields: Any) -> tuple[str, ...] | None:
    """``fields=`` as a tuple of names (None: all)."""
    if fields is None:
        return None
    if isinstance(fields, (str, bytes)):
        raise TypeError(f"fields must be a list of field names, got the string {fields!r}")
    try:
        names = list(fields)
    except TypeError:
        raise TypeError(f"fields must be a list of field names, got {fields!r}") from None
    bad = [f for f in names if not isinstance(f, str)]
    if bad:
        raise TypeError(f"fields must be a list of field names (str), got {bad[0]!r} in {names!r}")
    return tuple(names)
