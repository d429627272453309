"""The advice a stall report gives: what to change, named as the loader in use takes it."""
from __future__ import annotations

import dataclasses

import pytest

import fastdata
from fastdata.monitor import PeriodicStalls, StallMeter, StallReport, advise


def _loader_bound() -> StallReport:
    return StallReport(steps=30, wall_s=1.0, wait_s=0.6, wait_p50_s=0.02, wait_p99_s=0.03, first_wait_s=0.0)


def test_stall_advice_on_a_thread_decoder_loader_names_decode_threads(array_shards, monkeypatch):
    from fastdata.monitor import _stall

    monkeypatch.setattr(_stall, "_cores", lambda: 4)
    loader = fastdata.DataLoader(fastdata.ShardedDataset(array_shards), batch_size=4, decode_threads=2)
    advice = advise(_loader_bound(), loader)
    assert not any("num_workers" in a for a in advice), advice  # it said "num_workers=0 on 4 cores: raise it"
    assert any(a.startswith("decode_threads=2 on 4 cores: raise it") for a in advice), advice
    monkeypatch.setattr(_stall, "_cores", lambda: 2)
    assert not any("decode_threads" in a or "num_workers" in a for a in advise(_loader_bound(), loader))
    # a saw-tooth of period 2 is no burst of 2 worker processes: there are none
    teeth = PeriodicStalls(period=2, stalls=10, mean_s=0.03, fast_s=1e-4, total_s=0.3, regularity=1.0)
    loader = fastdata.DataLoader(fastdata.ShardedDataset(array_shards), batch_size=4, num_workers=2, decode_threads=2)
    advice = advise(dataclasses.replace(_loader_bound(), periodic=teeth), loader)
    assert any(a.startswith("saw-tooth: every 2 steps") for a in advice) and not any("= num_workers" in a
                                                                                    for a in advice), advice


def test_stall_advice_after_a_cached_fast_path_epoch_leaves_the_workers_alone(array_shards, monkeypatch):
    # the cached fast path reads in the training process: "num_workers=2 on 4 cores: raise it" and
    # "persistent_workers=False restarts workers every epoch" were advice that changes nothing there
    from fastdata.monitor import _stall

    monkeypatch.setattr(_stall, "_cores", lambda: 4)
    loader = fastdata.DataLoader(fastdata.ShardedDataset(array_shards), batch_size=4, num_workers=2,
                                 persistent_workers=False)
    assert any(a.startswith("num_workers=2 on 4 cores") for a in advise(_loader_bound(), loader))
    advice = advise(dataclasses.replace(_loader_bound(), loader_path="cached"), loader)
    assert not any("num_workers=2 on" in a or "persistent_workers" in a for a in advice), advice
    assert any(a.startswith("the cached fast path read the latest epoch in this process") for a in advice), advice


def test_stall_advice_suggests_cache_only_where_cache_can_be_passed(array_shards):
    def advice(**kw):
        loader = fastdata.DataLoader(fastdata.ShardedDataset(array_shards, **kw), batch_size=4)
        return [a for a in advise(_loader_bound(), loader) if "cache=" in a]

    assert advice() == []  # no preprocess=: cache= would raise "cache= needs preprocess= with a fingerprint"
    assert advice(preprocess=lambda x: x) == [
        ("preprocess= repeats every epoch: wrap it in fastdata.Deterministic(fn, version=...) and pass cache= "
         "to ShardedDataset")]
    assert advice(preprocess=fastdata.ResizeCenterCrop(8)) == [
        "decoding and resizing repeat every epoch: pass cache= to ShardedDataset"]


def test_advise_names_a_report_of_the_wrong_type():
    from fastdata.monitor import advise

    with pytest.raises(TypeError, match="report must be a StallReport"):
        advise(StallMeter(), None)  # an AttributeError: no attribute 'loader_bound'
