import subprocess
import sys

import pytest

import fastdata
from fastdata.cli import main


def test_public_names_resolve_and_are_sorted():
    assert fastdata.__all__ == sorted(fastdata.__all__)
    for name in fastdata.__all__:
        assert getattr(fastdata, name) is not None


def test_inspect_summarises_a_shard_folder(tmp_path, capsys):
    with fastdata.ShardWriter(tmp_path / "s", max_samples=3) as w:
        for i in range(7):
            w.write({"__key__": f"k{i:03d}", "txt": f"sample {i}", "cls": i % 2})
    assert main(["inspect", str(tmp_path / "s"), "--shards"]) == 0
    out = capsys.readouterr().out
    assert "samples     7" in out and "shards      3" in out
    assert "shard-000002.tar" in out


def test_inspect_bad_folder_is_one_line_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fastdata inspect: error:") and "missing" in err


def test_doctor_runs():
    out = subprocess.run([sys.executable, "-m", "fastdata", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "package torch" in out.stdout and "shared memory" in out.stdout


def test_demo_before_after_table(tmp_path, capsys):
    import json

    out_json = tmp_path / "demo.json"
    assert main(["demo", "--dir", str(tmp_path / "w"), "--images", "48", "--workers", "0", "--epochs", "2",
                 "--batch-size", "16", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "generating photo-like JPEGs" in out and "48/48" in out  # progress during generation
    assert "checksums verified" in out
    for row in ("torch DataLoader, tuned", "fastdata, uncached", "fastdata, cached"):
        assert row in out
    assert "images/s" in out and "input wait" in out and "speed-up" in out and "1.00x" in out
    res = json.loads(out_json.read_text())
    assert [r["pipeline"] for r in res["rows"]] == ["torch DataLoader, tuned", "fastdata, uncached", "fastdata, cached"]
    assert all(r["images_per_s"] > 0 and 0 <= r["wait_share"] <= 1 for r in res["rows"])
    assert all(len(r["timeline"]) == 3 for r in res["rows"])  # one measured epoch of 48 // 16 steps
    assert res["rows"][-1]["note"] == "last epoch: cached path"
    assert res["settings"]["workers"] == 0 and res["machine"]["device"] == "cpu"


def test_demo_prints_no_paths_of_its_temporary_folder(capsys, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where TemporaryDirectory creates the folder
    assert main(["demo", "--images", "32", "--workers", "0", "--epochs", "1", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) not in out and "fastdata-demo-" not in out
    # removed (torch's first optimiser step in a process can leave its own torchinductor_<user> cache folder here)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastdata {fastdata.__version__}"


def _options(parser, prefix=()):
    """(command path, action) for every option and positional of ``parser`` and its subcommands."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*prefix, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield prefix, action


def test_every_option_of_every_command_has_help_with_its_default():
    """What the README promises: ``--help`` on every command lists its options with their defaults."""
    from fastdata.cli._main import build_parser

    checked = 0
    for path, action in _options(build_parser()):
        where = " ".join(path) + " " + (action.option_strings[-1] if action.option_strings else action.dest)
        assert action.help, f"{where}: no help text"
        if action.option_strings and not action.required:
            assert "default" in action.help, f"{where}: help does not state the default: {action.help!r}"
        checked += 1
    assert checked >= 50


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--images", "abc"], "argument --images: expected an integer >= 1, got 'abc'"),
    (["demo", "--images", "0"], "argument --images: expected an integer >= 1, got 0"),
    (["demo", "--workers", "-1"], "argument --workers: expected an integer >= 0, got -1"),
    (["demo", "--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
    (["inspect", "x", "--show-skipped", "many"], "argument --show-skipped: expected an integer >= 0, got 'many'"),
    (["cache", "build", "src", "--cache", "c", "--max-bytes", "lots"], "argument --max-bytes:"),
    (["cache", "build", "src", "--cache", "c", "--size", "1.5"], "argument --size: expected an integer >= 1"),
])
def test_argument_errors_name_the_option_not_internal_functions(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "_positive" not in err and "_nonneg" not in err and "positive_int" not in err
    assert "invalid" not in err.replace("invalid choice", "")


def test_demo_rejects_fewer_images_than_a_batch(capsys):
    assert main(["demo", "--images", "8", "--batch-size", "16"]) == 1
    assert "--images (8) must be at least --batch-size (16)" in capsys.readouterr().err


def test_demo_gpu_decode_row_runs_on_the_cpu_path(tmp_path, capsys):
    """The device-decode row's code (image_decode='device' + DecodeImages) on the CPU, tiny data."""
    import torch

    from fastdata.cli._demo import _make_shards, _run_pipelines

    shards, _ = _make_shards(tmp_path, 16, 0)
    torch.set_num_threads(1)
    rows = _run_pipelines(tmp_path, shards, device=torch.device("cpu"), model_name="small", batch_size=8,
                          workers=0, epochs=2, gpu_decode=True)
    torch.set_num_threads(2)
    out = capsys.readouterr().out
    assert "not measured" not in out
    assert [r.pipeline for r in rows][-1] == "fastdata, GPU decode" and rows[-1].images_per_s > 0


def test_no_typed_option_of_any_command_names_an_internal_function(capsys):
    """Every option with a type=, in every command: a bad value names the option, not a function."""
    import re

    from fastdata.cli._main import build_parser

    checked = 0
    parser = build_parser()
    for path, action in _options(parser):
        if not action.option_strings or action.type is None or action.choices:
            continue
        try:  # parse only: a value the type accepts must not run the command
            parser.parse_args([*path, action.option_strings[-1], "not-a-value"])
        except SystemExit:
            pass
        err = capsys.readouterr().err
        if f"argument {'/'.join(action.option_strings)}:" not in err:
            continue  # the type took the text (e.g. a path); argparse complained about something else
        names = re.findall(r"invalid (\S+) value", err)
        assert not any("_" in n for n in names), f"{' '.join(path)} {action.option_strings[-1]}: {err.strip()}"
        checked += 1
    assert checked >= 10


def test_plot_draws_throughput_and_stall_timeline(tmp_path):
    """benchmarks/plot.py on a demo JSON (from a tiny run) and a loader_throughput-shaped JSON."""
    import importlib.util
    import json
    from pathlib import Path

    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot", Path(__file__).resolve().parents[1] / "benchmarks/plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    demo = tmp_path / "demo.json"
    assert main(["demo", "--dir", str(tmp_path / "w"), "--images", "32", "--workers", "0", "--epochs", "2",
                 "--batch-size", "16", "--json", str(demo)]) == 0
    loader = tmp_path / "loader.json"
    loader.write_text(json.dumps({"benchmark": "loader_throughput", "config": {"workers": 2, "batch_size": 64},
                                  "machine": {"cpus": 2, "torch": "x"},
                                  "results": {"fastdata": {"images_per_s": 5.0}, "webdataset": {"images_per_s": 4.0}}}))
    written = plot.main(["--out", str(tmp_path / "png"), str(demo), str(loader)])
    assert sorted(p.name for p in written) == ["stall_timeline_demo.png", "throughput_demo.png",
                                               "throughput_loader_throughput.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    bad = tmp_path / "bad.json"
    bad.write_text('{"benchmark": "other"}')
    with pytest.raises(SystemExit, match="not a known benchmark JSON"):
        plot.main(["--out", str(tmp_path / "png"), str(bad)])


def test_demo_model_without_a_working_torchvision_says_why(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchvision(name, *args, **kwargs):
        if name.startswith("torchvision"):
            raise ImportError("No module named 'torchvision'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchvision)
    assert main(["demo", "--images", "16", "--batch-size", "16", "--workers", "0", "--model", "resnet18"]) == 1
    out = capsys.readouterr()
    assert "--model resnet18: torchvision is not installed" in out.err
    assert "generating" not in out.out  # refused before any work
