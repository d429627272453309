"""fastdata.DataLoader's workers leave through ``os._exit`` under every start method (fastdata.loader._exit):
spawn workers no longer run interpreter finalization and C++ static destructors, which aborted some of
them at an early stop ("terminate called without an active exception")."""
from __future__ import annotations

import atexit
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastdata import DataLoader, ShardedDataset
from tests.helpers.shards import make_shards


REPO = Path(__file__).resolve().parents[2]
_LOAD = (  # the module alone, by path: no torch import in the child (about 0.1 s instead of 2 s)
    "import importlib.util\n"
    f"spec = importlib.util.spec_from_file_location('fdexit', {str(REPO / 'fastdata' / 'loader' / '_exit.py')!r})\n"
    "_exit = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(_exit)\n")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LOAD + code], capture_output=True, text=True, timeout=120)


def test_exit_is_swapped_only_after_multiprocessing_exit_work():
    """Armed, ``sys.exit`` still raises until ``util._exit_function`` has run (as at the end of
    ``Process._bootstrap``); then it ends the process at once with the same status, skipping atexit."""
    r = _run("import atexit, sys\n"
             "from multiprocessing import util\n"
             "atexit.register(print, 'ATEXIT RAN')\n"
             "_exit.arm()\n"
             "try:\n"
             "    sys.exit(5)\n"
             "except SystemExit as e:\n"
             "    print('raised', e.code, flush=True)\n"
             "util._exit_function()\n"
             "print('after exit work', flush=True)\n"
             "sys.exit(3)\n")
    assert r.returncode == 3, r.stderr
    assert r.stdout.split() == ["raised", "5", "after", "exit", "work"] and "ATEXIT RAN" not in r.stdout
    r = _run("import sys\nfrom multiprocessing import util\n"
             "_exit.arm()\nutil._exit_function()\nsys.exit('a message')\n")
    assert r.returncode == 1 and "a message" in r.stderr
    r = _run("import sys\nfrom multiprocessing import util\n"
             "_exit.arm()\nutil._exit_function()\nsys.exit()\n")
    assert r.returncode == 0, r.stderr


def _mark_atexit(folder: str, worker_id: int) -> None:
    atexit.register(Path(folder, f"atexit-{worker_id}-{os.getpid()}").touch)


@pytest.fixture
def shards(tmp_path):
    return make_shards(tmp_path / "shards", 64, 16, key="s{i:03d}", cls=lambda i: i % 5, array=(3, 8, 8),
                       overwrite=True)


@pytest.mark.slow
def test_spawn_workers_skip_finalization_like_fork_workers(shards, tmp_path):
    """A spawned torch DataLoader worker runs atexit handlers (interpreter finalization); a spawned
    fastdata.DataLoader worker does not, as fork children never do, whether its epoch ran to the end
    or stopped early; the batches are unchanged."""
    ds = ShardedDataset(shards, shuffle=True, seed=1)
    want = sorted(f"s{i:03d}" for i in range(64))

    def loader(cls, folder):
        folder.mkdir(exist_ok=True)
        return cls(ds, batch_size=8, num_workers=1, multiprocessing_context="spawn",
                   worker_init_fn=functools.partial(_mark_atexit, str(folder)))

    plain = loader(torch.utils.data.DataLoader, tmp_path / "torch")
    assert sorted(k for b in plain for k in b["__key__"]) == want
    del plain
    assert len(list((tmp_path / "torch").iterdir())) == 1  # the control: a spawn child finalizes
    ours = loader(DataLoader, tmp_path / "fastdata")
    assert sorted(k for b in ours for k in b["__key__"]) == want
    it = iter(ours)
    next(it)
    del it  # an early stop, the case that aborted
    del ours
    assert list((tmp_path / "fastdata").iterdir()) == []
