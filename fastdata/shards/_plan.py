"""The plan of a conversion: its types (options, planned shards, results) and :func:`plan_conversion`.

A plan is deterministic: the same SRC (names, sizes, mtimes) and options give the same shards with
the same samples in the same order, whatever the number of workers, and the same fingerprint, which
a rerun compares to resume or to refuse. Nothing is written while planning.
Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdata.errors import ConversionError
from fastdata.manifest import FieldInfo, Manifest, ShardInfo
from fastdata.shards._fields import required_fields
from fastdata.shards._formats import shard_format
from fastdata.shards._images import CHECK_LEVELS, is_image_field
from fastdata.shards._listing import Listing
from fastdata.shards._sources import list_source

__all__ = ["DEFAULT_SHARD_SIZE", "ENGINES", "FINGERPRINT_KEY", "PLAN_KEY", "ConvertOptions", "ConvertResult", "Plan",
           "ShardJob", "ShardResult", "check_level", "plan_conversion"]

DEFAULT_SHARD_SIZE = 256 << 20  # same default as fastdata.ShardWriter
ENGINES = ("local", "ray")
FINGERPRINT_KEY = "plan_fingerprint"  # in manifest.extra: the plan a finished DEST was written by
PLAN_KEY = "plan"  # in manifest.extra: the arguments and an inputs summary, to name what a refused rerun changed


@dataclass(frozen=True)
class ConvertOptions:
    """Options of :func:`convert` (the command-line flags of ``fastdata shard``)."""

    format: str = "tar"
    shard_size: int | None = None  # target bytes per shard; DEFAULT_SHARD_SIZE if neither limit is set
    samples_per_shard: int | None = None
    workers: int | None = None  # None: default_workers(), capped by the number of shards to write
    shuffle: bool = False
    seed: int = 0
    resize: int | None = None
    check: str = "header"  # image check for pass-through: "header" (open + verify) or "full" (decode)
    strict: bool = False
    overwrite: bool = False
    progress: bool | None = None  # None: a tqdm bar when stderr is a terminal
    engine: str = "local"  # "local" (this machine, process pool) or "ray" (tasks on a Ray cluster)
    staging: str | None = None  # URL DEST: local folder for shards before upload and the progress records

    def __post_init__(self) -> None:
        shard_format(self.format)  # ValueError naming the formats
        for name in ("shard_size", "samples_per_shard", "workers", "resize"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.check not in CHECK_LEVELS:
            raise ValueError(f"check must be one of {CHECK_LEVELS}, got {self.check!r}")

    @property
    def max_bytes(self) -> int | None:
        if self.shard_size is None and self.samples_per_shard is None:
            return DEFAULT_SHARD_SIZE
        return self.shard_size


@dataclass(frozen=True)
class ShardJob:
    """One planned shard: its number, file name and ``(key, source reference)`` per sample."""

    number: int
    name: str
    items: tuple[tuple[str, tuple], ...]


@dataclass(frozen=True)
class Plan:
    """A deterministic conversion plan (see :func:`plan_conversion`)."""

    listing: Listing
    options: ConvertOptions
    jobs: tuple[ShardJob, ...]
    fields: tuple[FieldInfo, ...]
    fingerprint: str
    extra: dict = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(len(j.items) for j in self.jobs)


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` did."""

    manifest: Manifest
    written: int  # shards written by this run
    kept: int  # shards kept from an interrupted earlier run
    seconds: float
    processed: int  # input samples processed by this run (kept shards excluded)
    complete: bool = False  # DEST already held this finished conversion (same plan): nothing was done


@dataclass(frozen=True)
class ShardResult:
    """A finished shard job: its ShardInfo (None when every sample was skipped) and skipped inputs."""

    number: int
    shard: ShardInfo | None
    skipped: tuple[dict[str, str], ...]
    num_planned: int


# ------------------------------------------------------------------------------------ planning

_PLAN_VERSION = 1


def plan_conversion(src: str | os.PathLike[str], options: ConvertOptions | None = None) -> Plan:
    """Enumerate SRC and cut it into shards; nothing is written."""
    opts = options or ConvertOptions()
    fmt = shard_format(opts.format)
    listing = list_source(src)
    _check_duplicates(listing)
    if fmt.utf8_keys:
        _check_utf8_keys(listing, fmt.name)
    fields = _output_fields(listing, opts)
    n = len(listing.keys)
    order = np.random.default_rng(opts.seed).permutation(n) if opts.shuffle else np.arange(n)
    sizes = fmt.estimate(listing, opts.resize, fields)
    jobs = []
    fixed = fmt.file_bytes(len(fields))
    for number, (a, b) in enumerate(_boundaries([sizes[i] for i in order.tolist()], opts, fixed)):
        items = tuple((listing.keys[i], listing.refs[i]) for i in order[a:b].tolist())
        jobs.append(ShardJob(number, f"shard-{number:06d}{fmt.suffix}", items))
    extra: dict[str, Any] = {"source": {"kind": listing.kind, "path": listing.root, **listing.extra},
                             "shuffle": opts.shuffle, "resize": opts.resize, "check": check_level(opts)}
    if opts.shuffle:
        extra["seed"] = opts.seed
    from fastdata._version import __version__

    # what a refused rerun compares, to name the argument or inputs that differ (fastdata.shards._progress.plan_changes)
    extra[PLAN_KEY] = {"format": opts.format, "shard_size": opts.max_bytes,
                                 "samples_per_shard": opts.samples_per_shard, "shuffle": opts.shuffle,
                                 "seed": opts.seed if opts.shuffle else None, "resize": opts.resize,
                                 "check": check_level(opts), "fastdata": __version__, "inputs": listing.inputs}
    fingerprint = _fingerprint(listing, opts, jobs, fields)
    extra[FINGERPRINT_KEY] = fingerprint  # lets a rerun recognise the finished conversion
    return Plan(listing, opts, tuple(jobs), fields, fingerprint, extra)


def check_level(opts: ConvertOptions) -> str:
    return "full" if opts.resize else opts.check  # resizing decodes everything anyway


def _check_duplicates(listing: Listing) -> None:
    first: dict[str, int] = {}
    for i, key in enumerate(listing.keys):
        j = first.setdefault(key, i)
        if j != i:
            raise ConversionError(f"duplicate key {key!r}: {listing.origin(listing.refs[j])} and "
                                  f"{listing.origin(listing.refs[i])} (keys must be unique across SRC)")


def _check_utf8_keys(listing: Listing, format: str) -> None:
    """Keys stored as UTF-8 strings (HDF5): refuse, naming the input, a key from a file name in another encoding."""
    for key, ref in zip(listing.keys, listing.refs):
        if not key.isascii():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise ConversionError(f"{listing.origin(ref)}: key {key!r} is not valid UTF-8 (a file name in "
                                      f"another encoding?); --format {format} stores keys as UTF-8: rename it or "
                                      "use --format tar"
                                      ) from None


def _output_fields(listing: Listing, opts: ConvertOptions) -> tuple[FieldInfo, ...]:
    fields = list(listing.fields)
    images = [f.name for f in fields if is_image_field(f.name)]
    if opts.resize:
        if not images:
            raise ConversionError(f"--resize: SRC {listing.root} has no image field "
                                  f"(fields: {[f.name for f in fields]})")
        if any(f.name == "img.npy" for f in fields):
            raise ConversionError(f"--resize: SRC {listing.root} already has a field 'img.npy'")
        size = opts.resize
        fields = [f for f in fields if f.name not in images] + [FieldInfo("img.npy", "array", "uint8", (3, size, size))]
    elif shard_format(opts.format).same_fields and len(images) > 1:
        # an image stored in one format or another (jpg|png) satisfies a sample; an HDF5 row needs every field
        n = len(listing.keys)
        for group in required_fields(images):
            mixed = sorted(group)
            if len(group) > 1 and (listing.kind == "images" or any(listing.field_counts.get(f, n) < n for f in group)):
                raise ConversionError(f"--format {opts.format} needs the same fields in every sample, but SRC "
                                      f"{listing.root} mixes image types {mixed}; use --format tar or --resize")
    return tuple(sorted(fields, key=lambda f: f.name))


def _boundaries(sizes: list[int], opts: ConvertOptions, fixed: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each shard: a shard ends before the next sample would pass a limit
    (``fixed``: a shard file's bytes besides its samples)."""
    max_bytes, max_samples = opts.max_bytes, opts.samples_per_shard
    start, total = 0, fixed
    for i, size in enumerate(sizes):
        count = i - start
        if count and ((max_samples is not None and count >= max_samples)
                      or (max_bytes is not None and total + size > max_bytes)):
            yield start, i
            start, total = i, fixed
        total += size
    yield start, len(sizes)


def _fingerprint(listing: Listing, opts: ConvertOptions, jobs: list[ShardJob], fields: tuple[FieldInfo, ...]) -> str:
    from fastdata._version import __version__

    h = hashlib.sha256()
    head = {"plan": _PLAN_VERSION, "fastdata": __version__, "kind": listing.kind, "stamp": listing.stamp,
            "format": opts.format, "resize": opts.resize, "check": check_level(opts),
            "fields": [f.to_json() for f in fields]}
    if "classes" in listing.extra:  # the labels: a class folder added without images shifts them
        head["classes"] = listing.extra["classes"]
    h.update(json.dumps(head, sort_keys=True).encode())
    for job in jobs:
        h.update(f"\n{job.name}:".encode())
        h.update("\0".join(k for k, _ in job.items).encode("utf-8", "surrogateescape"))
    return h.hexdigest()
