"""The loader under every start method: fork, spawn and forkserver (whole epochs, exact resume, every
skip reported, early stops), and what spawn and forkserver cannot pickle or import, named."""
from __future__ import annotations

import io
import multiprocessing as mp
import pickle

import numpy as np
import pytest
from PIL import Image

from fastdata import DataLoader, ShardedDataset
from fastdata.errors import FastdataError
from tests.helpers.images import jpeg


@pytest.fixture(scope="module")
def png_shards(tmp_path_factory):
    from fastdata.shards.writer import ShardWriter

    dest = tmp_path_factory.mktemp("pngs") / "d"
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
def test_an_unpicklable_worker_argument_is_named_under_spawn_and_forkserver(png_shards, method, where):
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
    loader = DataLoader(ShardedDataset(png_shards, **ds_kw), batch_size=2, num_workers=2,
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


def test_a_worker_killed_while_passing_a_batch_is_named_not_a_connection_reset(png_shards):
    """A worker SIGKILLed (the OOM killer) while the loader receives its batch: next() raised a bare
    ConnectionResetError (1-2 runs in 3 here after a kill -9, spawn and fork alike) whenever the worker's
    process had not quite ended when torch checked its workers."""
    import os
    import signal
    import threading

    loader = DataLoader(ShardedDataset(png_shards), batch_size=1, num_workers=2, multiprocessing_context="fork",
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


def test_a_transform_defined_in_a_notebook_is_named_before_spawn_workers_die_starting(png_shards, monkeypatch):
    """A class defined in a notebook cell (``__main__`` without a file; also ``python -c``) pickles by
    name in the parent, but no spawn/forkserver worker can import it: each died while starting (its
    AttributeError only on the kernel's stderr) and the loop got "DataLoader worker exited unexpectedly"."""
    import sys
    import types

    notebook = types.ModuleType("__main__")  # as ipykernel's: no __file__
    Crop = type("Crop", (), {"__call__": lambda self, sample: sample, "__module__": "__main__"})
    notebook.Crop = Crop
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    loader = DataLoader(ShardedDataset(png_shards, sample_transform=Crop()), batch_size=2, num_workers=2,
                        multiprocessing_context="spawn")
    with pytest.raises(FastdataError, match=r"dataset\.sample_transform uses the class 'Crop' defined in __main__"):
        next(iter(loader))
    fork = DataLoader(loader.dataset, batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert sum(len(b["__key__"]) for b in fork) == 8  # fork workers inherit it: no error there


def test_a_persistent_worker_pool_with_a_dead_worker_is_replaced_at_the_next_iter(png_shards):
    """A persistent worker killed (the OOM killer) fails that epoch; a retry with the same loader got
    "DataLoader worker (pid(s) N) exited unexpectedly" at every later iter(), for good."""
    import os
    import signal

    loader = DataLoader(ShardedDataset(png_shards), batch_size=2, num_workers=2, persistent_workers=True,
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


METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]
# spawn/forkserver workers import torch afresh (seconds each on a loaded machine): marked slow
PARAMS = [pytest.param(m, marks=[pytest.mark.slow] if m != "fork" else []) for m in METHODS]


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), i % 256, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from fastdata.shards.writer import ShardWriter

    dest = tmp_path_factory.mktemp("sm") / "d"
    with ShardWriter(dest, max_samples=16) as w:
        for i in range(64):
            w.write({"__key__": f"s{i:03d}", "cls": i % 10, "png": b"corrupt" if i in BAD else png(i)})
    return dest


# each of 2 workers reads 32 samples in order: its last two are corrupt, so with batches of 5 they are
# skipped after its last batch (the case that went unreported), plus one in the middle
BAD = {20, 30, 31, 62, 63}


def keys(batches) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


@pytest.mark.parametrize("method", PARAMS)
def test_epoch_resume_and_skips(folder, method):
    ds = ShardedDataset(folder, on_error="skip")
    want = keys(DataLoader(ds, batch_size=5, num_workers=0))
    bad = {f"s{i:03d}" for i in BAD}
    assert set(want) == {f"s{i:03d}" for i in range(64)} - bad
    ds.skipped.clear()
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context=method)
    it = iter(loader)
    head = keys([next(it) for _ in range(3)])
    state = loader.state_dict()
    del it
    ds2 = ShardedDataset(folder, on_error="skip")
    loader2 = DataLoader(ds2, batch_size=5, num_workers=2, multiprocessing_context=method)
    loader2.load_state_dict(state)
    tail = keys(loader2)
    assert sorted(head + tail) == sorted(want)  # exactly once
    # every skip exactly once: those before the state in ds, the rest (also after a worker's last
    # batch) in ds2
    assert sorted(r["key"] for r in ds.skipped + ds2.skipped) == sorted(bad)


@pytest.mark.parametrize("method", PARAMS)
def test_early_stops_do_not_abort_workers(folder, method, capfd):
    import fastdata

    ds = ShardedDataset(folder, shuffle=True, on_error="skip")
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=method)
    it = iter(loader)
    next(it)
    next(it)
    del it  # early stop: the worker is shut down while it still produces
    pf = fastdata.CUDAPrefetcher(loader, device="cpu")
    pit = iter(pf)
    next(pit)
    pf.close()  # early stop behind a prefetcher
    del pit
    # the next loop is whole and no worker died of a signal
    assert sum(len(b["__key__"]) for b in loader) == 64 - len(BAD)
    err = capfd.readouterr().err
    assert "terminate called" not in err and "Aborted" not in err and "killed by signal" not in err


def test_no_fork_while_a_prefetch_thread_is_alive(folder):
    """Non-persistent fork workers behind a CUDAPrefetcher: no other thread may run when a worker
    forks (Python 3.12 warns "This process is multi-threaded, use of fork() may lead to deadlocks
    in the child", and a child can inherit a lock held by another thread)."""
    from tests.helpers import fork_probe  # its hook runs after fastdata's own fork hooks (which pause their threads)

    import fastdata

    if "fork" not in METHODS:
        pytest.skip("no fork on this platform")
    fork_probe.forks = []
    try:
        ds = ShardedDataset(folder, on_error="skip")
        pf = fastdata.CUDAPrefetcher(DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork"),
                                     device="cpu")
        for _ in range(3):
            assert sum(len(b["__key__"]) for b in pf) == 64 - len(BAD)
        pf.close()
    finally:
        recorded, fork_probe.forks = fork_probe.forks, None
    assert len(recorded) >= 6  # 2 workers x 3 epochs
    alive = [names for names in recorded if names != ["MainThread"]]
    assert not alive, f"{len(alive)} of {len(recorded)} forks: [forking thread, other threads] = {alive[:3]}"


def test_numpy_imports_that_np_unique_makes_lazily_are_done_when_fastdata_loads() -> None:
    """np.unique imports numpy.ma at its first call. A fork while a thread decoder's split was in that
    import left the module lock held in the fork worker, which hung at its own first np.unique (3 of 3
    runs of a reproduction, reported by the stall watchdog after 60 s)."""
    import subprocess
    import sys

    code = "import sys, fastdata.dataset; print('numpy.ma' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True"
