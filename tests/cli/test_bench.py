"""``fastdata bench`` and the benchmark plot: given or generated shards, the work folder, --out and
--json."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata.cli._main import main
from fastdata.shards.convert import convert
from tests.helpers.sources import opts, synth_folder


def test_bench_out_file_is_written_before_stdout(tmp_path, capsys, monkeypatch):
    """`fastdata bench --json --out r.json | head -c 100`: the results were printed first, and the broken
    pipe ended the command before --out was written, after all the measuring."""
    import fastdata.cli._bench as bench

    dest = tmp_path / "out"
    convert(synth_folder(tmp_path / "src", 4), dest, opts(samples_per_shard=2))
    monkeypatch.setattr(bench, "measure", lambda *a, **kw: {"samples": 4, "measured": True})
    r, w = os.pipe()
    os.close(r)
    with open(w, "w", buffering=1) as out:  # line-buffered, as on a terminal: the print itself fails
        monkeypatch.setattr(sys, "stdout", out)
        assert main(["bench", str(dest), "--json", "--out", str(tmp_path / "r.json")]) == 1
        monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    assert '"measured": true' in (tmp_path / "r.json").read_text()


def test_bench_on_generated_data_names_no_deleted_folder(tmp_path, capsys, monkeypatch):
    """`fastdata bench` (no SHARDS, no --dir) reported "(64 samples of /tmp/fastdata-bench-x/shards, ...)",
    a temporary folder deleted before the line was printed."""
    import fastdata.cli._bench as bench
    import fastdata.cli._demo as demo

    def fake_shards(root, *a, **kw):
        convert(synth_folder(root / "images", 4), root / "shards", opts())
        return root / "shards", None

    monkeypatch.setattr(demo, "_make_shards", fake_shards)
    monkeypatch.setattr(bench, "measure", lambda source, **kw: {"source": str(source), "samples": 4})
    assert main(["bench", "--images", "4", "--json"]) == 0
    assert '"source": "4 generated photo-like JPEGs (in a temporary folder, deleted)"' in capsys.readouterr().out


def test_bench_dir_starts_with_an_empty_cache(tmp_path, capsys, monkeypatch):
    """`fastdata bench --dir D` kept every earlier run's cache entries in D/cache (one per dataset
    version, ~150 MB per 1024 images), piling up run after run."""
    import fastdata.cli._bench as bench

    dest, work = tmp_path / "out", tmp_path / "work"
    convert(synth_folder(tmp_path / "src", 4), dest, opts())
    seen = []
    monkeypatch.setattr(bench, "measure", lambda source, **kw: seen.append(sorted(
        p.name for p in (kw["workdir"] / "cache").glob("*"))) or {"source": str(source), "samples": 4})
    assert main(["bench", str(dest), "--dir", str(work), "--json"]) == 0
    (work / "cache").mkdir()
    (work / "cache" / "v1-old").mkdir()
    assert main(["bench", str(dest), "--dir", str(work), "--json"]) == 0
    assert seen == [[], []]


def test_plot_draws_throughput_and_stall_timeline(tmp_path):
    """benchmarks/plot.py on a demo JSON (from a tiny run) and a loader_throughput-shaped JSON."""
    import importlib.util
    import json
    from pathlib import Path

    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot", Path(__file__).resolve().parents[2] / "benchmarks/plot.py")
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


def test_bench_on_resized_shards_and_again_in_the_same_dir(tmp_path, capsys):
    # `fastdata shard --resize N` stores uint8 (3, N, N) arrays as img.npy: bench's copy of the first
    # --samples samples called every field "bytes", then found no image field; a rerun with the same
    # --dir failed on the copy left by the first ("pass overwrite=True")
    src = tmp_path / "resized"
    with fastdata.ShardWriter(src, max_samples=8) as w:
        for i in range(24):
            w.write({"__key__": f"k{i:03d}", "img.npy": np.full((3, 12, 12), i, np.uint8), "cls": i % 3})
    argv = ["bench", str(src), "--samples", "10", "--repeats", "1", "--size", "8", "--workers", "0",
            "--dir", str(tmp_path / "work")]
    for _ in range(2):
        assert main(argv) == 0, capsys.readouterr().err
        assert "cached pipeline" in capsys.readouterr().out
    copy = fastdata.Manifest.load(tmp_path / "work" / "subset")
    assert copy.num_samples == 10
    assert {f.name: f.kind for f in copy.fields} == {"img.npy": "array", "cls": "int"}


def test_bench_does_not_claim_to_decode_and_resize_stored_arrays(array_shards, capsys):
    # `fastdata shard --resize` output (img.npy arrays) is read as stored; the row said "decode + ResizeCenterCrop(8)"
    argv = ["bench", str(array_shards), "--samples", "16", "--size", "8", "--repeats", "1", "--workers", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ResizeCenterCrop" not in out and "stored arrays, read as stored: no decode or resize" in out, out


def test_bench_leaves_no_work_folder_behind_when_shards_are_bad(tmp_path, capsys):
    (tmp_path / "notshards").write_text("{}")
    assert main(["bench", str(tmp_path / "missing"), "--dir", str(tmp_path / "w" / "sub")]) == 1
    assert "no manifest found" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # the folder was created, then the command failed
