"""``fastdata doctor``: stage attribution on synthetic loader-bound and compute-bound set-ups, JSON outputs."""
import json

import pytest

from fastdata.cli import main
from fastdata.monitor import DoctorOptions, diagnose
from fastdata.monitor._diagnose import TOGETHER

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from fastdata.cli._synth import make_image_folder
    from fastdata.shards.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("doctor")
    make_image_folder(root / "img", 48, num_classes=4, min_side=72, max_side=110, seed=0)
    convert(root / "img", root / "shards", ConvertOptions(samples_per_shard=16, workers=1, overwrite=True,
                                                           progress=False))
    return root / "shards"


def _opts(**kw):
    base = {"samples": 48, "batch_size": 8, "num_workers": 0, "size": 64, "job_steps": 10, "device": "cpu"}
    return DoctorOptions(**{**base, **kw})


def test_loader_bound_setup_is_classified(shards):
    # a 0.1 ms step against a loader decoding in one thread: thousands of times faster than the input
    d = diagnose(shards, _opts(step_ms=0.1))
    assert d.verdict == "loader-bound", d.recommendations
    assert d.wait_share > 0.5 and d.speedup_if_fed > 3
    inputs = {r.name for r in d.rows if r.input_stage}
    assert d.bound in inputs and d.bound != "training step"
    bound = next(r for r in d.rows if r.name == d.bound)
    singles = [r.capacity for r in d.rows if r.input_stage and r.capacity and r.name != TOGETHER]
    assert bound.capacity == min(singles) or (bound.name == TOGETHER
                                              and bound.capacity < 0.5 * d.measurements["loader_predicted"])
    assert d.recommendations[0].startswith("loader-bound: waited")
    assert d.measurements["cached"]["path"] == "cached"  # measured through the cached fast path
    scaling = d.measurements["scaling"]
    assert scaling["workers"][1] <= d.cores  # more workers are measured, never beyond the cores


def test_compute_bound_setup_is_classified(shards):
    # a 250 ms step against ~8 small images per batch: the loader has a >10x margin even on a busy machine
    d = diagnose(shards, _opts(step_ms=250, job_steps=5))
    assert d.verdict == "compute-bound", (d.wait_share, d.recommendations)
    assert d.bound == "training step" and d.wait_share < 0.1
    assert d.recommendations and d.recommendations[0].startswith("compute-bound")
    step = next(r for r in d.rows if r.name == "training step")
    assert 0 < step.capacity <= 8 / 0.25 * 1.01  # the step's 250 ms sleep is in its measure (a busy machine: longer)


def test_never_recommends_more_workers_than_cores(shards, monkeypatch):
    from fastdata.monitor import _stages

    monkeypatch.setattr(_stages, "cores", lambda: 1)
    d = diagnose(shards, _opts(step_ms=0.1, num_workers=1))
    assert d.cores == 1 and "scaling" not in d.measurements
    text = "\n".join(d.recommendations)
    assert "num_workers=1 already uses all 1 cores" in text
    assert "num_workers=2" not in text
    d = diagnose(shards, _opts(step_ms=0.1, num_workers=2, job_steps=4))  # more workers than cores: the cores measured
    assert d.measurements["scaling"]["workers"] == [2, 1]
    assert not any("num_workers=3" in r for r in d.recommendations)
    if d.verdict == "compute-bound":  # a busy machine can slow the 4 job steps enough: then no input advice
        assert len(d.recommendations) == 1 and d.recommendations[0].startswith("compute-bound"), d.recommendations
    else:
        assert any(r.startswith(("num_workers=1:", "num_workers=2 exceeds the 1 cores")) for r in d.recommendations), (
            d.verdict, d.recommendations)


def test_without_a_step_it_reports_input_capacity(shards):
    d = diagnose(shards, _opts())
    assert d.verdict == "input only" and d.job_rate is None and d.step_rate is None
    assert all(r.name != "training step" for r in d.rows)


def test_doctor_cli_table_and_json(shards, capsys):
    args = ["doctor", str(shards), "--step-ms", "0.1", "--samples", "32", "--batch-size", "8", "--workers", "0",
            "--size", "64", "--steps", "6", "--device", "cpu"]
    assert main(args) in (0, 1)  # 1 only if a required package is missing here
    out = capsys.readouterr().out
    assert "package torch" in out and "stage" in out and "verdict: LOADER-BOUND" in out
    assert "recommendations (each from a measurement above):" in out
    assert main([*args, "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["diagnosis"]["verdict"] == "loader-bound"
    assert {r["name"] for r in data["diagnosis"]["rows"]} >= {"shard read", "decode", "preprocess", "training step"}
    assert any(c["name"] == "package torch" for c in data["environment"])


def test_doctor_argument_errors_name_the_argument(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "x", "--step-ms", "abc"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --step-ms: expected a number > 0, got 'abc'" in err
    with pytest.raises(SystemExit):
        main(["doctor", "x", "--step-ms", "5", "--model", "resnet18"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["doctor", "/nonexistent/shards", "--step-ms", "1"]) == 1
    assert "fastdata doctor: error:" in capsys.readouterr().err


def test_inspect_json(shards, capsys):
    assert main(["inspect", str(shards), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_samples"] == 48 and data["total_bytes"] > 0 and data["format"] == "tar"


def test_cache_list_json(shards, tmp_path, capsys):
    import fastdata

    ds = fastdata.ShardedDataset(shards, fields=["jpg", "cls"], preprocess=fastdata.ResizeCenterCrop(32),
                                 cache=tmp_path / "cache")
    ds.build_cache()
    assert main(["cache", "list", "--cache", str(tmp_path / "cache"), "--json"]) == 0
    stores = json.loads(capsys.readouterr().out)
    assert len(stores) == 1 and stores[0]["num_samples"] == 48 and stores[0]["fill_ratio"] == 1.0
    assert main(["cache", "list", "--cache", str(tmp_path / "empty"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_bench_measures_given_shards_as_json(shards, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", str(shards), "--samples", "32", "--workers", "0", "--repeats", "1", "--size", "64",
                 "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(out.read_text())
    assert data["source"] == str(shards) and data["samples"] == 32 and data["raw_read"]["samples"] == 32
    assert data["decode_pipeline"]["images/s"] > 0 and data["cached_pipeline"]["images/s"] > 0


def test_hdf5_arrays_have_no_decode_or_preprocess_stage(tmp_path):
    import numpy as np

    import fastdata

    with fastdata.ShardWriter(tmp_path / "h5", format="hdf5", max_samples=16) as w:
        for i in range(32):
            w.write({"__key__": f"k{i:04d}", "img.npy": np.full((3, 40, 48), i, np.uint8), "cls": i % 3})
    d = diagnose(tmp_path / "h5", _opts(samples=32, step_ms=0.1, job_steps=4))
    rows = {r.name: r for r in d.rows}
    assert rows["decode"].capacity is None and rows["decode"].detail == "stored decoded"
    assert rows["preprocess"].capacity is None and "img.npy is stored as an array" in rows["preprocess"].detail
    assert rows["shard read"].capacity > 0 and rows[TOGETHER].capacity > 0
    assert d.verdict == "loader-bound" and d.bound != "decode"


def test_device_decode_is_measured_beside_cpu_decode(shards):
    # on the CPU DecodeImages decodes on the host: the plumbing a GPU run uses, measured the same way
    d = diagnose(shards, _opts(step_ms=0.1, job_steps=4, device_decode=True))
    gpu = d.measurements["gpu_decode"]
    assert gpu["images/s"] > 0 and gpu["cpu images/s"] > 0 and "image_decode='device'" in gpu["note"]
    assert d.measurements["nvjpeg_probe"]["images/s"] is None  # no CUDA: the probe says why, and nothing fails
    assert "no CUDA device" in d.measurements["nvjpeg_probe"]["note"]
    with pytest.raises(ValueError, match="doctor measures a CPU decode pipeline"):
        diagnose(shards, _opts(decode="device"))


def test_bench_without_shards_generates_a_set(tmp_path, capsys):
    assert main(["bench", "--images", "24", "--workers", "0", "--repeats", "1", "--size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # progress went to stderr: stdout is JSON only
    assert data["samples"] == 24 and data["cached_pipeline"]["speedup"] > 0


def test_unknown_model_fails_fast_with_a_clear_message(shards, capsys, monkeypatch):
    from fastdata.monitor import _stages

    def measured(*a, **k):
        raise AssertionError("doctor measured before checking its model")

    monkeypatch.setattr(_stages, "copy_subset", measured)  # the first measurement: the model fails before it
    assert main(["doctor", str(shards), "--model", "no_such_net", "--device", "cpu", "--samples", "16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fastdata doctor: error:") and "no_such_net" in err


def _recommend(lrun_rate, step_rate, p99_s, *, workers=2, cores=4, scaling=(300.0, 450.0), cached=900.0, depth=2,
               meas=None):
    from fastdata.monitor._diagnose import Diagnosis, StageRow, recommend
    from fastdata.monitor._stages import CpuCosts, LoaderRun
    from fastdata.monitor._stall import StallReport

    o = DoctorOptions(num_workers=workers, batch_size=32, depth=depth, step_ms=10)
    stall = StallReport(steps=50, wall_s=10.0, wait_s=5.0, wait_p50_s=0.01, wait_p99_s=0.2, first_wait_s=0.1)
    meas = dict(meas or {})
    if scaling:
        meas["scaling"] = {"workers": [workers, min(cores, 2 * workers)], "rate": list(scaling)}
    d = Diagnosis(o, "cpu", cores, [], "loader-bound", "decode", 100.0, step_rate, 0.5, step_rate / 100.0, [], meas, stall)
    lrun = LoaderRun(lrun_rate, 512, 0.01, p99_s, 0.0, "workers")
    crun = LoaderRun(cached, 512, 0.001, 0.002, 0.0, "cached")
    weakest = StageRow("decode", 300.0, 0.9, "cores", "Pillow")
    return recommend(d, lrun, crun, CpuCosts(0.003, 0.001, 0.0001, 64), weakest, workers)


def test_recommendations_quote_their_measurements():
    recs = _recommend(lrun_rate=300.0, step_rate=3200.0, p99_s=0.05)
    assert recs[0].startswith("loader-bound: waited 50%") and "decode (300 images/s)" in recs[0]
    assert any(r.startswith("num_workers=4: the loader measured 300 -> 450 images/s (1.50x)") for r in recs)
    assert any(r.startswith("cache= on ShardedDataset") and "900 images/s, 3.0x uncached (300)" in r for r in recs)
    assert any(r.startswith("a deeper prefetch queue would not help") for r in recs)
    recs = _recommend(lrun_rate=300.0, step_rate=3200.0, p99_s=0.05, scaling=(300.0, 310.0), cached=310.0)
    assert any(r.startswith("more workers did not help: 2 -> 4 workers measured 300 -> 310") for r in recs)
    assert not any("cache=" in r for r in recs)  # 3% faster from the cache is no reason to add one


def test_prefetch_depth_advice_follows_the_loader_rate():
    step = 32 / 0.010  # 10 ms steps of 32 images
    recs = _recommend(lrun_rate=1.2 * step, step_rate=step, p99_s=0.035)  # keeps up, 35 ms gaps
    depth = next(r for r in recs if r.startswith("prefetch depth"))
    assert depth.startswith("prefetch depth 2 -> 5: the loader keeps up on average")
    recs = _recommend(lrun_rate=0.95 * step, step_rate=step, p99_s=0.035)
    assert any("the loader is just slower than the step" in r and "cannot run faster" in r for r in recs)
    recs = _recommend(lrun_rate=2 * step, step_rate=step, p99_s=2.0)  # an epoch start: 200 steps long
    assert any(r.startswith("prefetch depth 2 -> 8") and "capped at 8" in r for r in recs)


def test_thread_decoder_is_measured_and_recommended_only_when_faster(shards):
    d = diagnose(shards, _opts(num_workers=1))
    threads = d.measurements["threads"]
    assert threads["decode_threads"] == 1 and threads["path"] == "threads" and threads["rate"] > 0
    advice = [r for r in d.recommendations if r.startswith("decode_threads=1 on DataLoader")]
    note = d.measurements.get("threads_note", "")
    assert bool(advice) != bool(note), (advice, note)  # one or the other, from the same two rates
    assert advice or note.startswith("thread decoder: decode_threads=1 measured")
    assert "threads" not in diagnose(shards, _opts(num_workers=0)).measurements  # in-process loading: nothing to compare

    def recs(threads_rate):
        return _recommend(lrun_rate=300.0, step_rate=3200.0, p99_s=0.05,
                          meas={"threads": {"decode_threads": 4, "rate": threads_rate}})

    faster = recs(420.0)
    assert any(r.startswith("decode_threads=4 on DataLoader: the thread decoder") and "420 images/s, 1.40x the 2 "
               "worker processes (300)" in r for r in faster), faster
    assert not any(r.startswith("decode_threads") for r in recs(320.0))  # within 10%: no advice
