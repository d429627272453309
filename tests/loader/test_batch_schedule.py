"""BatchSchedule: the one statement of how every loader path deals batches over its workers.

The reference is torch's DataLoader itself: an IterableDataset whose worker ``w`` yields ``counts[w]``
items gives batches in the order the schedule deals them (round-robin from worker 0, exhausted
workers skipped, each worker's own partial last batch unless ``drop_last``).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from fastdata.dataset import BatchSchedule, Turn


def _play(schedule: BatchSchedule, counts: list[int], first: int = 0,
          skips: dict[int, set[int]] | None = None) -> tuple[list[tuple[int, int]], list[int]]:
    """Deal an iteration whose worker ``w`` walks ``counts[w]`` samples (``skips[w]``: positions that
    fail to load). Returns the (worker, batch size) of each batch and the end positions reported."""
    skips = skips or {}
    pos = [0] * len(counts)
    out: list[tuple[int, int]] = []
    ends: list[int] = []
    deal = schedule.deal(first)
    while (w := deal.next()) is not None:
        loaded = skipped = 0
        while loaded < schedule.size and pos[w] < counts[w]:
            if pos[w] in skips.get(w, ()):
                skipped += 1
            else:
                loaded += 1
            pos[w] += 1
        turn = deal.settle(w, loaded, skipped > 0)
        if turn is Turn.BATCH:
            out.append((w, loaded))
        elif turn is Turn.END:
            ends.append(w)
    return out, ends


class _Counts(IterableDataset):
    def __init__(self, counts: list[int]):
        self.counts = counts

    def __iter__(self):
        info = get_worker_info()
        w = 0 if info is None else info.id
        return iter([w] * self.counts[w])


@pytest.mark.parametrize("counts, batch_size, drop_last", [
    ([5, 3], 2, False), ([5, 3], 2, True), ([4, 0, 7], 3, False), ([1, 1, 9], 4, True), ([6, 6], 3, False),
])
def test_deals_in_torchs_order(counts, batch_size, drop_last):
    loader = torch.utils.data.DataLoader(_Counts(counts), batch_size=batch_size, drop_last=drop_last,
                                         num_workers=len(counts), multiprocessing_context="fork")
    torch_order = [(int(b[0]), len(b)) for b in loader]
    schedule = BatchSchedule(len(counts), batch_size, drop_last)
    assert _play(schedule, counts)[0] == torch_order
    assert schedule.total(counts) == len(torch_order)


def test_first_worker_and_exhausted_workers_are_skipped():
    batches, _ = _play(BatchSchedule(3, 2), [2, 6, 1], first=1)
    assert batches == [(1, 2), (2, 1), (0, 2), (1, 2), (1, 2)]


def test_partial_last_batch_is_dropped_only_with_drop_last():
    assert _play(BatchSchedule(1, 4), [6])[0] == [(0, 4), (0, 2)]
    assert _play(BatchSchedule(1, 4, drop_last=True), [6])[0] == [(0, 4)]
    assert BatchSchedule(2, 4).total([6, 3]) == 3 and BatchSchedule(2, 4, True).total([6, 3]) == 1
    assert BatchSchedule(2, None).total([6, 3]) == 9  # no automatic batching: one sample per batch


def test_skipped_samples_shift_batches_and_a_walk_ending_in_skips_reports_its_end():
    batches, ends = _play(BatchSchedule(2, 2), [5, 4], skips={0: {1}, 1: {2, 3}})
    assert batches == [(0, 2), (1, 2), (0, 2)]
    assert ends == [1]  # worker 1's last two samples were skipped after its only batch
    batches, ends = _play(BatchSchedule(1, 3, drop_last=True), [5], skips={0: {4}})
    assert batches == [(0, 3)] and ends == [0]  # a dropped partial batch with a skip: its end is reported
    assert _play(BatchSchedule(1, 3, drop_last=True), [5])[1] == []  # no skip: nothing to report


def test_turn_outcomes_and_end_markers():
    deal = BatchSchedule(2, 3, drop_last=True).deal(0)
    assert deal.settle(0, 3, True) is Turn.BATCH and deal.active == [True, True]
    assert deal.settle(1, 2, False) is Turn.NOTHING and deal.active == [True, False]
    assert deal.settle(0, 0, True) is Turn.END and deal.next() is None
    assert BatchSchedule(2, 3, drop_last=True).end_markers() == 3  # fills a batch drop_last keeps
    assert BatchSchedule(2, 3).end_markers() == 1 and BatchSchedule(2, None).end_markers() == 1


@pytest.mark.parametrize("counts, batch_size, drop_last", [([5, 3, 4], 2, False), ([5, 3, 4], 2, True), ([1, 7], 3, False)])
def test_next_worker_predicts_the_dealing(counts, batch_size, drop_last):
    """The prediction a state_dict records (from the samples each worker has left) is the worker the
    dealing serves next, at every batch of an iteration without skips."""
    schedule = BatchSchedule(len(counts), batch_size, drop_last)
    for first in range(len(counts)):
        batches, _ = _play(schedule, counts, first=first)
        left = list(counts)
        last = None
        for w, size in batches:
            assert schedule.next_worker(last, first, left) == w
            left[w] -= size
            last = w


def test_next_worker_without_counts_is_plain_round_robin():
    assert BatchSchedule(3, 4).next_worker(None, 2, None) == 2
    assert BatchSchedule(3, 4).next_worker(2, 0, None) == 0
    assert BatchSchedule(1, 4).next_worker(0, 0, None) == 0
    assert BatchSchedule(0, 4).next_worker(0, 0, [0]) == 0


@pytest.mark.parametrize(("args", "shape"), [
    ((2, 4, True), (4, 2, True)),
    ((0, 4, False), (4, 1, False)),
    ((1, None, False), (1, 1, False)),
    ((1, None, True), (1, 1, False)),  # drop_last of single samples drops nothing
    ((3, 1, True), (1, 3, False)),
])
def test_shape_is_what_decides_the_batch_counts(args, shape):
    """Schedules of one shape give every count of samples the same batch count."""
    schedule = BatchSchedule(*args)
    assert schedule.shape == shape and type(schedule.shape[2]) is bool
    other = BatchSchedule(shape[1], shape[0], shape[2])
    assert all(schedule.total([n] * schedule.workers) == other.total([n] * other.workers) for n in range(9))
