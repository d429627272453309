"""``fastdata tune``: the batch-size search (with a fake memory limit) and the settings search on the
CPU; the snippet it prints builds the loader it measured."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fastdata
from fastdata.errors import FastdataError
from fastdata.monitor import DoctorOptions, search_batch_size


class FakeGPU:
    """A device with ``limit`` bytes: a step at batch b allocates ``fixed + b * per_sample`` or runs out of memory."""

    def __init__(self, limit, per_sample, fixed=0):
        self.limit, self.per_sample, self.fixed = limit, per_sample, fixed
        self.calls = []

    def __call__(self, b):
        self.calls.append(b)
        need = self.fixed + b * self.per_sample
        if need > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {need} bytes")
        torch.empty(need // 1000 + 1, dtype=torch.uint8)  # touch some memory like a real step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("limit,per_sample,fixed", [(1000, 3, 0), (10_000_000, 1000, 2_000_000), (64, 1, 0)])
def test_batch_search_grows_backs_off_and_leaves_headroom(limit, per_sample, fixed):
    gpu = FakeGPU(limit, per_sample, fixed)
    r = search_batch_size(gpu, start=32, limit=100_000, headroom=0.1, multiple=8)
    largest = (limit - fixed) // per_sample
    assert largest - 8 < r.largest_fit <= largest  # bisected to within the granularity
    assert r.first_oom is not None and r.first_oom > largest
    assert r.batch_size == max(1, int(r.largest_fit * 0.9) // 8 * 8) if r.largest_fit >= 8 else r.largest_fit
    assert r.batch_size <= 0.9 * r.largest_fit + 1e-9
    fits = [b for b, ok in r.tried if ok]
    assert all(b <= largest for b in fits) and all(b > largest for b, ok in r.tried if not ok)
    assert gpu.calls[: 3] == [32, 64, 128][: len(gpu.calls[:3])] or gpu.calls[0] == 32


@pytest.mark.timeout(300)
def test_batch_search_shrinks_when_the_start_does_not_fit_and_stops_at_the_limit():
    r = search_batch_size(FakeGPU(100, 1), start=1024, limit=4096)
    assert r.tried[0] == (1024, False) and 92 < r.largest_fit <= 100
    r = search_batch_size(FakeGPU(10**9, 1), start=32, limit=256, headroom=0.0)
    assert r.first_oom is None and r.largest_fit == 256 and r.batch_size == 256
    with pytest.raises(FastdataError, match="a batch of 1 does not fit"):
        search_batch_size(FakeGPU(10, 1, fixed=100), start=4)


@pytest.mark.timeout(300)
def test_batch_search_reraises_other_errors_and_checks_arguments():
    def broken(b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        search_batch_size(broken)
    with pytest.raises(ValueError, match="headroom must be in"):
        search_batch_size(FakeGPU(100, 1), headroom=1.0)
    with pytest.raises(ValueError, match="start must be an int >= 1, got 0"):
        search_batch_size(FakeGPU(100, 1), start=0)


@pytest.mark.timeout(300)
def test_batch_search_with_a_real_model_step_under_a_fake_memory_limit():
    """model_fits drives a real TrainStep; the fake limit turns large activations into out-of-memory."""
    from fastdata.monitor import _stages
    from fastdata.monitor._tune import model_fits

    fields = _stages.Fields("jpg", "cls", encoded=True)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 4))
    step = _stages.ModelStep(net, torch.device("cpu"), fields, num_classes=4)
    budget = 24 * 3 * 32 * 32 * 4  # bytes of float input: 24 images fit
    real = model_fits(step, 32, torch.device("cpu"))

    def fits(b):
        if b * 3 * 32 * 32 * 4 > budget:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake limit)")
        real(b)

    r = search_batch_size(fits, start=4, limit=256, multiple=4)
    assert r.largest_fit == 24 and r.batch_size == 20
    assert all(p.grad is None for p in step.model.parameters())  # no gradients left between tries


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from fastdata.cli._synth import make_image_folder
    from fastdata.shards.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("tune")
    make_image_folder(root / "img", 40, num_classes=4, min_side=72, max_side=110, seed=1)
    convert(root / "img", root / "shards", ConvertOptions(samples_per_shard=10, workers=1, overwrite=True,
                                                           progress=False))
    return root / "shards"


@pytest.mark.timeout(300)
def test_tune_cli_prints_ready_to_paste_python_that_runs(shards, capsys):
    from fastdata.cli import main
    from fastdata.monitor import cores

    assert main(["tune", str(shards), "--step-ms", "0.5", "--samples", "40", "--batch-size", "8", "--workers", "0",
                 "--size", "48", "--steps", "5", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["measured"] == "job" and data["start_rate"] > 0 and data["best_rate"] > 0
    threads_tried = {"decode_threads"} if data["trials"] and any(
        t["dimension"] == "decode_threads" for t in data["trials"]) else set()
    assert {t["dimension"] for t in data["trials"]} == {"decode", "num_workers", "depth"} | threads_tried
    assert max(t["value"] for t in data["trials"] if t["dimension"] == "num_workers") <= cores()
    assert data["best"]["num_workers"] <= cores() and data["best"]["batch_size"] == 8
    assert any("batch size: kept at 8" in n for n in data["notes"])
    namespace = {}
    exec(compile(data["python"], "<tune snippet>", "exec"), namespace)  # noqa: S102  the printed code runs as is
    batch = next(iter(namespace["batches"]))
    assert batch["jpg"].shape == (8, 3, 48, 48) and batch["jpg"].dtype == torch.float32
    namespace["batches"].close()
    assert main(["tune", str(shards), "--samples", "40", "--batch-size", "8", "--workers", "0", "--size", "48",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "measured on the loader alone" in out and "# the tuned configuration, ready to paste:" in out
    assert "tuned  num_workers=" in out


@pytest.mark.timeout(300)
def test_tune_tries_device_decode_and_its_snippet_runs(shards):
    from fastdata.manifest import Manifest
    from fastdata.monitor import DoctorOptions, pick_fields, python_snippet, tune

    start = DoctorOptions(samples=40, batch_size=8, num_workers=0, size=48, job_steps=4, device="cpu",
                          step_ms=0.5, device_decode=True)
    r = tune(shards, start)
    tried = [t for t in r.trials if t["dimension"] == "decode (input side)"]
    cpu = {t["value"] for t in r.trials if t["dimension"] == "decode"}  # Pillow and the library "auto" picks here
    assert "pil" in cpu and cpu <= {"pil", "torchcodec", "torchvision"}
    values = {t["value"] for t in tried}  # the CPU decoder measured fastest, against decoding on the device
    assert "device" in values and len(values - {"device"}) == 1 and values - {"device"} <= cpu
    # the best of the search, or the start when the final comparison measures the tuned settings no faster
    assert all(t["images/s"] > 0 for t in tried) and r.best.decode in values | {start.decode}
    fields = pick_fields(Manifest.load(shards))
    code = python_snippet(str(shards), dataclasses.replace(r.best, decode="device"), fields, torch.device("cpu"))
    assert "image_decode='device'" in code and "DecodeImages" in code
    namespace = {}
    exec(compile(code, "<tune snippet>", "exec"), namespace)  # noqa: S102
    with namespace["batches"] as batches:
        batch = next(iter(batches))
    assert batch["jpg"].shape == (8, 3, 48, 48) and batch["jpg"].dtype == torch.float32


@pytest.mark.timeout(300)
def test_tune_compares_the_thread_decoder_with_the_chosen_workers(shards, monkeypatch):
    """With workers chosen, the thread decoder on as many cores is measured against them (two rounds);
    it is taken only when more than 5% faster, and then the snippet's loader has decode_threads."""
    from fastdata.manifest import Manifest
    from fastdata.monitor import (
        DoctorOptions,
        _stages,
        pick_fields,
        python_snippet,
        tune,
    )

    real = _stages.time_loader

    def rigged(loader, **kw):  # threads measure 1.5x whatever workers measure: a clear win
        run = real(loader, **kw)
        if getattr(loader, "decode_threads", 0):
            run = dataclasses.replace(run, rate=run.rate * 1.5 + 1e6)  # far above any worker count's rate
        return run

    monkeypatch.setattr(_stages, "time_loader", rigged)
    start = DoctorOptions(samples=40, batch_size=8, num_workers=1, size=48, device="cpu")  # no step: the loader
    r = tune(shards, start)
    tried = [t for t in r.trials if t["dimension"] == "decode_threads"]
    assert len(tried) == 4 and {t["value"] for t in tried} == {0, r.best.num_workers}
    assert r.decode_threads == r.best.num_workers >= 1 and r.best_rate > r.start_rate
    fields = pick_fields(Manifest.load(shards))
    code = python_snippet(str(shards), r.best, fields, torch.device("cpu"), r.decode_threads)
    assert f"decode_threads={r.decode_threads}" in code and "persistent_workers" not in code
    namespace = {}
    exec(compile(code, "<tune snippet>", "exec"), namespace)  # noqa: S102  the printed code runs as is
    loader = namespace["loader"]
    assert loader.decode_threads == r.decode_threads
    batch = next(iter(namespace["batches"]))
    assert batch["jpg"].shape == (8, 3, 48, 48) and loader.last_path == "threads"
    namespace["batches"].close()


@pytest.mark.timeout(300)
def test_snippet_for_stored_arrays_has_no_image_preprocess_and_runs(tmp_path):
    """Stored arrays (img.npy) are not images: the pasted code must not claim a resize that does nothing."""
    import numpy as np

    from fastdata.manifest import Manifest
    from fastdata.monitor import DoctorOptions, pick_fields, python_snippet
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "arr", max_samples=8) as w:
        for i in range(16):
            w.write({"__key__": f"k{i:04d}", "img.npy": np.full((3, 8, 8), i, np.uint8), "cls": i % 3})
    fields = pick_fields(Manifest.load(tmp_path / "arr"))
    assert not fields.encoded
    code = python_snippet(str(tmp_path / "arr"), DoctorOptions(batch_size=4, num_workers=0, size=48, device="cpu"),
                          fields, torch.device("cpu"))
    assert "ResizeCenterCrop" not in code and "preprocess" not in code
    namespace = {}
    exec(compile(code, "<tune snippet>", "exec"), namespace)  # noqa: S102
    with namespace["batches"] as batches:
        batch = next(iter(batches))
    assert batch[fields.image].shape == (4, 3, 8, 8)


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


@pytest.mark.parametrize("decode,workers,threads", [("pil", 2, 0), ("pil", 1, 1), ("device", 1, 0)])
def test_tune_snippet_builds_the_loader_that_was_measured(jpeg_shards, decode, workers, threads):
    # doctor and tune measured an unshuffled dataset, without next-epoch preload and with drop_last=False,
    # while the code they print for pasting had shuffle=True, the default preload and drop_last=True
    from fastdata.manifest import Manifest
    from fastdata.monitor import DoctorOptions, pick_fields, python_snippet
    from fastdata.monitor._diagnose import _dataset, _loader
    from fastdata.transforms import ResizeCenterCrop

    o = DoctorOptions(batch_size=4, num_workers=workers, size=16, device="cpu", decode=decode)
    fields = pick_fields(Manifest.load(jpeg_shards))
    namespace: dict = {}
    exec(compile(python_snippet(str(jpeg_shards), o, fields, torch.device("cpu"), threads),  # noqa: S102
                 "<tune snippet>", "exec"), namespace)
    namespace["batches"].close()
    pasted = namespace["loader"]
    measured = _loader(_dataset(jpeg_shards, fields, ResizeCenterCrop(16), decode), 4, workers, threads)
    for name in ("batch_size", "num_workers", "decode_threads", "persistent_workers", "drop_last",
                 "preload_next_epoch"):
        assert getattr(measured, name) == getattr(pasted, name), name
    for name in ("shuffle", "fields", "image_decode", "seed"):
        assert getattr(measured.dataset, name) == getattr(pasted.dataset, name), name


def test_tune_says_why_no_decoder_could_be_measured(jpeg_shards, monkeypatch):
    # both CPU decoders failing on the measured images ended tune with "min() arg is an empty sequence"
    from fastdata.errors import DecodeError
    from fastdata.monitor import DoctorOptions, _stages, tune

    def fails(*args, **kwargs):
        raise DecodeError("shard-x.tar: sample 'k1' field 'jpg': OSError: broken")

    monkeypatch.setattr(_stages, "cpu_costs", fails)
    with pytest.raises(FastdataError, match=r"no CPU decoder.*pil: DecodeError: shard-x\.tar: sample 'k1'"):
        tune(jpeg_shards, DoctorOptions(samples=16, batch_size=4, num_workers=0, size=16, device="cpu"))


def test_search_batch_size_checks_its_callables_before_searching():
    calls = []
    with pytest.raises(ValueError, match="after_oom must be callable or None"):
        search_batch_size(calls.append, after_oom=True)  # only failed at the first out-of-memory
    with pytest.raises(ValueError, match="fits must be callable"):
        search_batch_size(None)
    with pytest.raises(ValueError, match=r"headroom must be in \[0, 1\), got True"):
        search_batch_size(calls.append, headroom=True)
    assert calls == []
