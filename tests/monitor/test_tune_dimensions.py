"""``tune``'s search dimensions, one function each, driven by fake measurements (no timing): what each
measures, in which order, what it records, and which setting it chooses."""
from __future__ import annotations

import pytest
import torch

from fastdata.errors import FastdataError
from fastdata.monitor import DoctorOptions
from fastdata.monitor._tune import (
    DEPTHS,
    Search,
    batch_size_dimension,
    compare_with_start,
    decode_threads_dimension,
    decoder_dimension,
    depth_dimension,
    device_decode_dimension,
    worker_candidates,
    workers_dimension,
)


class Rates:
    """A fake measurement: ``table[key]`` images/s (or a callable of the call count), every call recorded."""

    def __init__(self, table: dict) -> None:
        self.table, self.calls = table, []

    def __call__(self, key):
        self.calls.append(key)
        value = self.table[key]
        return value(len(self.calls)) if callable(value) else value


# --- batch size -------------------------------------------------------------------------------------


def _fits_below(n: int):
    def fits(b: int) -> None:
        if b > n:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (fake limit {n})")
    return fits


def test_batch_size_is_the_largest_that_fits_less_headroom_and_releases_memory() -> None:
    s, released = Search(), []
    batch = batch_size_dimension(s, _fits_below(100), start=32, samples=10_000, batch_limit=2048,
                                 release=lambda: released.append(1))
    assert batch.largest_fit == 96 and batch.batch_size == 80 and batch.first_oom is not None
    assert [t["value"] for t in s.trials] == [b for b, _ in batch.tried]
    assert all(t["dimension"] == "batch_size" for t in s.trials)
    assert len(released) == sum(not ok for _, ok in batch.tried) + 1  # after each out-of-memory and at the end
    assert s.notes == [f"batch size: 96 fits in GPU memory, {batch.first_oom} does not; 80 leaves 10% headroom"]


def test_batch_size_never_exceeds_the_samples_measured() -> None:
    s = Search()
    batch = batch_size_dimension(s, _fits_below(10**6), start=32, samples=64, batch_limit=2048, release=lambda: None)
    assert batch.largest_fit == 64 and max(b for b, _ in batch.tried) == 64
    assert "(searched up to the 64 samples measured (--samples))" in s.notes[0]
    s = Search()
    batch_size_dimension(s, _fits_below(10**6), start=300, samples=10_000, batch_limit=256, release=lambda: None)
    assert "(searched up to --max-batch 256)" in s.notes[0]


# --- CPU decoder ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("costs", "start", "pick"), [
    ({"pil": 0.010, "torchvision": 0.009}, "pil", "torchvision"),  # 10% cheaper: taken
    ({"pil": 0.010, "torchvision": 0.0098}, "pil", "pil"),  # 2% cheaper: noise, the start stays
    ({"pil": 0.0098, "torchvision": 0.010}, "torchvision", "torchvision"),
])
def test_the_decoder_with_the_least_cpu_time_unless_within_noise_of_the_start(costs, start, pick) -> None:
    s, cost = Search(), Rates(costs)
    assert decoder_dimension(s, cost, start, ("pil", "torchvision")) == pick
    assert cost.calls == ["pil", "torchvision"]
    assert [(t["value"], t["images/s per core"]) for t in s.trials] == [(k, 1 / v) for k, v in costs.items()]


def test_a_decoder_that_fails_is_no_candidate_and_none_left_is_an_error() -> None:
    def cost(backend: str) -> float:
        if backend == "torchvision":
            raise OSError("broken")
        return 0.01

    s = Search()
    assert decoder_dimension(s, cost, "torchvision", ("pil", "torchvision")) == "pil"
    assert s.notes == ["decode backend torchvision: failed (OSError: broken)"]
    with pytest.raises(FastdataError, match=r"no CPU decoder could .*: a: OSError: broken; b: OSError: broken"):
        decoder_dimension(Search(), lambda b: cost("torchvision"), "a", backends=("a", "b"))


# --- worker processes -------------------------------------------------------------------------------


def test_worker_candidates_are_powers_of_two_up_to_the_cores_and_the_start() -> None:
    assert worker_candidates(3, 12) == [1, 2, 3, 4, 8, 12]
    assert worker_candidates(0, 2) == [0, 1, 2]
    assert worker_candidates(64, 4) == [1, 2, 4]


def test_workers_stop_when_doubling_no_longer_pays_and_the_two_best_are_measured_again() -> None:
    rates = Rates({1: 100.0, 2: 192.0, 4: 200.0, 8: 210.0})
    s = Search()
    assert workers_dimension(s, rates, [1, 2, 4, 8], None) == 2  # within 5% of 200
    assert rates.calls == [1, 2, 4, 4, 2]  # 4 gains < 5% over 2: stop; then the two best again
    assert [t["value"] for t in s.trials] == rates.calls and all(t["dimension"] == "num_workers" for t in s.trials)


def test_workers_take_the_best_of_repeated_runs_and_the_fewest_that_deliver_what_the_step_needs() -> None:
    first = Rates({1: 100.0, 2: lambda n: 150.0 if n == 2 else 210.0, 4: 200.0})  # 2's rerun is better
    assert workers_dimension(Search(), first, [1, 2, 4], None) == 2
    rates = Rates({1: 100.0, 2: 180.0, 4: 300.0, 8: 305.0})
    assert workers_dimension(Search(), rates, [1, 2, 4, 8], None) == 4
    assert workers_dimension(Search(), rates, [1, 2, 4, 8], need=150.0) == 2  # enough for the step


# --- thread decoder ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("threads_rate", "chosen"), [(160.0, 4), (104.0, 0)])
def test_the_thread_decoder_must_beat_the_workers_by_more_than_the_noise(threads_rate: float, chosen: int) -> None:
    rates, s = Rates({0: 100.0, 4: threads_rate}), Search()
    assert decode_threads_dimension(s, rates, 4, "job images/s") == chosen
    assert rates.calls == [0, 4, 0, 4]  # two interleaved rounds
    assert [set(t) for t in s.trials] == [{"dimension", "value", "job images/s"}] * 4


# --- decoding on the device -------------------------------------------------------------------------


@pytest.mark.parametrize(("device_rate", "chosen"), [(200.0, True), (102.0, False)])
def test_device_decode_must_beat_the_cpu_decoder(device_rate: float, chosen: bool) -> None:
    best = DoctorOptions(decode="pil")
    rates, s = Rates({"pil": 100.0, "device": device_rate}), Search()
    assert device_decode_dimension(s, lambda o: rates(o.decode), best) is chosen
    assert rates.calls == ["pil", "device", "pil", "device"]
    assert [t["value"] for t in s.trials] == rates.calls


def test_device_decode_that_fails_is_noted_and_not_chosen() -> None:
    def rate(o: DoctorOptions) -> float:
        if o.decode == "device":
            raise RuntimeError("no device decoder")
        return 100.0

    s = Search()
    assert device_decode_dimension(s, rate, DoctorOptions(decode="pil")) is False
    assert s.notes == ["decode on the device: failed (RuntimeError: no device decoder)"]
    assert [t["value"] for t in s.trials] == ["pil"]  # the first round ended there


# --- prefetch depth ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("rates", "start", "chosen"), [
    ({1: 100.0, 2: 100.0, 4: 100.0}, 2, 2),  # all equal: the start stays
    ({1: 100.0, 2: 91.0, 4: 100.0}, 2, 2),  # 9% slower: within 2 * MIN_GAIN, the start stays
    ({1: 80.0, 2: 85.0, 4: 100.0}, 2, 4),  # the start 15% slower: the smallest depth near the best
    ({1: 95.0, 2: 80.0, 4: 100.0}, 2, 1),
])
def test_depth_changes_only_for_more_than_twice_the_noise(rates: dict, start: int, chosen: int) -> None:
    measured, s = Rates(rates), Search()
    assert depth_dimension(s, measured, start) == chosen
    assert measured.calls == list(DEPTHS) * 2
    assert all(t["dimension"] == "depth" for t in s.trials)


# --- the start against the tuned settings -----------------------------------------------------------


def test_tuned_settings_within_noise_of_the_start_keep_the_start() -> None:
    s = Search()
    assert compare_with_start(s, lambda: 100.0, lambda: 103.0, same_batch=True) == (100.0, 100.0, True)
    assert s.notes == ["the tuned settings measured 103 against 100 images/s for the start: within noise, "
                       "so the start is kept"]
    assert compare_with_start(Search(), lambda: 100.0, lambda: 103.0, same_batch=False) == (100.0, 103.0, False)
    assert compare_with_start(Search(), lambda: 100.0, lambda: 150.0, same_batch=True) == (100.0, 150.0, False)


def test_each_side_is_measured_three_times_alternately_and_the_best_run_counts() -> None:
    order = []

    def start() -> float:
        order.append("start")
        return [90.0, 100.0, 95.0][order.count("start") - 1]

    def tuned() -> float:
        order.append("tuned")
        return [120.0, 110.0, 130.0][order.count("tuned") - 1]

    assert compare_with_start(Search(), start, tuned, same_batch=True) == (100.0, 130.0, False)
    assert order == ["start", "tuned"] * 3
    runs = Rates({None: 100.0})
    assert compare_with_start(Search(), lambda: runs(None), None, same_batch=True) == (100.0, 100.0, False)
    assert len(runs.calls) == 3  # a search that kept the start measures the start only
