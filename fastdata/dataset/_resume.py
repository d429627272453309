"""The state dict of a ShardedDataset: saving a position, and loading one (exact or elastic resume).

A state names the epoch, the resume stages (workers' consumed positions, one stage per worker count),
the worker that yields next, and what fixes the order (seed, shuffle options, even, samples_per_epoch,
the data's fingerprint); after a resize also the eras that ended and the split of the epoch's rest.
Loading one state makes the next iteration of its epoch yield exactly the rest; loading every rank's
states resumes at another world size with every sample read once and equal batch counts per rank
(:func:`fastdata.dataset._elastic.elastic_split`). A load checks everything (``_state``: the fields;
here: the match with the dataset, positions against each worker's part) before it changes the
dataset; ``load_state(..., apply=False)`` only checks. See docs/design/resume.md.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastdata.dataset._dist import dist_ready
from fastdata.dataset._elastic import (
    ElasticPlan,
    Era,
    elastic_remaining,
    elastic_split,
    rest_counts,
)
from fastdata.dataset._schedule import BatchSchedule
from fastdata.dataset._split import SplitPlan, Stage, resplit
from fastdata.dataset._state import (
    STATE_VERSION,
    ParsedState,
    check_positions,
    parse_state,
)
from fastdata.errors import StateError

__all__ = ["STATE_VERSION", "Resume", "check_resume_dist", "dataset_part", "load_state", "state_of"]


@dataclass(frozen=True)
class Resume:
    """What ``load_state_dict`` left for the next iterations of a dataset (replaced, never changed: a copy
    of the dataset made by ``copy.copy`` consumes its own)."""

    point: tuple[int, list[Stage], int] | None = None  # (epoch, stages, next worker): the next iteration's start
    dist: tuple[int, int] = (0, 1)  # (rank, world_size) when ``point`` was loaded (see check_resume_dist)
    # (epoch, ended eras, worker counts per rank, era origin): the rest of an epoch after a world-size change
    elastic: tuple[int, tuple[Era, ...], tuple[tuple[int, ...], ...], tuple[int, int]] | None = None
    # (batch_size, num_workers, drop_last) the elastic rest gives every rank equal batch counts with
    split_for: tuple[int, int, bool] | None = None
    # samples_per_epoch: (epoch, stream position) where that epoch's window starts; moved by a resize
    # (see _load_states) so that the epochs after it continue the stream where the last one ended
    origin: tuple[int, int] = (0, 0)


def dataset_part(state: Any) -> Any:
    """The dataset's state inside a ``fastdata.DataLoader`` state (``{"dataset": ..., ...}``), else ``state``."""
    return state["dataset"] if isinstance(state, Mapping) and isinstance(state.get("dataset"), Mapping) else state


def _shape_text(shape: tuple[int, int, bool]) -> str:
    bs, nw, drop = shape
    return f"batch_size={bs}, num_workers={nw if nw > 1 else '0 or 1'}, drop_last={drop}"


def _state_field(name: str) -> str:
    """The argument a state field stands for, in messages."""
    return "shuffle" if name == "shuffle_options" else name


def _check_matches(state: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """StateError naming the first field of a resume ``state`` that differs from this dataset's (``mine``):
    another order, or other data. States saved before ``shuffle_options`` existed are not checked for it."""
    for name in ("seed", "num_samples", "shuffle", "even", "samples_per_epoch", "fingerprint", "shuffle_options"):
        if (name in state or name != "shuffle_options") and state.get(name) != mine[name]:
            why = (" (the state was saved over other data: another manifest or other shards; tar files without "
                   "a manifest are identified by path, size and modification time)") if name == "fingerprint" else ""
            raise StateError(f"state_dict does not match this dataset: {_state_field(name)}={state.get(name)!r} in "
                             f"the state, {mine[name]!r} here{why}")


def state_of(ds: Any, epoch: int, stages: Sequence[Stage], next_worker: int = 0) -> dict[str, Any]:
    """The ``state_dict()`` of a position of ``ds``: ``stages`` consumed of ``epoch``, ``next_worker`` yields next."""
    r: Resume = ds._resume
    shuffle = ds.shuffle
    state = {
        "version": STATE_VERSION, "epoch": epoch, "seed": ds.seed, "rank": ds.rank,
        "world_size": ds.world_size, "num_samples": ds.num_samples, "shuffle": shuffle is not None,
        "even": ds.even, "samples_per_epoch": ds.samples_per_epoch, "fingerprint": ds.source.fingerprint,
        "shuffle_options": None if shuffle is None else {
            "open_shards": shuffle.open_shards, "buffer_size": shuffle.buffer_size,
            "within_shard": shuffle.within_shard},  # they fix the order as much as the seed does
        "stages": [[n, list(c)] for n, c in stages], "next_worker": next_worker,
        **({"stream_origin": list(r.origin)} if r.origin != (0, 0) else {}),
    }
    el = r.elastic
    if el is not None and el[0] == epoch:
        state.update({"eras": [e.to_json() for e in el[1]], "split": [list(c) for c in el[2]],
                      **({"split_for": list(r.split_for)} if r.split_for is not None else {}),
                      **({"era_origin": list(el[3])} if el[3] != (0, 0) else {})})
    return state


def check_resume_dist(ds: Any) -> None:
    """A resume state holds positions of the rank and world size it was loaded at: loaded before
    ``torch.distributed`` was initialised (rank 0 of 1), it would be applied to another rank's part
    (a list of every rank's state was even split for one rank): another epoch's worth read twice."""
    r: Resume = ds._resume
    if r.point is not None and r.dist != (ds.rank, ds.world_size):
        r0, w0 = r.dist
        raise StateError(
            f"the resume state was loaded while this dataset was rank {r0} of world_size={w0}; it now runs as "
            f"rank {ds.rank} of world_size={ds.world_size} (torch.distributed initialised after "
            "load_state_dict?): load the state after init_process_group, or pass rank= and world_size=")



def load_state(ds: Any, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], batch_size: int | None,
               num_workers: int, drop_last: bool, *, apply: bool = True) -> None:
    """``ds.load_state_dict(state, ...)`` (see there); ``apply=False``: only check that it would load
    (StateError if not; nothing changes, nothing is warned)."""
    schedule = BatchSchedule(num_workers, batch_size, drop_last)
    if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        if not state:
            raise StateError("load_state_dict: empty list of rank states")
        _load_states(ds, [dataset_part(s) for s in state], schedule, apply)
        return
    _load_one(ds, parse_state(dataset_part(state)), schedule.shape, lockstep=False, apply=apply)


def _apply(ds: Any, epoch: int, point: tuple[int, list[Stage], int], elastic: Any, split_for: Any,
           origin: tuple[int, int]) -> None:
    """Make ``ds``'s next iteration of ``epoch`` start at ``point``."""
    ds.set_epoch(epoch)
    ds._resume = Resume(point=point, dist=(ds.rank, ds.world_size), elastic=elastic, split_for=split_for,
                        origin=origin)
    ds._plans.clear()
    ds._live = None


def _base_plan(ds: Any) -> SplitPlan:
    """This rank's plain split (an elastic plan of a state loaded before is not it)."""
    plan = ds._plans.get((ds.rank, ds.world_size)) or ds._plan()
    return plan if isinstance(plan, SplitPlan) else plan.base


def _check_world(ds: Any, p: ParsedState, where: str = "state_dict") -> None:
    if p.world_size != ds.world_size:
        unset = "" if ds._explicit_dist is not None or dist_ready() else (
            " (torch.distributed is not initialised and no rank=/world_size= were passed: load the state after "
            "init_process_group)")
        raise StateError(f"{where} does not match this dataset: world_size={p.world_size} in the state, "
                         f"{ds.world_size} here{unset}; pass the states of all ranks as a list (gathered with "
                         "torch.distributed.all_gather_object) to resume at another world size")


def _load_one(ds: Any, p: ParsedState, shape: tuple[int, int, bool], *, lockstep: bool, apply: bool) -> None:
    """Load this rank's state ``p``, read by a loader of ``shape`` (``BatchSchedule.shape``); ``lockstep``:
    every rank's state was seen to give equal batch counts."""
    ds._resolve_dist()
    _check_world(ds, p)
    _check_matches(p.raw, state_of(ds, 0, []))
    if p.rank != ds.rank and p.eras:  # an elastic rest: ranks' counts differ
        raise StateError(f"state_dict is rank {p.rank}'s state (world_size={ds.world_size}), this is rank "
                         f"{ds.rank}, and after an elastic resume each rank's position is its own: each rank loads "
                         "its own state, or the list of every rank's")
    elastic = None
    if p.eras and not ds.source.streaming:
        elastic = (p.epoch, p.eras, p.split, p.era_origin)
        try:
            elastic_remaining(_base_plan(ds), p.eras, ())  # the eras' positions against their workers' parts
        except ValueError as e:
            raise StateError(f"state_dict: eras: {e}") from e
    if not ds.source.streaming and p.stages:
        base = _base_plan(ds)
        plan = ElasticPlan(base, *elastic) if elastic is not None else base
        check_positions("state_dict", p.stages, plan.worker_counts(p.stages[0][0]))
    split_for = p.split_for if elastic is not None else None
    if elastic is not None and not lockstep and split_for is not None and split_for != shape \
            and len(set(elastic[2])) > 1 and sum(rest_counts(elastic[2][ds.rank], p.stages, shape[1])):
        # The rest of an elastic resume gives the ranks different sample counts, cut so that each yields
        # the same number of batches with the loader it was split for; with these, a rank that cannot
        # see the others' states cannot know their counts (states saved before split_for: as before)
        raise StateError(
            f"state_dict is rank {ds.rank}'s rest of epoch {p.epoch} after an elastic resume: the "
            f"ranks hold {[sum(c) for c in elastic[2]]} samples, split for equal batch counts with "
            f"{_shape_text(split_for)}; with {_shape_text(shape)} their batch counts can differ (a DDP job "
            "then hangs at the epoch's end), and one rank's state cannot tell. Load the list of every rank's "
            "state (it splits the rest again for this loader), or resume with the settings it was split for")
    if lockstep and elastic is not None:
        split_for = shape  # every rank's rest was seen to give equal batch counts with this loader
    if not apply:
        return
    if p.rank != ds.rank:
        # every rank has the same per-worker counts and DDP keeps them in lockstep, so another rank's
        # positions are this rank's, unless samples were skipped on one of them (a checkpoint saved by
        # rank 0 alone, loaded everywhere)
        warnings.warn(f"state_dict is rank {p.rank}'s state, loaded on rank {ds.rank}: its positions "
                      "are used as this rank's, exact only if every rank read the same samples per worker (no "
                      "samples skipped); save the list of every rank's state (all_gather_object) to be sure",
                      RuntimeWarning, stacklevel=4)
    _apply(ds, p.epoch, (p.epoch, p.stages, p.next_worker), elastic, split_for, p.stream_origin)


def _lockstep(ds: Any, states: Sequence[ParsedState], schedule: BatchSchedule) -> bool:
    """Whether every rank, continuing its own state (same world size) with ``schedule``'s loader, yields
    the same number of batches. After an elastic resume the ranks' sample counts differ (equal batch
    counts for the loader it was split for): another batch size or worker count then needs a new split
    of the rest."""
    split = states[0].split if states[0].eras else None
    plan = _base_plan(ds)
    batches = set()
    for r, st in enumerate(states):
        if split is not None:
            first = list(split[r])
        else:
            first = plan.worker_counts(st.stages[0][0] if st.stages else schedule.num_workers)
        batches.add(schedule.total(rest_counts(first, st.stages, schedule.num_workers)))
    return len(batches) <= 1


def _load_states(ds: Any, raw: list[Any], schedule: BatchSchedule, apply: bool) -> None:
    """Load from every rank's state (see ``ShardedDataset.load_state_dict``), for a loader that deals
    batches by ``schedule``."""
    ds._resolve_dist()
    states = [parse_state(st, f"rank state {r}") for r, st in enumerate(raw)]
    w1 = len(states)
    for r, st in enumerate(states):
        if st.world_size != w1 or st.rank != r:
            raise StateError(f"rank states must be the {w1} states of one job in rank order; entry {r} is rank "
                             f"{st.rank} of world_size={st.world_size}")
    for name in ("epoch", "seed", "num_samples", "shuffle", "even", "samples_per_epoch", "fingerprint",
                 "shuffle_options", "eras", "split", "split_for", "stream_origin", "era_origin"):
        values = {repr(st.raw.get(name)) for st in states}
        if len(values) > 1:
            raise StateError(f"rank states disagree on {_state_field(name)}: {sorted(values)}")
    _check_matches(states[0].raw, state_of(ds, 0, []))
    shape = schedule.shape
    num_workers, batch_size, drop_last = schedule.num_workers, schedule.batch_size, schedule.drop_last
    eras = states[0].eras or ()
    base = None if ds.source.streaming else _base_plan(ds)
    if base is not None:  # every rank's positions against its workers' parts, before any index math
        for r, st in enumerate(states):
            if not st.stages:
                continue
            n0 = st.stages[0][0]
            if st.split is not None:  # the rest of an elastic resume: rank r's workers got split[r]
                first = resplit(st.split[r], n0)
            else:
                try:
                    first = replace(base, world_size=w1, rank=r).worker_counts(n0)
                except ValueError as e:  # even="drop" leaves no samples per rank at that world size
                    raise StateError(f"rank state {r}: world_size={w1} does not fit this dataset: {e}") from e
            check_positions(f"rank state {r}", st.stages, first)
    if w1 == ds.world_size and (ds.source.streaming  # no eras: every rank continues its own stream
                                or _lockstep(ds, states, schedule)):
        # same world size: continue in exactly the same order
        _load_one(ds, states[ds.rank], shape, lockstep=True, apply=apply)
        return
    epoch = states[0].epoch
    if base is None:
        raise StateError(
            f"a streaming (URL) source cannot resume at world_size={ds.world_size} from a state saved at "
            f"world_size={w1}: it has no sample counts, so the rest of the epoch cannot be cut into equal "
            "batch counts per rank. Resume at the same world size, at the next epoch, or read the shard "
            "folder's manifest (RemoteShards / a folder URL), which resumes elastically")
    prev_split = states[0].split
    ended = Era(w1, prev_split, tuple(tuple(st.stages) for st in states))
    eras = (*eras, ended)
    try:
        left = elastic_remaining(base, eras, ())
    except ValueError as e:
        raise StateError(f"rank states: eras: {e}") from e
    # the stream origin of the first era's world size: epoch's window there, and where the next epoch starts
    era_origin = states[0].era_origin if states[0].eras else states[0].stream_origin
    origin = (0, 0)
    if ds.samples_per_epoch is not None:
        first_plan = replace(base, world_size=eras[0].world_size, rank=0, origin=era_origin)
        origin = (epoch + 1, first_plan.window_start(epoch + 1))
    try:
        split = elastic_split(left, ds.world_size, num_workers, batch_size, drop_last, ds.even)
    except ValueError as e:
        raise StateError(str(e)) from e
    if not apply:
        return
    got = sum(map(sum, split))
    if got != left and not drop_last:
        warnings.warn(
            f"elastic resume: the {left} remaining samples of epoch {epoch} cannot give {ds.world_size} ranks "
            f"equal batch counts with num_workers={num_workers} and batch_size={batch_size}; even={ds.even!r} "
            + (f"repeats {got - left} of them" if got > left else f"leaves {left - got} of them out")
            + " (num_workers >= 2 avoids this)", stacklevel=4)
    _apply(ds, epoch, (epoch, [], 0), (epoch, eras, tuple(split), era_origin), shape, origin)
