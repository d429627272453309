"""Session 9, helper 'newuser': what a brand-new user meets (packaging, README, `fastdata shard`)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_license_is_an_spdx_string():
    # setuptools deprecates `license = {text = ...}` and stops building such projects after 2027-02-18
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(meta["project"]["license"], str)
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(int(x) for x in re.search(r">=\s*([\d.]+)", setuptools).group(1).split(".")) >= (77,)


def test_sdist_holds_what_the_tests_need(monkeypatch):
    # setuptools puts tests/test*.py into the sdist by default, but not conftest.py or the helpers those
    # tests import, nor the tools, example and benchmarks they run: a third of them failed there
    filelist = pytest.importorskip("setuptools._distutils.filelist")
    monkeypatch.chdir(ROOT)
    files = filelist.FileList()
    files.set_allfiles([os.path.join(d, name) for top in ("tests", "tools", "examples", "benchmarks")
                        for d, _, names in os.walk(top) for name in names])  # not .git, build/ ...
    manifest_in = ROOT / "MANIFEST.in"
    for line in (manifest_in.read_text() if manifest_in.exists() else "").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            files.process_template_line(line)
    have = {f.replace(os.sep, "/") for f in files.files}
    need = [f"tests/{p.name}" for p in (ROOT / "tests").glob("*.py") if not p.name.startswith("test_")]
    need += ["tools/shard.py", "examples/train_ddp.py", "benchmarks/decode_stage.py"]
    assert "tests/conftest.py" in need
    assert [f for f in need if f not in have] == []
    assert not [f for f in have if f.endswith(".pyc")]


def test_readme_headline_loop_says_which_field_a_jpeg_folder_gets(tmp_path):
    # ImageNet's folders hold .JPEG files: their field is 'jpeg', and the headline loop (input_key="jpg",
    # Normalize(keys=["jpg"])) failed on the first batch although the README said it runs as written
    from PIL import Image

    from fastdata.shards.convert import ConvertOptions, convert

    (tmp_path / "src" / "n01").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "src" / "n01" / "x_1.JPEG")
    convert(tmp_path / "src", tmp_path / "out", ConvertOptions(workers=1, progress=False))
    from fastdata.manifest import Manifest

    assert [f.name for f in Manifest.load(tmp_path / "out").fields] == ["cls", "jpeg"]
    readme = (ROOT / "README.md").read_text()
    intro = readme[:readme.index("```python")].rstrip().rsplit("\n\n", 1)[-1]  # the paragraph before the headline loop
    assert "fastdata shard IMAGE_FOLDER shards/" in intro
    assert '"jpeg"' in intro and ".JPEG" in intro


def test_shard_script_takes_options_between_src_and_dest(tmp_path, capsys):
    # `fastdata shard SRC --quiet DEST` worked, `python tools/shard.py SRC --quiet DEST` said
    # "unrecognized arguments: DEST" although the README says both take the same options
    from PIL import Image

    from fastdata.cli._shard_cmd import tool_main

    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "src" / "a" / "x.jpg")
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    assert tool_main([src, "--samples-per-shard", "1", "--workers", "1", out, "--quiet"]) == 0
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert tool_main(["--workers", "1", "--verify", out]) == 0
    assert tool_main([src, "--workers", "1"]) == 2  # still one path short
    assert "expected SRC and DEST, got 1 path(s)" in capsys.readouterr().err


def test_readme_cpu_install_pairs_torch_with_its_decoders():
    # after `pip install torch --index-url .../whl/cpu` alone, installing fastdata pulled the newest
    # torchvision, whose `torch==` pin replaced the CPU torch with a CUDA build (pip's resolver, seen with
    # --dry-run: torchvision 0.29.1 and torch 2.14.1 over torch 2.13.0+cpu); TorchCodec's wheels name no torch
    readme = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if "download.pytorch.org/whl/cpu" in ln]
    assert re.search(r"pip install torch torchcodec torchvision --index-url", line)


def test_readme_h5py_block_runs_on_a_jpeg_folder(tmp_path, monkeypatch):
    # the block read f["jpg"] or else f["img.npy"]: a KeyError on the HDF5 shards of a .JPEG (ImageNet) folder
    pytest.importorskip("h5py")
    from PIL import Image

    from fastdata.shards.convert import ConvertOptions, convert

    (tmp_path / "src" / "n01").mkdir(parents=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "src" / "n01" / "x_1.JPEG")
    convert(tmp_path / "src", tmp_path / "shards-h5", ConvertOptions(format="hdf5", workers=1, progress=False))
    guide = (ROOT / "docs" / "guide" / "shards.md").read_text()
    (block,) = [b for b in re.findall(r"^```python\n(.*?)^```", guide, re.S | re.M) if b.startswith("import h5py")]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "docs/guide/shards.md h5py block", "exec"), namespace)
    assert bytes(namespace["first"][:2]) == b"\xff\xd8" and list(namespace["keys"]) == ["n01/x_1"]


# torch APIs fastdata uses and the torch release that added them: the declared floor must cover them
_TORCH_APIS = {"torch.accelerator": (2, 6), "torch.amp.GradScaler": (2, 3)}


def test_declared_torch_floor_covers_the_torch_apis_used():
    # pyproject said torch>=2.2, but DataLoader(pin_memory=True) on the thread and cached paths calls
    # torch.accelerator (torch 2.6): an AttributeError on torch 2.2-2.5
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\s*>=", d)]
    floor = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", torch_dep).group(1).split(".")[:2])
    source = "\n".join(p.read_text() for p in (ROOT / "fastdata").rglob("*.py"))
    used = {api: version for api, version in _TORCH_APIS.items() if api + "." in source or api + "(" in source}
    assert "torch.accelerator" in used
    assert {api: v for api, v in used.items() if v > floor} == {}
