"""``fastdata demo``: the before/after table, its generated images and shards, the work folder."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdata.cli import main
from fastdata.cli._synth import make_image_folder
from fastdata.errors import FastdataError
from fastdata.manifest import Manifest
from fastdata.shards.convert import convert
from tests.helpers.sources import opts, synth_folder


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


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_image_folder_holds_exactly_the_images_asked_for(tmp_path):
    """`fastdata demo --dir D --images 64` then `--images 32` trained on 64 images (the table said 32):
    the generator kept every file of the earlier, larger run."""
    root = tmp_path / "images"
    synth_folder(root, 8)
    kept = (root / "class_00" / "img_000000.jpg").stat().st_mtime_ns
    synth_folder(root, 4)
    assert _files(root) == ["class_00/img_000000.jpg", "class_00/img_000002.jpg", "class_01/img_000001.jpg",
                            "class_01/img_000003.jpg"]
    assert (root / "class_00" / "img_000000.jpg").stat().st_mtime_ns == kept  # the same image: not redone
    first = (root / "class_00" / "img_000000.jpg").read_bytes()
    synth_folder(root, 4, seed=5)  # other arguments: other images
    assert len(_files(root)) == 4 and (root / "class_00" / "img_000000.jpg").read_bytes() != first
    (root / ".DS_Store").write_bytes(b"x")  # hidden files are nobody's class or image
    (root / "class_00" / ".DS_Store").write_bytes(b"x")
    synth_folder(root, 4)
    (root / "class_01" / "notes.txt").write_text("mine")
    with pytest.raises(FastdataError, match=r"holds class_01/notes.txt, which were not generated here"):
        synth_folder(root, 4)
    assert (root / "class_01" / "notes.txt").read_text() == "mine"
    many = tmp_path / "many"  # 3-digit class folders and 7-digit image numbers are the generator's own too
    make_image_folder(many, 105, num_classes=101, min_side=8, max_side=9)
    make_image_folder(many, 102, num_classes=101, min_side=8, max_side=9)
    assert len(_files(many)) == 102


def test_demo_shards_describe_the_images_asked_for(tmp_path, capsys):
    from fastdata.cli._demo import ImageFolderRecipe, _make_shards

    _make_shards(tmp_path, 6, 1)
    shards, m = _make_shards(tmp_path, 3, 1)
    assert m.num_samples == 3 and Manifest.load(shards).num_samples == 3
    (tmp_path / "images" / "class_00" / ".DS_Store").write_bytes(b"x")
    assert len(ImageFolderRecipe(tmp_path / "images")) == 3  # the tuned-DataLoader row reads the same 3
    assert "[2/4] 3 samples" in capsys.readouterr().out


def test_demo_and_bench_dir_refuse_a_folder_they_did_not_make(tmp_path, capsys):
    """`fastdata demo --dir D` replaced D/shards (overwrite=True) and deleted D/cache (rmtree): a user's
    own dataset and cache, under those natural names, were lost."""
    mine = tmp_path / "data"
    (mine / "cache").mkdir(parents=True)
    (mine / "cache" / "entry.bin").write_bytes(b"precious")
    argv = ["--images", "8", "--epochs", "1", "--batch-size", "8", "--workers", "0"]
    assert main(["demo", "--dir", str(mine), *argv]) == 1
    assert f"--dir {mine}: holds cache, which fastdata demo did not write" in capsys.readouterr().err
    assert main(["bench", "--dir", str(mine), "--images", "8", "--workers", "0", "--repeats", "1"]) == 1
    assert "which fastdata bench did not write" in capsys.readouterr().err
    assert (mine / "cache" / "entry.bin").read_bytes() == b"precious"
    from fastdata.cli._demo import WORKDIR_MARK, claim_workdir

    new = claim_workdir(tmp_path / "new" / "w", "demo")  # a new folder is claimed, then reused
    (new / "shards").mkdir()
    assert claim_workdir(new, "bench") == new
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / ".DS_Store").write_bytes(b"x")
    assert claim_workdir(hidden, "demo") == hidden
    old = tmp_path / "old"  # a demo's --dir from before the mark: its shards were converted from its images
    convert(synth_folder(old / "images", 2), old / "shards", opts())
    (old / "cache").mkdir()
    assert claim_workdir(old, "demo") == old
    (old / "notes.txt").write_text("mine")
    (old / WORKDIR_MARK).unlink()
    with pytest.raises(FastdataError, match="which fastdata demo did not write"):
        claim_workdir(old, "demo")


def test_demo_table_shows_no_first_epoch_time_without_a_warm_up_epoch():
    from fastdata.cli._demo import Row, _table

    rows = [Row("torch", "r", None, 100.0, 0.5, None, 1.0, True), Row("fastdata", "r", 2.5, 200.0, 0.1, None, 1.0, False)]
    lines = _table(rows, torch.device("cpu"))
    assert lines[2].rstrip().endswith("-") and "0.0s" not in lines[2]
    assert lines[3].rstrip().endswith("2.5s")


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
