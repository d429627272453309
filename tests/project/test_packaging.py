"""Packaging: the license, the sdist's contents, the declared torch floor against the APIs used."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_license_is_an_spdx_string():
    # setuptools deprecates `license = {text = ...}` and stops building such projects after 2027-02-18
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(meta["project"]["license"], str)
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(int(x) for x in re.search(r">=\s*([\d.]+)", setuptools).group(1).split(".")) >= (77,)


def test_sdist_holds_what_the_tests_need(monkeypatch):
    # setuptools puts only top-level tests/test*.py into the sdist by default, not the stages' folders
    # (tests/<stage>/), conftest.py or the helpers those tests import, nor the tools, example and
    # benchmarks they run: without MANIFEST.in most of the suite would be missing there
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
    # every Python file of the suite: the stages' tests and conftest.py files, tests/helpers/, ...
    need = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.py")
                  if "__pycache__" not in p.parts)
    need += ["tools/shard.py", "examples/train_ddp.py", "benchmarks/decode_stage.py"]
    assert {"tests/conftest.py", "tests/loader/conftest.py", "tests/helpers/remote.py",
            "tests/project/test_packaging.py"} <= set(need)
    assert [f for f in need if f not in have] == []
    assert not [f for f in have if f.endswith(".pyc")]


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
