"""Session 9, helper left-a: DecodeImages' skip budget, doctor/tune measuring what they recommend, CLI messages."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.decoders import unimportable
from tests.helpers.images import jpeg
from fastdata import gpu
from fastdata.gpu import _codec
from fastdata.dataset import EncodedImage, collate
from fastdata.errors import FastdataError, SkipBudgetError


def _batch(datas: list[bytes], *, epoch: int = 0, first: int = 0, shard: str = "bad.tar") -> dict:
    return collate([{"png": EncodedImage(d, shard=shard, key=f"k{first + i}", index=first + i, epoch=epoch),
                     "cls": first + i} for i, d in enumerate(datas)])


# ----------------------------------------------------------------------------------- (a) skip budget

def test_decode_images_max_skips_caps_the_skips_of_an_epoch():
    # DecodeImages had no budget: a shard of bad images under on_error="skip" gave empty batches for a whole
    # epoch (each skip counted), whatever the dataset's max_skips said
    bad = b"\xff\xd8 not an image"
    dec = gpu.DecodeImages(device="cpu", on_error="skip", max_skips=2)
    out = dec(_batch([bad, jpeg(90, 4, 3, format="PNG"), bad]))  # 2 skips: within the budget
    assert out["cls"].tolist() == [1] and dec.num_skipped == 2
    assert dec.skipped[0]["epoch"] == 0
    with pytest.raises(SkipBudgetError, match=r"bad\.tar.*'k4'.*max_skips=2") as info:
        dec(_batch([jpeg(90, 4, 3, format="PNG"), bad], first=3))
    assert isinstance(info.value, FastdataError) and [r["key"] for r in info.value.skipped] == ["k0", "k2", "k4"]
    # another epoch counts from zero; a sample skipped again (a repeated pass over an epoch) counts once
    dec(_batch([bad, bad], epoch=1))
    dec(_batch([bad, bad], epoch=1))
    with pytest.raises(SkipBudgetError, match="epoch 1"):
        dec(_batch([bad], epoch=1, first=7))
    # a validation pipeline sharing the stage (its own epochs) does not reset the training epoch's count
    dec(_batch([bad, bad], epoch=2))
    dec(_batch([bad], epoch=7, shard="val.tar"))
    with pytest.raises(SkipBudgetError, match="epoch 2"):
        dec(_batch([bad], epoch=2, first=5))
    # "warn" is bounded too; None (default) has no limit
    warn = gpu.DecodeImages(device="cpu", on_error="warn", max_skips=0)
    with pytest.warns(Warning), pytest.raises(SkipBudgetError, match="'k0'"):
        warn(_batch([bad]))
    free = gpu.DecodeImages(device="cpu", on_error="skip")
    for e in range(3):
        free(_batch([bad] * 3, epoch=0, first=3 * e))
    assert free.num_skipped == 9


@pytest.mark.parametrize("value", [-1, True, 0.5, "3", 1.0])
def test_decode_images_max_skips_is_checked_when_built(value):
    with pytest.raises(ValueError, match=r"DecodeImages: max_skips"):
        gpu.DecodeImages(device="cpu", on_error="skip", max_skips=value)


# ----------------------------------------------------------------------------------- (b) doctor's decode probe

def test_doctor_probe_measures_the_configured_device_decoder(monkeypatch):
    # probe_gpu_decode called torchvision.io.decode_jpeg whatever FASTDATA_DEVICE_DECODER / device_decoder said:
    # doctor's figure was torchvision's, and its note did not say which decoder it measured
    from fastdata.monitor import _stages as st

    jpegs = [jpeg(i, 16 + i, 12) for i in range(6)]
    monkeypatch.delenv("FASTDATA_DEVICE_DECODER", raising=False)
    auto = gpu.DecodeImages(device="cpu").resolved_device_decoder  # TorchCodec where it loads
    assert st.probe_gpu_decode(jpegs, torch.device("cpu")) == (None, f"no CUDA device (device decoder: {auto})")

    class OnTheCpu(gpu.DecodeImages):  # the stage a pipeline builds, run on the CPU where there is no GPU
        def __init__(self, *args, device=None, **kwargs):
            super().__init__(*args, device="cpu", **kwargs)

    monkeypatch.setattr(gpu, "DecodeImages", OnTheCpu)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    rate, note = st.probe_gpu_decode(jpegs, torch.device("cuda"))
    assert rate is not None and rate > 0 and note == f"DecodeImages with device decoder {auto} on the GPU"
    unimportable(monkeypatch, "nvidia.nvimgcodec")  # as if not installed
    monkeypatch.setattr(_codec, "nvimgcodec_status", _codec.nvimgcodec_status.__wrapped__)
    monkeypatch.setenv("FASTDATA_DEVICE_DECODER", "nvimgcodec")  # not installed: said, not another decoder's figure
    rate, note = st.probe_gpu_decode(jpegs, torch.device("cuda"))
    assert rate is None and "nvimgcodec" in note and "pip install" in note
    monkeypatch.setenv("FASTDATA_DEVICE_DECODER", "nvjpeg")
    rate, note = st.probe_gpu_decode(jpegs, torch.device("cuda"))
    assert rate is None and "FASTDATA_DEVICE_DECODER='nvjpeg'" in note


# ----------------------------------------------------------------------------------- (c) measured == pasted

@pytest.fixture
def jpeg_shards(tmp_path):
    import fastdata

    with fastdata.ShardWriter(tmp_path / "shards", max_samples=8) as w:
        for i in range(16):
            w.write({"__key__": f"k{i:04d}", "jpg": jpeg(i % 8, 16 + i % 8, 12), "cls": i % 3})
    return tmp_path / "shards"


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


# ----------------------------------------------------------------------------------- (d) a shard for a manifest

def test_a_shard_given_for_the_manifest_is_named_as_such(jpeg_shards, tmp_path, capsys):
    # `fastdata inspect shards/shard-000000.tar` said "cannot read manifest: 'utf-8' codec can't decode byte 0xff"
    # (later "not UTF-8 text: 'utf-8' codec ..."), and a tar of text members "not valid JSON": what the file is,
    # and what to pass instead, went unsaid
    import numpy as np

    import fastdata
    from fastdata.cli._main import main

    with fastdata.ShardWriter(tmp_path / "text", max_samples=8) as w:  # a tar that is valid UTF-8
        for i in range(3):
            w.write({"__key__": f"k{i}", "txt": "hello", "cls": i})
    with fastdata.ShardWriter(tmp_path / "h5", format="hdf5", max_samples=8) as w:
        w.write({"__key__": "k0", "x.npy": np.zeros(3), "cls": 0})
    for shard, what in ((jpeg_shards / "shard-000000.tar", "a tar shard"),
                        (tmp_path / "text" / "shard-000000.tar", "a tar shard"),
                        (tmp_path / "h5" / "shard-000000.h5", "an HDF5 shard")):
        with pytest.raises(fastdata.ManifestError, match=rf"shard-000000\.\w+: not a manifest\.json \(.*{what}\); "
                                                         rf"pass the folder that holds manifest\.json \(.*{shard.parent.name}\)"):
            fastdata.Manifest.load(shard)
    assert main(["inspect", str(jpeg_shards / "shard-000000.tar")]) != 0
    err = capsys.readouterr().err
    assert "a tar shard" in err and "utf-8" not in err


# ----------------------------------------------------------------------------------- (e) StallReport wording

def test_stall_summary_of_a_cpu_only_loop_does_not_talk_of_a_gpu():
    # "feeding the GPU fully would make this loop 2.00x faster" was said of CPU-only loops too
    from fastdata.monitor import StallReport

    rep = StallReport(steps=10, wall_s=1.0, wait_s=0.5, wait_p50_s=0.05, wait_p99_s=0.06, first_wait_s=0.0)
    text = rep.summary()
    assert rep.loader_bound and "GPU" not in text and "2.00x faster" in text
    from fastdata.monitor._stall import advise

    advice = advise(rep, iter(()))  # a plain iterable: the prefetcher is advised, for what it does on a CPU too
    assert any("CUDAPrefetcher" in a for a in advice) and all("copies overlap" not in a for a in advice)


# ----------------------------------------------------------------------------------- bug hunt

def test_geometric_transforms_after_a_second_decode_stage_reach_the_first_stages_images():
    # Compose(DecodeImages(keys=["jpg"]), DecodeImages(keys=["png"]), CenterCrop(4)) cropped "png" only: the crop
    # was fused into the second stage, and the first stage's images were rendered before it, uncropped (8x10)
    batch = collate([{"jpg": EncodedImage(jpeg(i, 10 + 2 * i, 8, format="PNG"), shard="s.tar", key=f"k{i}", index=i, epoch=0),
                      "png": EncodedImage(jpeg(i, 6, 5, format="PNG"), shard="s.tar", key=f"k{i}", index=i, epoch=0), "cls": i}
                     for i in range(2)])
    first, second = gpu.DecodeImages(keys=["jpg"], device="cpu"), gpu.DecodeImages(keys=["png"], device="cpu")
    out = gpu.Compose(first, second, gpu.CenterCrop(4))(batch)
    assert tuple(out["jpg"].shape) == tuple(out["png"].shape) == (2, 3, 4, 4)
    out = gpu.Compose(first, gpu.Resize(4), second, gpu.CenterCrop(3))(batch)  # ragged after Resize: still pending
    assert tuple(out["jpg"].shape) == tuple(out["png"].shape) == (2, 3, 3, 3)
    one = gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.CenterCrop(4))(batch)  # one stage: as before
    assert torch.equal(one["jpg"], gpu.Compose(first, second, gpu.CenterCrop(4))(batch)["jpg"])


def _with_a_truncated_image(root, n: int = 24, bad: int = 20):
    import fastdata

    with fastdata.ShardWriter(root, max_samples=8) as w:
        for i in range(n):
            data = jpeg(i % 8, 16 + i % 8, 12)
            w.write({"__key__": f"k{i:03d}", "jpg": data[:60] if i == bad else data, "cls": i % 3})
    return root


def test_doctor_and_tune_name_the_users_shard_of_a_sample_that_does_not_load(tmp_path):
    # the measurements run over a copy of the first samples: a corrupt image among them failed doctor with
    # "/tmp/fastdata-doctor-.../subset/shard-000005.tar: sample 'k080' ..." (a temporary file, deleted), or,
    # among the first 64, with "sample 'k020' field 'jpg': ..." (no shard)
    from fastdata.manifest import Manifest
    from fastdata.monitor import _stages as st

    src = _with_a_truncated_image(tmp_path / "src")
    fields = st.pick_fields(Manifest.load(src))
    with pytest.raises(FastdataError, match=rf"{tmp_path}/src/shard-000002\.tar: sample 'k020' field 'jpg'"):
        st.copy_subset(src, tmp_path / "subset", fields, 24)
    # image fields of two formats (jpg or png): a bare KeyError 'jpg' with a traceback
    import fastdata
    from fastdata.errors import MissingFieldError

    with fastdata.ShardWriter(tmp_path / "mixed", max_samples=8) as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", ("jpg" if i % 2 else "png"): jpeg(i, 4, 3, format="PNG"), "cls": i})
    fields = st.pick_fields(Manifest.load(tmp_path / "mixed"))
    with pytest.raises(MissingFieldError, match=r"mixed/shard-000000\.tar: sample 'k0' has no field 'jpg'.*re-encode"):
        st.copy_subset(tmp_path / "mixed", tmp_path / "subset2", fields, 4)


def test_tune_says_why_no_decoder_could_be_measured(jpeg_shards, monkeypatch):
    # both CPU decoders failing on the measured images ended tune with "min() arg is an empty sequence"
    from fastdata.errors import DecodeError
    from fastdata.monitor import DoctorOptions, _stages, tune

    def fails(*args, **kwargs):
        raise DecodeError("shard-x.tar: sample 'k1' field 'jpg': OSError: broken")

    monkeypatch.setattr(_stages, "cpu_costs", fails)
    with pytest.raises(FastdataError, match=r"no CPU decoder.*pil: DecodeError: shard-x\.tar: sample 'k1'"):
        tune(jpeg_shards, DoctorOptions(samples=16, batch_size=4, num_workers=0, size=16, device="cpu"))


def test_cache_list_of_a_directory_that_does_not_exist_says_so(tmp_path, capsys):
    # a mistyped --cache said "no stores in DIR", as for an empty cache
    from fastdata.cli._main import main

    assert main(["cache", "list", "--cache", str(tmp_path / "typo")]) == 0
    assert capsys.readouterr().out.strip() == f"no stores in {tmp_path / 'typo'} (no such directory)"
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    assert main(["cache", "list", "--cache", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.strip() == f"no stores in {tmp_path / 'empty'}"


@pytest.mark.parametrize("form", ["~/{name}", "~/{name}/manifest.json", "file://{path}", "file://{path}/manifest.json"])
def test_doctor_tune_and_bench_read_shards_given_with_tilde_or_file_url(jpeg_shards, monkeypatch, form):
    # the README: every local path argument reads ~ and file://; doctor, tune and bench read
    # "~/ok/shard-000000.tar.idx" (or "file:/tmp/.../manifest.json/...") literally
    from fastdata.monitor import _stages as st

    monkeypatch.setenv("HOME", str(jpeg_shards.parent))
    source = form.format(name=jpeg_shards.name, path=jpeg_shards)
    folder = st.shard_folder(source)
    assert str(folder) == str(jpeg_shards)
    fields = st.pick_fields(__import__("fastdata").Manifest.load(folder))
    assert st.copy_subset(folder, jpeg_shards.parent / "subset", fields, 4).samples == 4
    from fastdata.cli._bench import run_bench

    assert run_bench(source=source, workdir=str(jpeg_shards.parent / "bench"), num_images=0, samples=4,
                     num_workers=0, repeats=1, size=8, as_json=True) == 0


def test_doctor_says_it_measures_local_shards_when_given_a_url():
    from fastdata.errors import SourceError
    from fastdata.monitor import _stages as st

    with pytest.raises(SourceError, match=r"s3://bucket/ds: a URL; doctor, tune and bench measure a local shard folder"):
        st.shard_folder("s3://bucket/ds")


def test_cli_folders_and_files_read_tilde_and_file_urls(jpeg_shards, tmp_path, monkeypatch, capsys):
    # `fastdata bench --dir "~/b"` / `demo --dir` made a folder named "~" in the current folder, and
    # `fastdata cache build --cache file:///x/c` a folder "file:"; `--out "~/r.json"` said its folder does not exist
    from fastdata.cli._args import output_file, work_folder
    from fastdata.cli._main import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert work_folder("~/b") == str(tmp_path / "b") and work_folder(f"file://{tmp_path}/b") == str(tmp_path / "b")
    assert output_file("~/r.json") == str(tmp_path / "r.json")
    assert output_file(f"file://{tmp_path}/r.json") == str(tmp_path / "r.json")
    assert main(["cache", "build", str(jpeg_shards), "--cache", f"file://{tmp_path}/c", "--size", "8",
                 "--workers", "0", "-q"]) == 0
    assert (tmp_path / "c").is_dir() and not (tmp_path / "file:").exists()
    capsys.readouterr()
    assert main(["cache", "list", "--cache", "~/c"]) == 0
    assert "1 store(s)" in capsys.readouterr().out


def test_stall_report_of_a_cpu_prefetcher_lists_no_copy_stages():
    # a CUDAPrefetcher on the CPU has no pinning nor host-to-device copy: the report listed
    # "pin/pack + copy issue 0.00 ms" and "host-to-device copy (device time) 0.00 ms" for it
    import fastdata

    meter = fastdata.StallMeter()
    with fastdata.CUDAPrefetcher([torch.zeros(2, 3)] * 4, device="cpu") as batches:
        for _ in meter.wrap(batches):
            pass
    stages = dict(meter.report().stage_s)
    assert "loader next()" in stages and "step (loop body)" in stages
    assert not any("copy" in name for name in stages), stages
