"""The plan types of a conversion: options, planned shards, results (no conversion logic here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fastdata.manifest import FieldInfo, Manifest, ShardInfo
from fastdata.shards._formats import shard_format
from fastdata.shards._images import CHECK_LEVELS
from fastdata.shards._listing import Listing

__all__ = ["DEFAULT_SHARD_SIZE", "ENGINES", "ConvertOptions", "ConvertResult", "Plan", "ShardJob", "ShardResult"]

DEFAULT_SHARD_SIZE = 256 << 20  # same default as fastdata.ShardWriter
ENGINES = ("local", "ray")


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
