"""doctor and tune with a decoder library on the CPU (TorchCodec, torchvision): measured through
fastdata.gpu.HostImageDecoder, and tune's printed configuration runs as written with it."""
from __future__ import annotations

import pytest
import torch

from fastdata.cli._synth import make_image_folder
from fastdata.manifest import Manifest
from fastdata.monitor import DoctorOptions, diagnose, pick_fields, python_snippet
from fastdata.shards.convert import ConvertOptions, convert

from tests.helpers.decoders import HOST_DECODERS

LIBRARIES = [b for b in HOST_DECODERS if b != "pillow"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    make_image_folder(root / "img", 16, num_classes=2, min_side=40, max_side=72, seed=1)
    convert(root / "img", root / "shards", ConvertOptions(samples_per_shard=8, workers=1, progress=False))
    return root / "shards"


@pytest.mark.parametrize("library", LIBRARIES)
def test_doctor_measures_a_library_decoder(shards, library):
    d = diagnose(shards, DoctorOptions(samples=16, batch_size=4, num_workers=0, size=32, job_steps=2, device="cpu",
                                       step_ms=0.1, decode=library))
    row = next(r for r in d.rows if r.name == "decode")
    assert row.capacity and row.capacity > 0 and library in row.detail


@pytest.mark.parametrize("library", LIBRARIES)
def test_tune_snippet_with_a_library_decoder_runs_as_printed(shards, library):
    opts = DoctorOptions(samples=16, batch_size=4, num_workers=0, size=32, device="cpu", decode=library)
    code = python_snippet(str(shards), opts, pick_fields(Manifest.load(shards)), torch.device("cpu"))
    assert f"HostImageDecoder({library!r})" in code and "torchvision.io" not in code
    namespace: dict = {}
    exec(compile(code, "<tune snippet>", "exec"), namespace)  # noqa: S102  the printed code runs as is
    with namespace["batches"] as batches:
        batch = next(iter(batches))
    assert batch["jpg"].shape == (4, 3, 32, 32)
