"""Session 9, helper 'startmethods': the loader under the spawn and forkserver start methods.

Kept fast: the pickling errors below happen in this process, before any worker starts (spawn and
forkserver pickle a worker's arguments in ``Process.start``), so no worker imports torch.
"""
from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest

from tests.helpers.images import jpeg
from fastdata import DataLoader, ShardedDataset
from fastdata.errors import FastdataError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from fastdata.shards.writer import ShardWriter

    dest = tmp_path_factory.mktemp("s9sm") / "d"
    with ShardWriter(dest, max_samples=4) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "cls": i, "png": jpeg(i, 4, 4, format="PNG")})
    return dest


def _local_transform():
    def keep(sample):
        return sample
    return keep


@pytest.mark.parametrize("method", [m for m in ("spawn", "forkserver") if m in mp.get_all_start_methods()])
@pytest.mark.parametrize("where", ["sample_transform", "decode", "collate_fn", "worker_init_fn"])
def test_an_unpicklable_worker_argument_is_named_under_spawn_and_forkserver(folder, method, where):
    """A lambda or local function in the dataset, collate_fn or worker_init_fn: spawn/forkserver workers
    get them pickled. pickle's bare "Can't pickle <function <lambda>>" named no argument."""
    ds_kw: dict = {}
    dl_kw: dict = {}
    if where == "sample_transform":
        ds_kw["sample_transform"] = _local_transform()
    elif where == "decode":
        ds_kw["decode"] = {"cls": lambda b: int(b)}
    elif where == "collate_fn":
        dl_kw["collate_fn"] = lambda batch: batch
    else:
        dl_kw["worker_init_fn"] = lambda worker_id: None
    loader = DataLoader(ShardedDataset(folder, **ds_kw), batch_size=2, num_workers=2,
                        multiprocessing_context=method, **dl_kw)
    with pytest.warns(UserWarning, match="pickle"), pytest.raises(FastdataError) as info:  # torch's warning
        next(iter(loader))
    assert isinstance(info.value, pickle.PicklingError)
    msg = str(info.value)
    want = {"sample_transform": "dataset.sample_transform", "decode": "dataset.decode['cls']",
            "collate_fn": "collate_fn (", "worker_init_fn": "worker_init_fn ("}[where]
    assert want in msg and method in msg and "module level" in msg, msg
    # the loader is usable afterwards: the same dataset through threads (nothing to pickle)
    if where in ("sample_transform", "decode"):
        threads = DataLoader(loader.dataset, batch_size=2, num_workers=2, decode_threads=2)
        assert sum(len(b["__key__"]) for b in threads) == 8



class _Resetting:
    """torch's iterator at the moment it reads a batch of a worker being killed: the connection that
    passes the batch's shared-memory fd resets before the worker's process has ended."""

    def __init__(self, workers):
        self._workers = workers

    def __next__(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_worker_killed_while_passing_a_batch_is_named_not_a_connection_reset(folder):
    """A worker SIGKILLed (the OOM killer) while the loader receives its batch: next() raised a bare
    ConnectionResetError (1-2 runs in 3 here after a kill -9, spawn and fork alike) whenever the worker's
    process had not quite ended when torch checked its workers."""
    import os
    import signal
    import threading

    loader = DataLoader(ShardedDataset(folder), batch_size=1, num_workers=2, multiprocessing_context="fork",
                        stall_warning=None)
    it = iter(loader)
    next(it)
    real = it._inner
    victim = real._workers[1]
    it._inner = _Resetting(real._workers)
    old = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report it first
    try:
        threading.Timer(0.1, os.kill, (victim.pid, signal.SIGKILL)).start()  # dies just after the reset
        with pytest.raises(RuntimeError, match=rf"worker \(pid {victim.pid}\) was killed by signal SIGKILL") as info:
            next(it)
        assert isinstance(info.value.__cause__, ConnectionResetError)
    finally:
        it._inner = real
        it.close()
        signal.signal(signal.SIGCHLD, old)


def test_convert_from_a_script_without_a_main_guard_says_why_its_spawned_workers_died(tmp_path):
    """convert() spawns its workers when the calling process runs another thread (a forked copy of such a
    process can deadlock); spawned workers import the calling script again, and an unguarded script
    calls convert() in each of them. That was reported as "a worker process died (killed, out of
    memory?) while writing a shard" though no shard was started and nothing was killed."""
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.png").write_bytes(jpeg(i, 4, 4, format="PNG"))
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import threading, time\n"
        "from fastdata.shards.convert import ConvertOptions, convert\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # tqdm's monitor, a logger...\n"
        f"convert({str(src)!r}, {str(tmp_path / 'out')!r}, ConvertOptions(samples_per_shard=1, workers=2, "
        "progress=False))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert "ConversionError" in last and "if __name__ ==" in last and "spawn" in last, run.stderr[-2000:]
    assert "out of memory" not in last


def test_a_transform_defined_in_a_notebook_is_named_before_spawn_workers_die_starting(folder, monkeypatch):
    """A class defined in a notebook cell (``__main__`` without a file; also ``python -c``) pickles by
    name in the parent, but no spawn/forkserver worker can import it: each died while starting (its
    AttributeError only on the kernel's stderr) and the loop got "DataLoader worker exited unexpectedly"."""
    import sys
    import types

    notebook = types.ModuleType("__main__")  # as ipykernel's: no __file__
    Crop = type("Crop", (), {"__call__": lambda self, sample: sample, "__module__": "__main__"})
    notebook.Crop = Crop
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    loader = DataLoader(ShardedDataset(folder, sample_transform=Crop()), batch_size=2, num_workers=2,
                        multiprocessing_context="spawn")
    with pytest.raises(FastdataError, match=r"dataset\.sample_transform uses the class 'Crop' defined in __main__"):
        next(iter(loader))
    fork = DataLoader(loader.dataset, batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert sum(len(b["__key__"]) for b in fork) == 8  # fork workers inherit it: no error there


def test_a_persistent_worker_pool_with_a_dead_worker_is_replaced_at_the_next_iter(folder):
    """A persistent worker killed (the OOM killer) fails that epoch; a retry with the same loader got
    "DataLoader worker (pid(s) N) exited unexpectedly" at every later iter(), for good."""
    import os
    import signal

    loader = DataLoader(ShardedDataset(folder), batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork", stall_warning=None)
    assert sum(len(b["__key__"]) for b in loader) == 8
    victim = loader._iterator._workers[0]
    old = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler raises wherever this thread is then
    try:
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
    finally:
        signal.signal(signal.SIGCHLD, old)
    keys = [k for b in loader for k in b["__key__"]]
    assert sorted(keys) == [f"k{i}" for i in range(8)]
    assert all(w.is_alive() for w in loader._iterator._workers)
    loader._iterator._shutdown_workers()
