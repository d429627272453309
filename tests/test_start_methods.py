"""The loader under every start method (issue 13 item 10): fork, spawn and forkserver.

Python 3.14 makes forkserver the default on Linux; spawn is the default elsewhere. Each test runs
the same loader scenario under the three methods: whole epochs, exact resume, every skip reported
(also after a worker's last batch), early stops (``del it``, ``CUDAPrefetcher.close()``) that must
neither abort a worker nor surface in the next loop. Kept small: a spawned worker imports torch.
"""
from __future__ import annotations

import io
import multiprocessing as mp

import numpy as np
import pytest
from PIL import Image

from fastdata import DataLoader, ShardedDataset

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
