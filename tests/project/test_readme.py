"""What the README and guides promise a new user: the install line, which field a JPEG folder gets,
the h5py example."""
from __future__ import annotations

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


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
