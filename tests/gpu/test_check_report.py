"""benchmarks/gpu: the candidate table every row of check.sh's part (b) comes from, and report.py, which
renders check.sh's results and says which default they change (only past the measured spread)."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from fastdata import gpu

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


@pytest.fixture
def module(monkeypatch):
    """benchmarks/gpu/NAME.py by name, as the scripts import each other when check.sh runs them (sys.path and
    the modules restored after the test)."""
    monkeypatch.syspath_prepend(str(GPU))
    loaded = []

    def load(name: str):
        loaded.append(name)
        return importlib.import_module(name)
    yield load
    for name in loaded:
        sys.modules.pop(name, None)


def test_every_candidate_builds_a_stage_and_its_source(module):
    cand = module("candidates")
    names = [c.name for c in cand.CANDIDATES]
    assert len(set(names)) == len(names) and "ahead1" in names
    status = cand.decoder_status()
    for c in cand.CANDIDATES:
        assert cand.by_name(c.name) is c
        assert c.decoders is None or set(c.decoders) <= set(cand.DECODERS)
        decoder = "torchvision" if c.applies_to("torchvision") else c.decoders[0]
        if status[decoder] is not None:  # its library does not load here
            continue
        stage = c.decode_stage(decoder, "cpu", keys=["jpg"])
        assert isinstance(stage, gpu.DecodeImages) and stage.device_decoder == decoder
        assert all(getattr(stage, k) == v for k, v in c.stage)  # the arguments that select it
        src = c.source(stage, [1, 2, 3])
        assert list(src) == [1, 2, 3] and (c.ahead == 0 or src.batches == c.ahead)
        stage.close()
    codec = {c.name: c for c in cand.CANDIDATES if c.stage}
    assert codec["nowait"].decoders == ("nvimgcodec",) and dict(codec["nowait"].stage) == {"host_wait": False}
    assert codec["threads4"].decoders == ("torchcodec",) and dict(codec["threads4"].stage) == {"decode_threads": 4}
    with pytest.raises(ValueError, match="unknown decode candidate 'nope'"):
        cand.by_name("nope")
    status = cand.decoder_status(("torchvision", "no-such-decoder"))
    assert status["torchvision"] is None and "no-such-decoder" in status["no-such-decoder"]


def row(decoder, candidate, priority, stage, train, **extra):
    return {"decoder": decoder, "candidate": candidate, "priority": priority, "stage_alone_images_per_s": 2 * stage,
            "cpu_cores_alone": 1.5, "stage_beside_images_per_s": stage, "train_beside_images_per_s": train,
            "train_share": train / 10_000, **extra}


def results(tmp_path: Path, rows: list[dict], **decode) -> Path:
    (tmp_path / "decode.json").write_text(json.dumps({"env": {"gpu": "H200"}, "args": {"model": "resnet18"},
                                                      "rows": rows, "decoders": {"torchcodec": "not installed"},
                                                      "best": None, **decode}))
    (tmp_path / "train.json").write_text(json.dumps({"args": {"models": ["resnet18"], "size": 224}, "results": [
        {"variant": "resident", "images_per_s": 10_000, "share_of_resident": 1.0, "wait_p99_ms": 0.0,
         "cpu_cores": 1.0, "gpu_util_pct": 90.0},
        {"variant": "fastdata_gpu_rrc", "images_per_s": 9_600, "share_of_resident": 0.96, "wait_p99_ms": 1.0,
         "cpu_cores": 5.0, "decoder": "nvimgcodec", "decode_candidate": "ahead1", "stream_priority": "high"},
        {"variant": "fastdata_cached", "error": "RuntimeError: boom"}]}))
    (tmp_path / "h2d.json").write_text(json.dumps({"device": "H200", "raw": {"pinned_gbps": 55.0}, "results": [
        {"variant": v, "compute_ms": c, "jitter": 0.0, "step_ms": ms} for c, v, ms in (
            (4.9, "one_ahead", 6.0), (4.9, "prefetcher_pinned", 5.0), (4.9, "one_ahead_pin", 7.0),
            (4.9, "prefetcher", 5.1), (0.5, "one_ahead_pin", 1.7), (0.5, "prefetcher", 2.6))]}))
    (tmp_path / "pytest_cuda.txt").write_text("....\n40 passed, 2 skipped in 30.0s\n")
    return tmp_path


def test_report_renders_every_part_and_changes_a_default_only_past_the_spread(tmp_path, capsys, module):
    report = module("report")
    rows = [row("torchvision", "ahead1", "normal", 2_000, 9_000), row("nvimgcodec", "ahead1", "normal", 9_000, 9_500),
            row("torchvision", "ahead1", "high", 2_100, 9_000), row("nvimgcodec", "ahead1", "high", 9_800, 9_400),
            row("nvimgcodec", "ahead2", "normal", 9_100, 9_300), {"decoder": "nvimgcodec", "candidate": "ahead2",
                                                                  "priority": "high", "skipped": "budget: 3 s left"},
            row("torchvision", "ahead1", "normal", 2_060, 9_000, repeat=True)]  # 3% spread
    assert report.main([str(results(tmp_path, rows))]) == 0
    out = capsys.readouterr().out
    assert "40 passed, 2 skipped" in out and "| nvimgcodec | ahead2 | high | budget: 3 s left" in out
    assert "| fastdata_gpu_rrc (nvimgcodec, ahead1, high stream) | 9,600 | 96% |" in out
    assert "| fastdata_cached | RuntimeError: boom |" in out and "torchcodec (not installed)" in out
    assert "| 4.9 ms | pageable | 7.00 | 5.10 | 0.73x |" in out and "| 0.5 ms | pageable | 1.70 | 2.60 | 1.53x |" in out
    assert "worst 1.53x (not met)" in out and "96% with 5.0 cores (met)" in out
    assert "**make it nvimgcodec**" in out  # 9,400 against torchvision's 2,100: far past the 5% floor
    assert "high 9,400 vs normal 9,000: keep normal" in out  # 4%: within the margin
    assert "two batches - vs one 9,400: keep 1" in out  # nvimgcodec ahead2 high was skipped


def test_best_args_give_part_c_the_best_row(tmp_path, capsys, module):
    report = module("report")
    d = tmp_path / "decode.json"
    d.write_text(json.dumps({"best": {"decoder": "nvimgcodec", "candidate": "ahead2", "priority": "high"}}))
    assert report.main(["--best-args", str(d)]) == 0
    assert capsys.readouterr().out.split() == ["--device-decoder", "nvimgcodec", "--decode-candidate", "ahead2",
                                               "--stream-priority", "high"]
    assert report.best_args(tmp_path / "missing.json") == ""
    assert report.best_row([row("a", "ahead1", "normal", 5_000, 9_000), row("b", "ahead1", "normal", 9_000, 4_000),
                 row("c", "ahead1", "normal", 8_000, 7_000, repeat=True)])["decoder"] == "a"


def test_report_weighs_each_codec_row_against_todays_pipeline_with_its_decoder(tmp_path, capsys, module):
    report = module("report")
    rows = [row("torchcodec", "ahead1", "normal", 2_500, 9_000), row("torchcodec", "threads4", "normal", 6_000, 8_800),
            row("nvimgcodec", "ahead1", "high", 7_000, 9_000), row("nvimgcodec", "nowait", "high", 7_200, 9_000),
            row("nvimgcodec", "ahead1", "normal", 6_000, 9_000),
            row("torchcodec", "ahead1", "normal", 2_550, 9_000, repeat=True)]  # 2% spread: the 5% floor holds
    assert report.main([str(results(tmp_path, rows, auto_device_decoder="torchcodec"))]) == 0
    out = capsys.readouterr().out
    assert "| torchcodec | threads4 | normal | 12,000 |" in out and "| nvimgcodec | nowait | high | 14,400 |" in out
    assert "torchcodec 6,000, nvimgcodec 7,200 (margin 5%): **make it nvimgcodec**" in out  # against "auto"'s
    assert ("`DecodeImages(host_wait=)` with nvimgcodec <- decode.json, nvimgcodec high stream: nowait 7,200 vs "
            "ahead1 7,000: keep the default") in out  # 3%: within the margin
    assert ("`DecodeImages(decode_threads=)` with torchcodec <- decode.json, torchcodec normal stream: threads4 "
            "6,000 vs ahead1 2,500: **make decode_threads=4 the default with torchcodec**") in out
    rows[3] = row("nvimgcodec", "nowait", "high", 9_000, 9_500)
    assert report.main([str(results(tmp_path, rows[:4]))]) == 0  # no auto_device_decoder: older results
    out = capsys.readouterr().out
    assert "**make host_wait=False the default with nvimgcodec**" in out
    assert 'keep torchvision (what "auto" resolves to, not measured)' in out  # nothing to weigh the others against
