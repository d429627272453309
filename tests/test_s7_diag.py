"""Session 7, helper "diag": defects found using TrainStep, evaluate, StallMeter, doctor, tune and the CLI."""
import dataclasses
import time

import numpy as np
import pytest
import torch

import fastdata
from fastdata.cli import main
from fastdata.monitor import (
    DoctorOptions,
    PeriodicStalls,
    StallMeter,
    StallReport,
    advise,
    diagnose,
)


@pytest.fixture
def array_shards(tmp_path):
    """16 samples of a stored uint8 (3, 8, 8) image and a class label, in 2 tar shards."""
    with fastdata.ShardWriter(tmp_path / "s", max_samples=8) as w:
        for i in range(16):
            w.write({"__key__": f"k{i:03d}", "img.npy": np.full((3, 8, 8), i, np.uint8), "cls": i % 2})
    return tmp_path / "s"


def _loader_bound() -> StallReport:
    return StallReport(steps=30, wall_s=1.0, wait_s=0.6, wait_p50_s=0.02, wait_p99_s=0.03, first_wait_s=0.0)


# ----------------------------------------------------------------------------------------------- StallMeter

def test_stall_percentiles_leave_out_the_first_batch_as_the_share_does():
    # 30 steps: worker start-up 0.5 s, then 4 ms waits against 6 ms steps. The p99 of a run under 100 steps
    # was the start-up wait itself, and the report advised "waits are spiky" on it.
    meter = StallMeter()
    meter.waits = [0.5] + [0.004] * 30
    meter.wall_s = 0.5 + 30 * 0.010
    rep = meter.report()
    assert rep.loader_bound and rep.first_wait_s == 0.5
    assert rep.wait_p99_s == pytest.approx(0.004) and rep.wait_p50_s == pytest.approx(0.004)
    assert not any("spiky" in a for a in rep.advice), rep.advice
    assert "p99 4.00 ms" in rep.summary()


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


# ----------------------------------------------------------------------------------------------- doctor/tune

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


# ----------------------------------------------------------------------------------------------- TrainStep

class _FailOnce(Exception):
    pass


def _flaky_sgd(model, fail_on=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    step = opt.step

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == fail_on:
            raise _FailOnce("optimizer step failed")
        return step(*a, **k)

    opt.step = flaky
    return opt, calls


def test_trainstep_recovers_from_a_failed_optimizer_step():
    # The micro-batch count stayed at grad_accum after the optimiser raised: no later call was ever the
    # last of an accumulation, so the optimiser never stepped again and gradients piled up for good.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt, calls = _flaky_sgd(model)
    step = fastdata.TrainStep(model, opt, torch.nn.functional.cross_entropy, grad_accum=2)
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    step(batch)
    with pytest.raises(_FailOnce):
        step(batch)
    assert step.micro_step == 0 and step.steps == 0
    assert all(p.grad is None for p in model.parameters())  # the failed accumulation's gradients are dropped
    for _ in range(4):
        step(batch)
    assert step.steps == 2 and len(calls) == 3 and step.micro_step == 0
    step.load_state_dict(step.state_dict())  # it refused micro=6 for grad_accum=2


def test_trainstep_failed_step_leaves_the_grad_scaler_usable():
    # with clipping the scaler unscales before the optimiser step; a failure there left it "already unscaled"
    model = torch.nn.Linear(4, 3)
    opt, calls = _flaky_sgd(model)
    step = fastdata.TrainStep(model, opt, torch.nn.functional.cross_entropy, clip_norm=1.0)
    step.scaler = torch.amp.GradScaler("cpu")  # fp16 needs CUDA: the same code path with a CPU scaler
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    with pytest.raises(_FailOnce):
        step(batch)
    assert torch.isfinite(step(batch)) and step.steps == 1 and len(calls) == 2


# ----------------------------------------------------------------------------------------------- evaluate

def test_evaluate_ignores_an_empty_batch():
    # an empty batch's mean loss is nan, and nan * 0 samples made the whole result nan
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    full = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    empty = (torch.randn(0, 4), torch.randint(0, 3, (0,)))
    kw = {"loss_fn": torch.nn.functional.cross_entropy,
          "metrics": {"acc": lambda o, t: fastdata.train.accuracy(o, t).mean()}}
    assert fastdata.evaluate(model, [full, empty], **kw) == fastdata.evaluate(model, [full], **kw)


def test_stall_report_inside_the_loop_counts_the_time_so_far(stall_clock):
    # report() ("what the waits measured so far say") inside the loop, e.g. to log every N steps, said
    # "not loader-bound: waited 0% of 0.00 s": the wall time was added only when the loop ended
    def slow():
        for i in range(12):
            stall_clock.sleep(0.01)
            yield i

    meter = StallMeter()
    for i, _ in enumerate(meter.wrap(slow())):
        stall_clock.sleep(0.001)
        if i == 9:
            rep = meter.report()
    assert rep.steps == 10 and rep.wall_s == pytest.approx(0.11) and rep.loader_bound, rep.summary()
    assert rep.wait_share == pytest.approx(0.09 / 0.1) and "of 0.00 s" not in rep.summary()  # the first wait apart
    end = meter.report()
    assert end.steps == 12 and end.wall_s > rep.wall_s and end.loader_bound


def test_trainstep_and_evaluate_keep_a_frozen_batchnorm_in_eval_mode():
    # fine-tuning with frozen BatchNorm statistics (model.train(); bn.eval()): every step called model.train(),
    # which put the BatchNorm back in train mode and updated its running statistics; evaluate restored only
    # the top-level mode, which did the same
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    model.train()
    model[1].eval()
    frozen = model[1].running_mean.clone()
    step = fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)
    batch = (torch.randn(8, 4) + 5, torch.randint(0, 3, (8,)))
    step(batch)
    assert model.training and not model[1].training and torch.equal(model[1].running_mean, frozen)
    fastdata.evaluate(model, [batch])
    assert model.training and not model[1].training and model[0].training
    model.eval()  # a model left in eval() mode as a whole is still trained in train() mode
    step(batch)
    assert model.training and model[1].training


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


def test_bench_does_not_claim_to_decode_and_resize_stored_arrays(array_shards, capsys):
    # `fastdata shard --resize` output (img.npy arrays) is read as stored; the row said "decode + ResizeCenterCrop(8)"
    argv = ["bench", str(array_shards), "--samples", "16", "--size", "8", "--repeats", "1", "--workers", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ResizeCenterCrop" not in out and "stored arrays, read as stored: no decode or resize" in out, out


def test_stall_meter_counts_a_nested_loop_once(monkeypatch, stall_clock):
    # a validation loop wrapped by the same meter inside the training loop: its time was added to the wall
    # time twice (inside the outer wrap and again as its own), so the wait share came out too low
    def slow(n):
        for i in range(n):
            stall_clock.sleep(0.01)
            yield i

    class Train:
        num_workers = 1

        def __iter__(self):
            return slow(6)

    from fastdata.monitor import _stall

    monkeypatch.setattr(_stall, "_cores", lambda: 4)
    meter = StallMeter()
    for i, _ in enumerate(meter.wrap(Train())):
        stall_clock.sleep(0.001)
        if i % 3 == 2:
            for _ in meter.wrap(slow(3)):
                stall_clock.sleep(0.001)
    rep = meter.report()
    assert rep.steps == 12 and rep.wall_s == pytest.approx(12 * 0.011), rep.wall_s  # the inner loop counted once
    # every step of both loops waits 10 of its 11 ms (the first wait, start-up, is reported apart)
    assert rep.wait_share == pytest.approx(11 * 0.01 / (12 * 0.011 - 0.01)), rep.summary()
    assert any(a.startswith("num_workers=1 on 4 cores") for a in rep.advice), rep.advice  # the outer loader's


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


def test_tune_batch_search_stays_within_the_samples_measured(array_shards, monkeypatch):
    # on a GPU with a model, the batch search went up to --max-batch (2048) over a 256-sample subset: a batch of
    # 1,840 was then "measured" as batches of 256 and recommended. Faked here: a CUDA-typed device and a model step.
    import types

    import fastdata.prefetch
    from fastdata.monitor import _stages, _tune

    class Searched(Exception):
        pass

    def search(fits, *, start, limit, after_oom):
        raise Searched(start, limit)

    monkeypatch.setattr(fastdata.prefetch, "resolve_device", lambda d: types.SimpleNamespace(type="cuda"))
    monkeypatch.setattr(_stages, "make_step", lambda *a: object.__new__(_stages.ModelStep))
    monkeypatch.setattr(_tune, "search_batch_size", search)
    with pytest.raises(Searched) as e:
        _tune.tune(array_shards, DoctorOptions(samples=64, batch_size=8, model="resnet18"), batch_limit=2048)
    assert e.value.args == (8, 16)  # the source has 16 samples


def test_search_batch_size_takes_the_cpu_allocators_failure_for_out_of_memory():
    # "DefaultCPUAllocator: can't allocate memory: ..." was raised as a failure of the step, not taken for "too big"
    from fastdata.monitor import search_batch_size

    def fits(b):
        if b > 64:
            torch.empty(2**50 * b, dtype=torch.uint8)  # beyond any address space: refused at once

    found = search_batch_size(fits, start=32, limit=4096)
    assert found.largest_fit == 64 and found.first_oom is not None and found.first_oom <= 128


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
])
def test_search_batch_size_takes_a_cublas_or_cudnn_workspace_failure_for_out_of_memory(message):
    # near the memory limit cuBLAS/cuDNN fail to allocate their workspace with these RuntimeErrors
    from fastdata.monitor import search_batch_size

    def fits(b):
        if b > 64:
            raise RuntimeError(message)

    assert search_batch_size(fits, start=32, limit=4096).largest_fit == 64


@pytest.mark.parametrize("argv", [["bench", "--dir", "{f}/sub"], ["demo", "--dir", "{f}/sub/deeper"],
                                  ["doctor", "--out", "{f}/x.json"]])
def test_folder_options_under_a_file_are_argument_errors(tmp_path, capsys, argv):
    # --dir afile/sub failed later with "[Errno 20] Not a directory: 'afile/sub'", naming no option; --out
    # afile/x.json said that the folder afile "does not exist"
    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        main([a.format(f=f) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {argv[1]}: " in err and f"{f} is not a folder" in err, err


def test_tune_from_a_decoder_that_cannot_load_fails_before_measuring(tmp_path, monkeypatch):
    # tune --decode torchvision without a working torchvision ran the whole search (minutes on real data) and
    # failed only when it measured the start at the end
    import io
    import sys

    from PIL import Image

    from fastdata.monitor import _stages, tune

    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="JPEG")
    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "jpg": buf.getvalue(), "cls": i % 2})
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision -> ImportError
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    from fastdata.gpu import _codec

    monkeypatch.setattr(_codec, "torchvision_status", _codec.torchvision_status.__wrapped__)  # not the cached answer

    def measured(*a, **k):
        raise AssertionError("tune measured before checking its start decoder")

    monkeypatch.setattr(_stages, "copy_subset", measured)
    with pytest.raises(fastdata.FastdataError, match="decode 'torchvision' needs torchvision"):
        tune(tmp_path / "s", DoctorOptions(samples=8, batch_size=4, num_workers=0, decode="torchvision",
                                           device="cpu"))


def test_stall_meter_counts_the_time_iter_takes_as_waiting(stall_clock):
    # a loader whose iter() does the start-up work (starts its threads or processes, lists files) had that
    # time counted as neither a wait nor the first batch: "not loader-bound: waited 0%, first batch 0.00 s"
    class SlowStart:
        def __iter__(self):
            stall_clock.sleep(0.15)
            return iter(range(10))

    meter = StallMeter()
    for _ in range(2):  # epoch 2's start-up counts as a wait of that epoch, as a worker restart would
        for _ in meter.wrap(SlowStart()):
            pass
    rep = meter.report()
    assert rep.first_wait_s == pytest.approx(0.15) and rep.wait_s == pytest.approx(0.3) and rep.loader_bound, \
        rep.summary()


def test_doctor_table_names_the_samples_it_measured(array_shards):
    # on a 16-sample set with the default --samples 512 the table said "first 512 samples"
    from fastdata.cli._doctor import format_diagnosis

    d = diagnose(array_shards, DoctorOptions(samples=512, batch_size=4, num_workers=0, device="cpu"))  # no step
    assert d.measurements["samples"] == 16
    assert format_diagnosis(d, "s")[0].startswith("stages of s: first 16 samples, batch 4")


def test_stall_meter_samples_the_gpu_once_over_a_nested_loop(monkeypatch):
    # each nested wrap started its own NVML sampler: the inner loop's window was sampled twice and weighed
    # twice in the utilisation mean
    from fastdata.monitor import _stall

    started = []

    class Sampler:
        def __init__(self, index, interval):
            started.append(index)

        def stop(self):
            return [50]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_stall, "GPUSampler", Sampler)
    meter = StallMeter(sample_gpu=True)
    for i in meter.wrap(range(4)):
        if i == 1:
            for _ in meter.wrap(range(3)):
                pass
    rep = meter.report()
    assert started == [0] and rep.gpu_util_samples == 1 and rep.gpu_util_mean == 50


@pytest.mark.parametrize("epochs", [1, 2])
def test_demo_summary_says_what_its_images_per_s_include(epochs, monkeypatch, capsys):
    # with --epochs 1 there is no warm-up epoch, yet the summary said "1st epoch = warm-up (worker start, cache
    # fill), not in images/s"; the pipelines are faked here, only the summary is checked
    from fastdata.cli import _demo

    def rows(*a, **k):
        return [_demo.Row(name, "", None if epochs == 1 else 1.0, rate, 0.5, None, 1.0, True)
                for name, rate in (("torch DataLoader, tuned", 100.0), ("fastdata, uncached", 200.0),
                                   ("fastdata, cached", 400.0))]

    monkeypatch.setattr(_demo, "_make_shards", lambda root, *a, **k: (root, None))
    monkeypatch.setattr(_demo, "_run_pipelines", rows)
    assert main(["demo", "--images", "16", "--batch-size", "8", "--epochs", str(epochs), "--model", "small"]) == 0
    out = capsys.readouterr().out
    assert ("not in images/s" in out) == (epochs > 1), out
    assert ("One epoch each: worker start and the cache fill are in images/s." in out) == (epochs == 1), out
