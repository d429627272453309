"""``fastdata doctor``: stage attribution on synthetic loader-bound and compute-bound set-ups, JSON
outputs, and the measurements and messages it gives on odd shards and options."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata import gpu
from fastdata.cli import main
from fastdata.errors import FastdataError
from fastdata.gpu import _codec
from fastdata.monitor import DoctorOptions, diagnose, measure_h2d
from fastdata.monitor._diagnose import TOGETHER
from tests.helpers.decoders import unimportable
from tests.helpers.images import jpeg


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


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_compute_bound_setup_is_classified(shards):
    # a 250 ms step against ~8 small images per batch: the loader has a >10x margin even on a busy machine
    d = diagnose(shards, _opts(step_ms=250, job_steps=5))
    assert d.verdict == "compute-bound", (d.wait_share, d.recommendations)
    assert d.bound == "training step" and d.wait_share < 0.1
    assert d.recommendations and d.recommendations[0].startswith("compute-bound")
    step = next(r for r in d.rows if r.name == "training step")
    assert 0 < step.capacity <= 8 / 0.25 * 1.01  # the step's 250 ms sleep is in its measure (a busy machine: longer)


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_without_a_step_it_reports_input_capacity(shards):
    d = diagnose(shards, _opts())
    assert d.verdict == "input only" and d.job_rate is None and d.step_rate is None
    assert all(r.name != "training step" for r in d.rows)


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_inspect_json(shards, capsys):
    assert main(["inspect", str(shards), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_samples"] == 48 and data["total_bytes"] > 0 and data["format"] == "tar"


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_bench_measures_given_shards_as_json(shards, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", str(shards), "--samples", "32", "--workers", "0", "--repeats", "1", "--size", "64",
                 "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(out.read_text())
    assert data["source"] == str(shards) and data["samples"] == 32 and data["raw_read"]["samples"] == 32
    assert data["decode_pipeline"]["images/s"] > 0 and data["cached_pipeline"]["images/s"] > 0


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_device_decode_is_measured_beside_cpu_decode(shards):
    # on the CPU DecodeImages decodes on the host: the plumbing a GPU run uses, measured the same way
    d = diagnose(shards, _opts(step_ms=0.1, job_steps=4, device_decode=True))
    gpu = d.measurements["gpu_decode"]
    assert gpu["images/s"] > 0 and gpu["cpu images/s"] > 0 and "image_decode='device'" in gpu["note"]
    assert d.measurements["nvjpeg_probe"]["images/s"] is None  # no CUDA: the probe says why, and nothing fails
    assert "no CUDA device" in d.measurements["nvjpeg_probe"]["note"]
    with pytest.raises(ValueError, match="doctor measures a CPU decode pipeline"):
        diagnose(shards, _opts(decode="device"))


@pytest.mark.timeout(300)
def test_bench_without_shards_generates_a_set(tmp_path, capsys):
    assert main(["bench", "--images", "24", "--workers", "0", "--repeats", "1", "--size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # progress went to stderr: stdout is JSON only
    assert data["samples"] == 24 and data["cached_pipeline"]["speedup"] > 0


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_recommendations_quote_their_measurements():
    recs = _recommend(lrun_rate=300.0, step_rate=3200.0, p99_s=0.05)
    assert recs[0].startswith("loader-bound: waited 50%") and "decode (300 images/s)" in recs[0]
    assert any(r.startswith("num_workers=4: the loader measured 300 -> 450 images/s (1.50x)") for r in recs)
    assert any(r.startswith("cache= on ShardedDataset") and "900 images/s, 3.0x uncached (300)" in r for r in recs)
    assert any(r.startswith("a deeper prefetch queue would not help") for r in recs)
    recs = _recommend(lrun_rate=300.0, step_rate=3200.0, p99_s=0.05, scaling=(300.0, 310.0), cached=310.0)
    assert any(r.startswith("more workers did not help: 2 -> 4 workers measured 300 -> 310") for r in recs)
    assert not any("cache=" in r for r in recs)  # 3% faster from the cache is no reason to add one


@pytest.mark.timeout(300)
def test_prefetch_depth_advice_follows_the_loader_rate():
    step = 32 / 0.010  # 10 ms steps of 32 images
    recs = _recommend(lrun_rate=1.2 * step, step_rate=step, p99_s=0.035)  # keeps up, 35 ms gaps
    depth = next(r for r in recs if r.startswith("prefetch depth"))
    assert depth.startswith("prefetch depth 2 -> 5: the loader keeps up on average")
    recs = _recommend(lrun_rate=0.95 * step, step_rate=step, p99_s=0.035)
    assert any("the loader is just slower than the step" in r and "cannot run faster" in r for r in recs)
    recs = _recommend(lrun_rate=2 * step, step_rate=step, p99_s=2.0)  # an epoch start: 200 steps long
    assert any(r.startswith("prefetch depth 2 -> 8") and "capped at 8" in r for r in recs)


@pytest.mark.timeout(300)
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


def test_doctor_job_rate_leaves_out_the_first_step_as_it_leaves_out_the_first_batch(tmp_path):
    # run_job's rate is "images after the first batch over the time after it"; the time included the
    # first batch's step, so a slow first step (warm-up, compilation) made the job look slower than it is
    from fastdata.monitor import DoctorOptions
    from fastdata.monitor._diagnose import run_job

    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(16):
            w.write({"__key__": f"k{i:03d}", "x.npy": np.zeros(4, np.float32), "cls": i})
    calls = []

    def step(batch):
        calls.append(1)
        if len(calls) == 1:
            import time
            time.sleep(0.5)  # the first step only

    ds = fastdata.ShardedDataset(tmp_path / "s")
    rate, report = run_job(ds, DoctorOptions(batch_size=4, num_workers=0, job_steps=4), torch.device("cpu"), step, None)
    assert len(calls) == 4
    # 12 images after the first batch, three fast steps: far above 12 / 0.5 s = 24 images/s
    assert rate > 100, (rate, report)


def _mixed_shards(root):
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="JPEG")
    with fastdata.ShardWriter(root / "mixed") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "jpg": buf.getvalue(), "cls": i, "x.npy": np.zeros(3, np.float32)})
    return root / "mixed"


@pytest.mark.parametrize(("args", "message"), [
    (["--field", "cls"], "field 'cls' is not an image field"),
    (["--field", "x.npy"], "field 'x.npy' is not an image field"),
    (["--label", "jpg"], "label field 'jpg' is not a class label"),
    (["--label", "x.npy"], "label field 'x.npy' is not a class label"),
])
@pytest.mark.parametrize("command", ["doctor", "tune"])
def test_doctor_and_tune_check_what_field_and_label_name(tmp_path, capsys, command, args, message):
    # they failed deep inside with "cannot identify image file <_io.BytesIO ...>", "invalid literal for
    # int() with base 10: b'\xff\xd8...'", "min() arg is an empty sequence" or a TypeError traceback
    shards = _mixed_shards(tmp_path)
    assert main([command, str(shards), "--step-ms", "1", "--samples", "4", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith(f"fastdata {command}: error:"), err


def test_doctor_on_resized_tar_shards(tmp_path, capsys):
    # `fastdata shard --resize N` output (uint8 img.npy arrays in tar shards): the stage timing read
    # the arrays as raw .npy bytes and died with "TypeError: new(): invalid data type 'bytes'"
    src = tmp_path / "resized"
    with fastdata.ShardWriter(src, max_samples=8) as w:
        for i in range(16):
            w.write({"__key__": f"k{i:03d}", "img.npy": np.full((3, 12, 12), i, np.uint8), "cls": i % 3})
    code = main(["doctor", str(src), "--step-ms", "1", "--samples", "16", "--batch-size", "4", "--steps", "3",
                 "--workers", "0", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    import json
    diagnosis = json.loads(captured.out)["diagnosis"]
    assert diagnosis["job_rate"] > 0


def test_doctor_names_the_sample_whose_image_does_not_decode(tmp_path):
    import io

    from PIL import Image

    from fastdata.monitor import DoctorOptions, diagnose
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="JPEG")
    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "jpg": buf.getvalue() if i != 5 else b"\xff\xd8 not a jpeg", "cls": i})
    # was only "cannot identify image file <_io.BytesIO ...>"
    with pytest.raises(fastdata.DecodeError, match="sample 'k5' field 'jpg'"):
        diagnose(tmp_path / "s", DoctorOptions(step_ms=1, samples=8, num_workers=0))


def test_doctor_decode_torchvision_without_a_working_torchvision_says_so(tmp_path, monkeypatch):
    # the import failure surfaced as the first sample's decode error ("sample 'k0' field 'jpg':
    # RuntimeError: operator torchvision::nms does not exist" on a torchvision built for another torch)
    import io
    import sys

    from PIL import Image

    from fastdata.monitor import DoctorOptions, diagnose
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="JPEG")
    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "jpg": buf.getvalue(), "cls": i})
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision -> ImportError
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    from fastdata.gpu import _codec

    monkeypatch.setattr(_codec, "torchvision_status", _codec.torchvision_status.__wrapped__)  # not the cached answer
    with pytest.raises(fastdata.FastdataError, match="decode 'torchvision' needs torchvision") as e:
        diagnose(tmp_path / "s", DoctorOptions(step_ms=1, samples=4, num_workers=0, decode="torchvision"))
    assert "sample" not in str(e.value)


@pytest.mark.parametrize("command", ["doctor", "tune"])
def test_one_step_job_measurement_is_refused(tmp_path, capsys, command):
    # --steps 1 measured nothing (the first step is left out) and doctor then crashed formatting the
    # verdict: "TypeError: unsupported format string passed to NoneType.__format__"
    with pytest.raises(SystemExit) as e:
        main([command, str(tmp_path), "--step-ms", "1", "--steps", "1"])
    assert e.value.code == 2 and "argument --steps" in capsys.readouterr().err
    from fastdata.monitor import DoctorOptions
    with pytest.raises(ValueError, match="job_steps must be >= 2"):
        DoctorOptions(job_steps=1)


def test_doctor_refuses_fewer_samples_than_one_batch(array_shards, capsys):
    # --samples 10 --batch-size 32 measured 10-image batches, but the step rate was 32 / step time: the
    # verdict said "7.5x slower than it could" for a job that was not
    for cmd in ("doctor", "tune"):
        for samples, message in (
                ("64", "has only 16 samples, fewer than one batch (batch_size=32, --batch-size)"),
                ("10", "samples=10 (--samples) is fewer than one batch (batch_size=32, --batch-size)")):
            rc = main([cmd, str(array_shards), "--samples", samples, "--batch-size", "32", "--step-ms", "1",
                       "--device", "cpu"])
            err = capsys.readouterr().err
            assert rc == 1 and message in err and err.startswith(f"fastdata {cmd}: error:"), err
    with pytest.raises(fastdata.FastdataError, match="fewer than one batch"):
        diagnose(array_shards, DoctorOptions(samples=16, batch_size=32, step_ms=1, device="cpu"))


def test_doctor_tune_bench_accept_the_manifest_file_as_shards(array_shards, monkeypatch, capsys):
    # Manifest.load and ShardedDataset take the folder or its manifest.json; doctor, tune and bench read the
    # manifest and then failed with "shards/manifest.json/shard-000000.tar.idx: ... Not a directory"
    from fastdata.monitor import _stages, tune

    class Copied(Exception):
        pass

    def stop(source, read, samples, batch_size):
        assert read.samples == 16 and str(source) == str(array_shards)
        raise Copied

    monkeypatch.setattr(_stages, "check_one_batch", stop)  # called once the subset is copied: stop there
    opts = DoctorOptions(samples=16, batch_size=4, num_workers=0, step_ms=1, device="cpu")
    for run in (diagnose, tune):
        with pytest.raises(Copied):
            run(array_shards / "manifest.json", opts)
    argv = ["bench", str(array_shards / "manifest.json"), "--samples", "16", "--size", "8", "--repeats", "1",
            "--workers", "0", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    assert '"samples": 16' in capsys.readouterr().out


@pytest.mark.parametrize(("broken", "rc"), [("torchvision", 0), ("numpy", 1)])
def test_doctor_marks_a_package_that_does_not_load_as_a_warning(broken, rc, monkeypatch, capsys):
    # a torchvision built for another torch (--model and --decode torchvision then fail) was listed as
    # "ok   package torchvision   installed but does not load"; a broken optional package must not fail the run
    from fastdata.cli import _doctor

    monkeypatch.setattr(_doctor, "_version", lambda mod: (
        "installed but does not load (RuntimeError: operator torchvision::nms does not exist)" if mod == broken
        else "1.0"))
    check = next(c for c in _doctor.check_packages() if c.name == f"package {broken}")
    assert not check.ok and check.advice.startswith(f"reinstall {broken}")
    assert _doctor.run_doctor() == rc
    assert f"WARN package {broken}" in capsys.readouterr().out


def test_doctor_table_names_the_samples_it_measured(array_shards):
    # on a 16-sample set with the default --samples 512 the table said "first 512 samples"
    from fastdata.cli._doctor import format_diagnosis

    d = diagnose(array_shards, DoctorOptions(samples=512, batch_size=4, num_workers=0, device="cpu"))  # no step
    assert d.measurements["samples"] == 16
    assert format_diagnosis(d, "s")[0].startswith("stages of s: first 16 samples, batch 4")


def test_doctor_probe_measures_the_configured_device_decoder(monkeypatch):
    # probe_gpu_decode called torchvision.io.decode_jpeg whatever FASTDATA_DEVICE_DECODER / device_decoder said:
    # doctor's figure was torchvision's, and its note did not say which decoder it measured
    from fastdata.monitor import _stages as st

    jpegs = [jpeg(i, 16 + i, 12) for i in range(6)]
    monkeypatch.delenv("FASTDATA_DEVICE_DECODER", raising=False)
    auto = gpu.DecodeImages(device="cpu").resolved_device_decoder  # TorchCodec where it loads
    assert st.probe_gpu_decode(jpegs, torch.device("cpu")) == (None, f"no CUDA device (device decoder: {auto})")

    class OnTheCpu(gpu.DecodeImages):  # the stage a pipeline builds, run on the CPU where there is no GPU
        def __init__(self, *args, device=None, **kwargs):
            super().__init__(*args, device="cpu", **kwargs)

    monkeypatch.setattr(gpu, "DecodeImages", OnTheCpu)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    rate, note = st.probe_gpu_decode(jpegs, torch.device("cuda"))
    assert rate is not None and rate > 0 and note == f"DecodeImages with device decoder {auto} on the GPU"
    unimportable(monkeypatch, "nvidia.nvimgcodec")  # as if not installed
    monkeypatch.setattr(_codec, "nvimgcodec_status", _codec.nvimgcodec_status.__wrapped__)
    monkeypatch.setenv("FASTDATA_DEVICE_DECODER", "nvimgcodec")  # not installed: said, not another decoder's figure
    rate, note = st.probe_gpu_decode(jpegs, torch.device("cuda"))
    assert rate is None and "nvimgcodec" in note and "pip install" in note
    monkeypatch.setenv("FASTDATA_DEVICE_DECODER", "nvjpeg")
    rate, note = st.probe_gpu_decode(jpegs, torch.device("cuda"))
    assert rate is None and "FASTDATA_DEVICE_DECODER='nvjpeg'" in note


def _with_a_truncated_image(root, n: int = 24, bad: int = 20):
    import fastdata

    with fastdata.ShardWriter(root, max_samples=8) as w:
        for i in range(n):
            data = jpeg(i % 8, 16 + i % 8, 12)
            w.write({"__key__": f"k{i:03d}", "jpg": data[:60] if i == bad else data, "cls": i % 3})
    return root


def test_doctor_and_tune_name_the_users_shard_of_a_sample_that_does_not_load(tmp_path):
    # the measurements run over a copy of the first samples: a corrupt image among them failed doctor with
    # "/tmp/fastdata-doctor-.../subset/shard-000005.tar: sample 'k080' ..." (a temporary file, deleted), or,
    # among the first 64, with "sample 'k020' field 'jpg': ..." (no shard)
    from fastdata.manifest import Manifest
    from fastdata.monitor import _stages as st

    src = _with_a_truncated_image(tmp_path / "src")
    fields = st.pick_fields(Manifest.load(src))
    with pytest.raises(FastdataError, match=rf"{tmp_path}/src/shard-000002\.tar: sample 'k020' field 'jpg'"):
        st.copy_subset(src, tmp_path / "subset", fields, 24)
    # image fields of two formats (jpg or png): a bare KeyError 'jpg' with a traceback
    import fastdata
    from fastdata.errors import MissingFieldError

    with fastdata.ShardWriter(tmp_path / "mixed", max_samples=8) as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", ("jpg" if i % 2 else "png"): jpeg(i, 4, 3, format="PNG"), "cls": i})
    fields = st.pick_fields(Manifest.load(tmp_path / "mixed"))
    with pytest.raises(MissingFieldError, match=r"mixed/shard-000000\.tar: sample 'k0' has no field 'jpg'.*re-encode"):
        st.copy_subset(tmp_path / "mixed", tmp_path / "subset2", fields, 4)


@pytest.mark.parametrize("form", ["~/{name}", "~/{name}/manifest.json", "file://{path}", "file://{path}/manifest.json"])
def test_doctor_tune_and_bench_read_shards_given_with_tilde_or_file_url(jpeg_shards, monkeypatch, form):
    # the README: every local path argument reads ~ and file://; doctor, tune and bench read
    # "~/ok/shard-000000.tar.idx" (or "file:/tmp/.../manifest.json/...") literally
    from fastdata.monitor import _stages as st

    monkeypatch.setenv("HOME", str(jpeg_shards.parent))
    source = form.format(name=jpeg_shards.name, path=jpeg_shards)
    folder = st.shard_folder(source)
    assert str(folder) == str(jpeg_shards)
    fields = st.pick_fields(__import__("fastdata").Manifest.load(folder))
    assert st.copy_subset(folder, jpeg_shards.parent / "subset", fields, 4).samples == 4
    from fastdata.cli._bench import run_bench

    assert run_bench(source=source, workdir=str(jpeg_shards.parent / "bench"), num_images=0, samples=4,
                     num_workers=0, repeats=1, size=8, as_json=True) == 0


def test_doctor_says_it_measures_local_shards_when_given_a_url():
    from fastdata.errors import SourceError
    from fastdata.monitor import _stages as st

    with pytest.raises(SourceError, match=r"s3://bucket/ds: a URL; doctor, tune and bench measure a local shard folder"):
        st.shard_folder("s3://bucket/ds")


@pytest.mark.parametrize("kwargs, match", [
    (dict(step_ms=math.inf), "step_ms must be a finite number > 0"),   # measured 2 s, then an OverflowError
    (dict(step_ms=1e12), "step_ms must be a finite number > 0"),       # a 31-year sleep
    (dict(step_ms=True), "step_ms must be a finite number > 0"),
    (dict(field=0), "field must be a str or None"),
    (dict(label=b"cls"), "label must be a str or None"),
    (dict(model=["resnet18"]), "model must be a str or None"),
    (dict(device=0.5), "device must be a str or None"),
    (dict(device_decode="no"), "device_decode must be a bool or None"),
])
def test_doctor_options_refuse_values_of_the_wrong_kind(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DoctorOptions(**kwargs)


def test_diagnose_and_tune_name_options_of_the_wrong_type(one_array_shard):
    from fastdata.monitor import tune

    with pytest.raises(TypeError, match="opts must be a fastdata.monitor.DoctorOptions, got NoneType"):
        diagnose(one_array_shard, None)
    with pytest.raises(TypeError, match="start must be a fastdata.monitor.DoctorOptions, got dict"):
        tune(one_array_shard, {"step_ms": 5})
    with pytest.raises(ValueError, match="batch_limit must be an int >= 1, got True"):
        tune(one_array_shard, DoctorOptions(step_ms=5), batch_limit=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_measure_h2d_without_cuda_says_so():
    with pytest.raises(fastdata.FastdataError, match="measure_h2d needs a CUDA device"):
        measure_h2d(1000, repeats=1)  # torch's AssertionError "Torch not compiled with CUDA enabled"


def test_doctor_runs():
    out = subprocess.run([sys.executable, "-m", "fastdata", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "package torch" in out.stdout and "shared memory" in out.stdout
