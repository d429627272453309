"""examples/train_ddp.py under ``torchrun --nproc_per_node 2`` (gloo, CPU) over a loopback HTTP shard set.

Run 1 trains on 2 processes and stops mid-epoch right after a checkpoint (a preemption); run 2
resumes the same checkpoint on 1 process (an elastic restart) and finishes 2 epochs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.shards.writer import ShardWriter
from tests.helpers.loopback_server import LoopbackServer


pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]
N = 48


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def _run(args: list[str], nproc: int, env: dict[str, str]) -> str:
    cmd = [*_torchrun(), "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "examples" / "train_ddp.py"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-12000:]
    return out


def _keys(log_dir: Path) -> dict[int, Counter]:
    per_epoch: dict[int, Counter] = {}
    for f in log_dir.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_epoch.setdefault(rec["epoch"], Counter()).update(rec["keys"])
    return per_epoch


def test_torchrun_two_processes_then_elastic_restart_on_one(tmp_path):
    www = tmp_path / "www"
    rng = np.random.default_rng(0)
    with ShardWriter(www / "ds", max_samples=6) as w:
        for i in range(N):
            img = jpeg_bytes(synth_image(rng, 24, 24, cls=i % 4), 90)
            w.write({"__key__": f"img{i:03d}", "jpg": img, "cls": str(i % 4).encode()})
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    logs, ckpt = tmp_path / "keys", tmp_path / "ckpt.pt"
    with LoopbackServer(www, ranges=False, max_requests=2000, lifetime=400) as srv:
        common = ["--data", srv.url + "/ds", "--ckpt", str(ckpt), "--node-cache", str(tmp_path / "nodecache"),
                  "--model", "tiny", "--classes", "4", "--size", "16", "--batch-size", "4", "--workers", "1",
                  "--epochs", "2", "--lr", "0.01", "--log-keys", str(logs)]
        out1 = _run([*common, "--stop-after", "3"], 2, env)
        assert "stopping after 3 steps" in out1 and ckpt.is_file()
        first = _keys(logs)
        assert sum(first[0].values()) == 2 * 3 * 4  # 2 ranks x 3 steps x 4 samples
        out2 = _run(common, 1, env)
        assert "resumed from" in out2 and "epoch 1 done" in out2
        shard_gets = {p: c for p, c in srv.counts.items() if p.endswith(".tar")}
    keys = _keys(logs)
    want = Counter(f"img{i:03d}" for i in range(N))
    assert keys[0] == want  # epoch 0: 2 processes, then 1, each sample exactly once
    assert keys[1] == want
    assert len(shard_gets) == N // 6 and set(shard_gets.values()) == {1}, shard_gets
