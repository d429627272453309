"""The schema of a ShardedDataset state: one state parsed and checked field by field.

:func:`parse_state` turns a state dict into a :class:`ParsedState` or raises
:class:`~fastdata.errors.StateError` naming the field and its value: types (ints are ints, not
floats or bools), the version, ranges (rank within world size, the next worker within the last
stage's workers), and the shape of the resume stages and of an elastic rest (eras, split). What
depends on the dataset (the fields that fix the order, positions against each worker's part of the
epoch) is :func:`check_positions` and ``_resume``'s match; nothing here changes a dataset.
See docs/design/resume.md.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastdata.dataset._elastic import Era
from fastdata.dataset._split import Stage, stage_walk
from fastdata.errors import StateError

__all__ = ["REQUIRED", "STATE_VERSION", "ParsedState", "check_positions", "parse_state"]

STATE_VERSION = 1
# keys every state has (``next_worker`` and ``shuffle_options`` are absent from states saved before them)
REQUIRED = ("version", "epoch", "seed", "rank", "world_size", "num_samples", "shuffle", "even",
            "samples_per_epoch", "fingerprint", "stages")


@dataclass(frozen=True)
class ParsedState:
    """A state's fields, checked (see :func:`parse_state`); ``raw`` is the state itself."""

    raw: Mapping[str, Any]
    epoch: int
    rank: int
    world_size: int
    stages: list[Stage]
    next_worker: int
    stream_origin: tuple[int, int]
    eras: tuple[Era, ...] | None  # the rest of an epoch resumed at another world size (None: none)
    split: tuple[tuple[int, ...], ...] | None
    split_for: tuple[int, int, bool] | None
    era_origin: tuple[int, int]


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _int(where: str, name: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StateError(f"{where}: {name} must be an int, got {value!r:.100}")
    v = int(value)
    if v < lo or (hi is not None and v >= hi):
        bound = f"an int >= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise StateError(f"{where}: {name}={v} is out of range: must be {bound}")
    return v


def _ints(where: str, name: str, value: Any, lo: int = 0) -> tuple[int, ...]:
    if not _is_list(value):
        raise StateError(f"{where}: {name} must be a list of ints, got {value!r:.100}")
    return tuple(_int(where, f"{name}[{i}]", v, lo) for i, v in enumerate(value))


def _pair(where: str, name: str, value: Any) -> tuple[int, int]:
    """A state's ``stream_origin``/``era_origin``: [epoch, stream position] (absent: the start)."""
    if value is None:
        return (0, 0)
    if not _is_list(value) or len(value) != 2:
        raise StateError(f"{where}: {name} must be [epoch, stream position], got {value!r:.100}")
    return (_int(where, f"{name}[0]", value[0]), _int(where, f"{name}[1]", value[1]))


def parse_stages(where: str, value: Any, name: str = "stages") -> list[Stage]:
    """``[[num_workers, [position of each logical worker]], ...]``, checked."""
    if not _is_list(value):
        raise StateError(f"{where}: {name} must be a list of [num_workers, [positions]], got {value!r:.100}")
    out: list[Stage] = []
    for k, stage in enumerate(value):
        if not _is_list(stage) or len(stage) != 2 or not _is_list(stage[1]):
            raise StateError(f"{where}: {name}[{k}] must be [num_workers, [positions]], got {stage!r:.100}")
        n = _int(where, f"{name}[{k}] num_workers", stage[0], lo=1)
        if len(stage[1]) != n:
            raise StateError(f"{where}: {name}[{k}] lists {len(stage[1])} positions for num_workers={n}")
        out.append((n, tuple(_int(where, f"{name}[{k}] position of logical worker {w}", c)
                             for w, c in enumerate(stage[1]))))
    return out


def _eras(where: str, value: Any) -> tuple[Era, ...]:
    if not _is_list(value):
        raise StateError(f"{where}: eras must be a list, got {value!r:.100}")
    eras = []
    for k, era in enumerate(value):
        name = f"eras[{k}]"
        if not isinstance(era, Mapping) or not {"world_size", "workers", "stages"} <= era.keys():
            raise StateError(f"{where}: {name} must be {{world_size, workers, stages}}, got {era!r:.100}")
        w = _int(where, f"{name} world_size", era["world_size"], lo=1)
        workers = era["workers"]
        if workers is not None:
            if not _is_list(workers) or len(workers) != w:
                raise StateError(f"{where}: {name} workers must list {w} ranks' worker counts, got {workers!r:.100}")
            workers = tuple(_ints(where, f"{name} workers[{r}]", c) for r, c in enumerate(workers))
        stages = era["stages"]
        if not _is_list(stages) or len(stages) != w:
            raise StateError(f"{where}: {name} stages must list {w} ranks' stages, got {stages!r:.100}")
        ranks = tuple(tuple(parse_stages(where, st, f"{name} stages[{r}]")) for r, st in enumerate(stages))
        eras.append(Era(w, workers, ranks))
    return tuple(eras)


def parse_state(state: Any, where: str = "state_dict") -> ParsedState:
    """Check every field of a ShardedDataset state that does not depend on the dataset (see the module
    docstring); ``where`` starts each message (e.g. "rank state 2")."""
    if not isinstance(state, Mapping):
        raise StateError(f"{where}: not a ShardedDataset state (a dict with version {STATE_VERSION}), got "
                         f"{type(state).__name__}")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise StateError(f"{where}: not a ShardedDataset state: it lacks {missing} (keys: "
                         f"{sorted(map(str, state))[:12]})")
    version = state["version"]
    if isinstance(version, bool) or not isinstance(version, numbers.Integral) or version != STATE_VERSION:
        raise StateError(f"{where}: version={version!r:.40}; this fastdata reads ShardedDataset states of "
                         f"version {STATE_VERSION}")
    world_size = _int(where, "world_size", state["world_size"], lo=1)
    rank = _int(where, "rank", state["rank"], 0, world_size)
    stages = parse_stages(where, state["stages"])
    if stages:
        next_worker = _int(where, "next_worker", state.get("next_worker", 0), 0, stages[-1][0])
    else:
        next_worker = _int(where, "next_worker", state.get("next_worker", 0), 0, 1)
    eras = split = split_for = None
    if state.get("eras"):
        eras = _eras(where, state["eras"])
        raw_split = state.get("split")
        if not _is_list(raw_split) or len(raw_split) != world_size:
            raise StateError(f"{where}: split must list the worker counts of world_size={world_size} ranks, "
                             f"got {raw_split!r:.100}")
        split = tuple(_ints(where, f"split[{r}]", c) for r, c in enumerate(raw_split))
        if state.get("split_for") is not None:
            value = state["split_for"]
            if not _is_list(value) or len(value) != 3 or not isinstance(value[2], bool):
                raise StateError(f"{where}: split_for must be [batch_size, num_workers, drop_last], got "
                                 f"{value!r:.100}")
            split_for = (_int(where, "split_for batch_size", value[0], lo=1),
                         _int(where, "split_for num_workers", value[1], lo=1), value[2])
    return ParsedState(raw=state, epoch=_int(where, "epoch", state["epoch"]), rank=rank, world_size=world_size,
                       stages=stages, next_worker=next_worker,
                       stream_origin=_pair(where, "stream_origin", state.get("stream_origin")),
                       eras=eras, split=split, split_for=split_for,
                       era_origin=_pair(where, "era_origin", state.get("era_origin")))


def check_positions(where: str, stages: Sequence[Stage], first: Sequence[int]) -> None:
    """Every position of ``stages`` within its logical worker's part of the epoch; ``first``: the
    sample counts of stage 0's workers (each later stage splits what the one before left)."""
    for k, counts, consumed in stage_walk(first, stages):
        for w, (c, p) in enumerate(zip(counts, consumed)):
            if p > c:
                raise StateError(f"{where}: stages[{k}] (num_workers={stages[k][0]}): logical worker {w} consumed "
                                 f"{p} samples; its part of the epoch has {c}")
