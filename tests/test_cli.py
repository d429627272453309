import subprocess
import sys

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


def test_demo_end_to_end(tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path), "--images", "96", "--workers", "0", "--epochs", "2",
                 "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "checksums verified" in out
    assert "filling the cache" in out and "read from the cache (in-process fast path)" in out
    assert "[4/4]" in out


def test_bench_writes_json(tmp_path, capsys):
    import json

    out_json = tmp_path / "bench.json"
    assert main(["bench", "--dir", str(tmp_path / "w"), "--images", "64", "--workers", "0", "--repeats", "1",
                 "--json", str(out_json)]) == 0
    res = json.loads(out_json.read_text())
    assert res["raw_read"]["GB/s"] > 0 and res["decode_pipeline"]["images/s"] > 0
    assert res["cached_pipeline"]["images/s"] > 0 and res["cached_pipeline"]["speedup"] > 0
    assert "cached pipeline" in capsys.readouterr().out
