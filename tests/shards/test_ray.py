"""``--engine ray``: the conversion's shard jobs on a local 2-CPU Ray instance (127.0.0.1).

The output is byte-identical to the local engine's, and a conversion interrupted on the local
engine resumes on Ray (and the other way round) keeping the shards already written."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest


ray = pytest.importorskip("ray")

from fastdata.cli._synth import jpeg_bytes, synth_image  # noqa: E402
from fastdata.errors import ConversionError  # noqa: E402
from fastdata.shards import _progress  # noqa: E402
from fastdata.shards.convert import ConvertOptions, convert  # noqa: E402


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(3)
    for i in range(30):
        cls = root / f"c{i % 3}"
        cls.mkdir(exist_ok=True)
        (cls / f"{i:03d}.jpg").write_bytes(jpeg_bytes(synth_image(rng, 40, 32, cls=i % 3), 85))
    (root / "c0" / "broken.jpg").write_bytes(b"not an image")  # skipped, listed in the manifest
    return root


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("resize", [None, 16])
def test_ray_output_equals_local_byte_for_byte(ray_local, images, tmp_path, resize):
    local = convert(images, tmp_path / "local", ConvertOptions(samples_per_shard=7, workers=1, resize=resize,
                                                                shuffle=True, seed=5))
    on_ray = convert(images, tmp_path / "ray", ConvertOptions(samples_per_shard=7, workers=2, resize=resize,
                                                               shuffle=True, seed=5, engine="ray"))
    assert on_ray.written == local.written == 5 and len(on_ray.manifest.skipped) == 1
    a, b = _files(tmp_path / "local"), _files(tmp_path / "ray")
    assert list(a) == list(b) and all(a[k] == b[k] for k in a)


def test_interrupted_local_run_resumes_on_ray(ray_local, images, tmp_path, monkeypatch):
    opts = ConvertOptions(samples_per_shard=6, workers=1)
    real = _progress.ProgressState.record
    calls = []

    def record_then_stop(self, result):
        real(self, result)
        calls.append(result.number)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if Ctrl-C arrived after two shards

    monkeypatch.setattr(_progress.ProgressState, "record", record_then_stop)
    with pytest.raises(KeyboardInterrupt):
        convert(images, tmp_path / "out", opts)
    monkeypatch.setattr(_progress.ProgressState, "record", real)
    resumed = convert(images, tmp_path / "out", ConvertOptions(samples_per_shard=6, workers=2, engine="ray"))
    assert resumed.kept == 2 and resumed.written == len(resumed.manifest.shards) - 2 > 0
    convert(images, tmp_path / "ref", opts)
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_ray_task_error_reaches_the_driver(ray_local, images, tmp_path):
    with pytest.raises(ConversionError, match=r"broken\.jpg.*--strict"):
        convert(images, tmp_path / "strict", ConvertOptions(samples_per_shard=7, strict=True, engine="ray"))


def test_engine_is_validated():
    with pytest.raises(ValueError, match="engine must be one of"):
        ConvertOptions(engine="spark")


def test_missing_ray_is_a_clear_error(monkeypatch, images, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r"pip install 'fastdata\[ray\]'"):
        convert(images, tmp_path / "x", ConvertOptions(samples_per_shard=7, engine="ray"))
    assert not os.path.exists(tmp_path / "x" / "manifest.json")
