"""The schema of a ``fastdata.DataLoader`` state: ``{"version", "dataset", "num_workers", "batches"}``.

``dataset`` is the ShardedDataset's state at the position of the last batch handed out,
``num_workers`` the worker count its positions are of, ``batches`` the batches of that epoch handed
out so far, across resumes. :func:`parse_loader_state` checks all of it (the dataset part with the
dataset stage's own schema) and raises :class:`~fastdata.errors.StateError` naming the field and
value; a bare ShardedDataset state, or a list of every rank's states (elastic resume), is taken too.
Nothing here knows a loader object. See docs/guide/resume-contract.md.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastdata.dataset import ParsedState, parse_state
from fastdata.errors import StateError

__all__ = ["LOADER_STATE_VERSION", "LoaderState", "parse_loader_state"]

LOADER_STATE_VERSION = 1
_KEYS = ("version", "dataset", "num_workers", "batches")


@dataclass(frozen=True)
class LoaderState:
    """A loader state, checked: the dataset part (one state, or a list of every rank's), the batches of
    its epoch handed out so far, and the worker count of its positions (None: a bare dataset state)."""

    dataset: Any
    batches: int
    num_workers: int | None


def _count(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise StateError(f"{where}: {name} must be an int >= 0, got {value!r:.100}")
    return int(value)


def _one(state: Any, where: str) -> LoaderState:
    if not isinstance(state, Mapping):
        raise StateError(f"{where}: not a fastdata.DataLoader state (a dict), got {type(state).__name__}")
    if "dataset" not in state:
        if "stages" in state:  # a ShardedDataset state: its dataset stage checks it
            parse_state(state, where)
            return LoaderState(state, 0, None)
        raise StateError(f"{where}: not a fastdata.DataLoader state ({', '.join(_KEYS)}) nor a ShardedDataset "
                         f"state; its keys are {sorted(map(str, state))[:12]}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise StateError(f"{where}: a fastdata.DataLoader state lacks {missing}")
    version = state["version"]
    if isinstance(version, bool) or not isinstance(version, numbers.Integral) or version != LOADER_STATE_VERSION:
        raise StateError(f"{where}: version={version!r:.40}; this fastdata reads DataLoader states of version "
                         f"{LOADER_STATE_VERSION}")
    num_workers = _count(where, "num_workers", state["num_workers"])
    batches = _count(where, "batches", state["batches"])
    if not isinstance(state["dataset"], Mapping):
        raise StateError(f"{where}: dataset must be a ShardedDataset state (a dict), got "
                         f"{type(state['dataset']).__name__}")
    parsed = parse_state(state["dataset"], f"{where}: dataset")
    if parsed.stages and parsed.stages[-1][0] != max(1, num_workers):
        raise StateError(f"{where}: num_workers={num_workers}, but its positions (dataset stages[-1]) are of "
                         f"{parsed.stages[-1][0]} logical workers")
    consumed = _consumed(parsed)
    if batches > consumed:
        raise StateError(f"{where}: batches={batches}, but its positions (dataset stages and eras) hold "
                         f"{consumed} consumed samples of the epoch, and each batch handed out took at least one")
    return LoaderState(state["dataset"], batches, num_workers)


def _consumed(parsed: ParsedState) -> int:
    """The samples of its epoch a dataset state's positions have consumed, an upper bound of the batches
    handed out: this rank's stages, and of each era that ended in a resize the most any of its ranks
    consumed (the batches carried over a resize are the count every rank of that era had reached)."""
    def total(stages: Sequence[tuple[int, Sequence[int]]]) -> int:
        return sum(sum(positions) for _, positions in stages)

    eras = parsed.eras or ()
    return total(parsed.stages) + sum(max((total(st) for st in era.stages), default=0) for era in eras)


def parse_loader_state(state: Any) -> LoaderState:
    """Check a ``fastdata.DataLoader.state_dict()``, a ShardedDataset state, or a list of every rank's."""
    if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        if not state:
            raise StateError("load_state_dict: empty list of rank states")
        parts = [_one(s, f"rank state {r}") for r, s in enumerate(state)]
        counts = {p.batches for p in parts}
        # ranks in lockstep have handed out the same number of batches; else the count is unknown: 0
        return LoaderState([p.dataset for p in parts], counts.pop() if len(counts) == 1 else 0, None)
    return _one(state, "state_dict")
