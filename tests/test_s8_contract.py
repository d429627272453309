"""Session 8, helper "contract": the public contract against the code (bad arguments, half-done work)."""
import json
import math

import numpy as np
import pytest
import torch

import fastdata
from fastdata.cli import main
from fastdata.monitor import DoctorOptions, StallMeter, diagnose, find_periodic_stalls, measure_h2d, search_batch_size
from fastdata.train import TrainStep, evaluate, load_checkpoint, save_checkpoint


@pytest.fixture
def array_shards(tmp_path):
    """8 samples of a stored uint8 (3, 8, 8) image and a class label, in one tar shard."""
    with fastdata.ShardWriter(tmp_path / "s") as w:
        for i in range(8):
            w.write({"__key__": f"k{i:03d}", "img.npy": np.full((3, 8, 8), i, np.uint8), "cls": i % 2})
    return tmp_path / "s"


def _step() -> TrainStep:
    model = torch.nn.Linear(4, 3)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)


# ----------------------------------------------------------------------------------------------- CLI paths

@pytest.mark.parametrize("argv", [
    ["doctor", "", "--step-ms", "5"],   # an AttributeError traceback: '' was taken for "no SHARDS"
    ["shard", "SRC", ""],               # wrote the shards into the current folder
    ["shard", "", "out"],               # converted the current folder
    ["verify", ""],                     # ": manifest.json: no manifest found"
    ["inspect", ""],
    ["tune", "", "--step-ms", "5"],
    ["bench", ""],
    ["cache", "build", "", "--cache", "c"],
    ["cache", "rm", "", "--cache", "c"],  # named the API's argument, fingerprint_or_prefix
])
def test_an_empty_path_argument_is_an_argument_error(argv, tmp_path, monkeypatch, capsys):
    # an empty path is an unset shell variable ($DEST), never the current folder
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SRC" / "a").mkdir(parents=True)
    (tmp_path / "SRC" / "a" / "x.jpg").write_bytes(b"not read")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected a non-empty" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SRC"]  # nothing written


def test_bench_leaves_no_work_folder_behind_when_shards_are_bad(tmp_path, capsys):
    (tmp_path / "notshards").write_text("{}")
    assert main(["bench", str(tmp_path / "missing"), "--dir", str(tmp_path / "w" / "sub")]) == 1
    assert "no manifest found" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # the folder was created, then the command failed


# ----------------------------------------------------------------------------------------------- monitor

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


def test_diagnose_and_tune_name_options_of_the_wrong_type(array_shards):
    from fastdata.monitor import tune

    with pytest.raises(TypeError, match="opts must be a fastdata.monitor.DoctorOptions, got NoneType"):
        diagnose(array_shards, None)
    with pytest.raises(TypeError, match="start must be a fastdata.monitor.DoctorOptions, got dict"):
        tune(array_shards, {"step_ms": 5})
    with pytest.raises(ValueError, match="batch_limit must be an int >= 1, got True"):
        tune(array_shards, DoctorOptions(step_ms=5), batch_limit=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_stalls=0), "min_stalls must be an int >= 1"),   # an IndexError
    (dict(min_stalls=1.5), "min_stalls must be an int >= 1"),
    (dict(min_stall_s=-1.0), "min_stall_s must be a finite number >= 0"),
    (dict(min_stall_s=math.nan), "min_stall_s must be a finite number >= 0"),
])
def test_find_periodic_stalls_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_periodic_stalls([0.001] * 20, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpu_interval_s=True), "gpu_interval_s must be > 0, got True"),
    (dict(gpu_interval_s=math.inf), "gpu_interval_s must be > 0, got inf"),
    (dict(sample_gpu="no"), "sample_gpu must be a bool"),
])
def test_stall_meter_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StallMeter(**kwargs)


def test_advise_names_a_report_of_the_wrong_type():
    from fastdata.monitor import advise

    with pytest.raises(TypeError, match="report must be a StallReport"):
        advise(StallMeter(), None)  # an AttributeError: no attribute 'loader_bound'


def test_search_batch_size_checks_its_callables_before_searching():
    calls = []
    with pytest.raises(ValueError, match="after_oom must be callable or None"):
        search_batch_size(calls.append, after_oom=True)  # only failed at the first out-of-memory
    with pytest.raises(ValueError, match="fits must be callable"):
        search_batch_size(None)
    with pytest.raises(ValueError, match=r"headroom must be in \[0, 1\), got True"):
        search_batch_size(calls.append, headroom=True)
    assert calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_measure_h2d_without_cuda_says_so():
    with pytest.raises(fastdata.FastdataError, match="measure_h2d needs a CUDA device"):
        measure_h2d(1000, repeats=1)  # torch's AssertionError "Torch not compiled with CUDA enabled"


# ----------------------------------------------------------------------------------------------- train

@pytest.mark.parametrize("kwargs, match", [
    (dict(compile="no"), "compile must be a bool"),  # 'no' compiled the model
    (dict(input_key=None), "input_key must be a str"),
    (dict(target_key=["cls"]), "target_key must be a str"),
])
def test_trainstep_checks_compile_and_keys(kwargs, match):
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=match):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy, **kwargs)


def test_evaluate_names_its_model_and_batches_arguments():
    model = torch.nn.Linear(4, 3)
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    with pytest.raises(ValueError, match="model must be a torch.nn.Module, got str"):
        evaluate("resnet18", [batch])  # an AttributeError: 'str' object has no attribute 'parameters'
    with pytest.raises(ValueError, match="batches must be iterable, got int"):
        evaluate(model, 5)  # "iterable must be iterable", the prefetcher's argument


@pytest.mark.parametrize("state, match", [
    ({}, r"state must be a TrainStep.state_dict\(\) \(scaler, micro, steps, rng\), got \[\]"),  # zeroed the counters
    ({"epoch": 1, "positions": [3]}, "state must be a TrainStep.state_dict"),  # a loader's state, taken silently
    (None, "state must be a TrainStep.state_dict.*got NoneType"),  # an AttributeError
    ({"scaler": None, "micro": 0, "steps": "x", "rng": None}, "state has steps='x'"),  # int('x')
    ({"scaler": None, "micro": 0, "steps": "5", "rng": None}, "state has steps='5'"),  # taken as 5
    ({"scaler": None, "micro": 0, "steps": 1, "rng": {"gpu": 1}}, "state has rng="),
])
def test_trainstep_load_state_dict_refuses_another_objects_state(state, match):
    step = _step()
    step.steps = 7
    with pytest.raises(ValueError, match=match):
        step.load_state_dict(state)
    assert step.steps == 7  # nothing restored


@pytest.mark.parametrize("extra, match", [
    ("", "extra must be a mapping"),       # saved as {}
    ("x", "extra must be a mapping"),      # "dictionary update sequence element #0 has length 1"
    (5, "extra must be a mapping"),
])
def test_save_checkpoint_extra_must_be_a_mapping(extra, match, tmp_path):
    with pytest.raises(fastdata.CheckpointError, match=match):
        save_checkpoint(tmp_path / "ck.pt", _step(), extra=extra)
    assert list(tmp_path.iterdir()) == []


def test_save_checkpoint_over_a_folder_names_it(tmp_path):
    (tmp_path / "ck.pt").mkdir()
    with pytest.raises(fastdata.CheckpointError, match=r"ck.pt is a folder"):
        save_checkpoint(tmp_path / "ck.pt", _step())
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_load_checkpoint_checks_its_arguments_before_restoring_anything(tmp_path):
    class Loader:
        def state_dict(self):
            return {"pos": 3}

    save_checkpoint(tmp_path / "ck.pt", _step(), loader=Loader(), epoch=1)
    fresh = _step()
    before = fresh.module.weight.detach().clone()
    with pytest.raises(fastdata.CheckpointError, match="loader must have a load_state_dict"):
        load_checkpoint(tmp_path / "ck.pt", fresh, loader=object())
    assert torch.equal(fresh.module.weight, before)  # the model was restored, then the call failed
    with pytest.raises(fastdata.CheckpointError, match="step must be a fastdata.TrainStep, got Linear"):
        load_checkpoint(tmp_path / "ck.pt", torch.nn.Linear(4, 3), loader=Loader())


# ----------------------------------------------------------------------------------------------- manifest

@pytest.mark.parametrize("shape", [b"ab", "", 3])
def test_field_info_shape_must_be_a_sequence_of_ints(shape):
    with pytest.raises(ValueError, match="FieldInfo.shape of field 'x' must be a tuple or list"):
        fastdata.FieldInfo("x", "array", dtype="uint8", shape=shape)  # b'ab' was the shape (97, 98)


def test_manifest_that_is_not_text_says_so(array_shards):
    with pytest.raises(fastdata.ManifestError, match=r"shard-000000.tar: not a manifest.json \(not UTF-8 text"):
        fastdata.Manifest.load(array_shards / "shard-000000.tar")


def test_the_shard_tool_refuses_an_empty_path(tmp_path, monkeypatch, capsys):
    from fastdata.cli._shard_cmd import tool_main

    monkeypatch.chdir(tmp_path)
    assert tool_main([str(tmp_path), ""]) == 2
    assert tool_main(["--verify", ""]) == 2
    assert capsys.readouterr().err.count("expected a non-empty path") == 2


def test_subpackages_named_in_the_docs_are_reachable_after_import_fastdata():
    import subprocess
    import sys

    # fastdata.train.accuracy (README), fastdata.monitor.search_batch_size: "module 'fastdata' has no attribute"
    # unless something had imported the subpackage first. Light modules here: torch's import takes seconds.
    code = ("import fastdata, sys; m = fastdata.manifest.Manifest; e = fastdata.errors.FastdataError; "
            "s = fastdata.io.is_url; assert 'torch' not in sys.modules; "
            "assert fastdata.manifest is sys.modules['fastdata.manifest']")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="module 'fastdata' has no attribute 'nosuch'"):
        fastdata.nosuch  # noqa: B018


def test_manifest_load_names_a_url_as_given(array_shards, capsys):
    with pytest.raises(fastdata.ManifestError, match=r"^s3://bucket/ds: a URL; Manifest.load reads a local folder"):
        fastdata.Manifest.load("s3://bucket/ds")  # "s3:/bucket/ds: no manifest found"
    assert fastdata.Manifest.load(f"file://{array_shards}").num_samples == 8
    assert main(["doctor", "https://host/ds/", "--step-ms", "5"]) == 1
    assert "https://host/ds/: a URL" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    (dict(format_version=2), "Manifest.format_version must be an int in 1..1, got 2"),
    (dict(format_version=True), "Manifest.format_version must be an int in 1..1, got True"),
    (dict(extra=[1]), "Manifest.extra must be a dict, got list"),
    (dict(skipped=[{"file": "a.jpg"}]), r"Manifest.skipped\[0\] must have str 'source' and 'reason'"),
    (dict(shards=["shard-000000.tar"]), "Manifest.shards must hold ShardInfos, got 'shard-000000.tar'"),
    (dict(fields=["jpg"]), "Manifest.fields must hold FieldInfos, got 'jpg'"),  # an AttributeError
])
def test_manifest_refuses_what_it_could_not_load_back(kwargs, match, tmp_path):
    # each was saved, and Manifest.load of the folder then failed: a shard folder nothing could open
    with pytest.raises(ValueError, match=match):
        fastdata.Manifest(**{"format": "tar", "shards": (), "fields": (), **kwargs})
