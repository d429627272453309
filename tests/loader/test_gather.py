"""The cached fast path's gather (fastdata/loader/_gather.py): numpy row copies on a small thread pool,
reused buffers that are never rewritten while a batch (or a view of it) is alive, no torch intra-op."""
from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader, _gather as gather
from fastdata.transforms import ResizeCenterCrop
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class _Store:
    """The two Store methods the gather uses, over in-memory arrays."""

    def __init__(self, n: int, invalid: tuple[int, ...] = ()) -> None:
        g = np.random.default_rng(0)
        self.arrays = {"img": g.integers(0, 256, (n, 3, 20, 20), dtype=np.uint8),
                       "emb": g.standard_normal((n, 7)).astype(np.float32)}
        self.invalid = set(invalid)

    def field_arrays(self) -> dict[str, np.ndarray]:
        return self.arrays

    def missing(self, idx: np.ndarray) -> np.ndarray:
        return np.array([i for i in idx.tolist() if i in self.invalid], dtype=np.int64)


@pytest.mark.parametrize("threads", [1, 3])
def test_gather_rows_and_buffer_reuse(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(gather, "PARALLEL_GATHER_BYTES", 0)  # threads even for tiny batches
    store = _Store(100)
    fg = gather.FastGather(threads, batch_size=8)
    rng = np.random.default_rng(1)
    kept = None
    for step in range(40):
        rows = rng.choice(100, size=8 if step % 5 else 5, replace=False).tolist()  # some partial batches
        out = fg.batch(store, rows, pinned=False)
        assert list(out) == ["img", "emb"]
        for name, arr in store.arrays.items():
            assert torch.equal(out[name], torch.from_numpy(arr[rows]))
        if step == 3:
            kept = (rows, out["img"][1:3])  # a view of an earlier batch stays alive
        if kept is not None:
            assert torch.equal(kept[1], torch.from_numpy(store.arrays["img"][kept[0][1:3]]))  # never rewritten
        del out
    # buffers come back when nothing views them: a handful allocated, not one per batch
    assert fg.ring.allocated <= 2 * 4
    assert fg.batch(store, [1, 2], pinned=False)["emb"].shape == (2, 7)
    assert fg.batch(_Store(10, invalid=(3,)), [1, 3], pinned=False) is None
    fg.close()


def test_gather_pool_error_is_raised_after_all_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather, "PARALLEL_GATHER_BYTES", 0)
    pool = gather.GatherPool(3)
    arrays = {"x": np.arange(30, dtype=np.int64).reshape(10, 3)}
    outs = {"x": np.empty((4, 2), dtype=np.int64)}  # wrong row shape: numpy refuses
    with pytest.raises(ValueError):
        pool.gather(arrays, np.arange(4), outs)
    pool.close()


def test_gather_threads_argument() -> None:
    with pytest.raises(ValueError, match="gather_threads must be an int >= 1 or None, got 0"):
        DataLoader(list(range(4)), gather_threads=0)
    with pytest.raises(ValueError, match="got True"):
        DataLoader(list(range(4)), gather_threads=True)
    assert 1 <= gather.default_gather_threads() <= 4


def test_cached_fast_path_gathers_without_torch_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards(tmp_path / "ds", 50, 16, image=(40, 36))
    make = lambda: ShardedDataset(shards, preprocess=ResizeCenterCrop(32), cache=tmp_path / "cache",  # noqa: E731
                                  shuffle=True, seed=3)
    make().build_cache()
    ref = [b for b in DataLoader(make(), batch_size=8, num_workers=2, cached_fast_path=False)]
    monkeypatch.setattr(gather, "PARALLEL_GATHER_BYTES", 0)

    def forbidden(*a, **k):
        raise AssertionError("the fast path must not gather with torch.index_select (intra-op pool)")

    monkeypatch.setattr(torch, "index_select", forbidden)
    threads_before = torch.get_num_threads()
    loader = DataLoader(make(), batch_size=8, num_workers=2, gather_threads=2)
    for epoch in range(3):
        got = []
        for b in loader:
            assert loader.last_path == "cached"
            got.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()})
            del b  # the buffer goes back to the ring
        assert len(got) == len(ref)
        for x, y in zip(got, ref):
            assert x["__key__"] == y["__key__"] and torch.equal(x["jpg"], y["jpg"]) and torch.equal(x["cls"], y["cls"])
    assert loader._gather.threads == 2 and loader._gather.ring.allocated <= 4  # reused across batches and epochs
    assert torch.get_num_threads() == threads_before
    assert any(t.name.startswith("fastdata-gather") for t in threading.enumerate())
    del loader
    gc.collect()


def test_uncached_fields_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys and labels of samples read in one cached epoch are not read from the shards again."""
    from fastdata.dataset import Cursor
    from fastdata.loader import _cached

    shards = make_shards(tmp_path / "ds", 40, 16, image=(40, 36))
    make = lambda: ShardedDataset(shards, preprocess=ResizeCenterCrop(16), cache=tmp_path / "cache",  # noqa: E731
                                  shuffle=True, seed=2)
    make().build_cache()
    calls = []
    real = Cursor.load_uncached

    def counting(self, shard, i, g):
        calls.append(g)
        return real(self, shard, i, g)

    monkeypatch.setattr(Cursor, "load_uncached", counting)
    loader = DataLoader(make(), batch_size=8)
    ref = DataLoader(make(), batch_size=8, cached_fast_path=False)
    for epoch in range(3):
        loader.set_epoch(epoch)
        ref.set_epoch(epoch)
        got, want = list(loader), list(ref)
        assert [b["__key__"] for b in got] == [b["__key__"] for b in want]
        assert all(torch.equal(x["cls"], y["cls"]) for x, y in zip(got, want))
        assert len(calls) == 40  # all in the first epoch
    assert len(loader._gather.metas) == 40
    assert not _cached._memoizable({"__key__": "k", "big": b"x" * 1000})
    assert not _cached._memoizable({"t": torch.zeros(2)})
    assert _cached._memoizable({"__key__": "k", "cls": 3, "w": 0.5, "none": None})


def test_a_ring_lock_held_at_fork_does_not_hang_the_child() -> None:
    """Another thread holds the ring's lock while this one forks: the child's take() must not wait forever."""
    import multiprocessing as mp

    ring = gather.BufferRing()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ring._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_take_in_child, args=(ring, q))
        p.start()
        p.join(10)
        alive = p.is_alive()
        if alive:
            p.kill()
            p.join()
    finally:
        release.set()
        t.join()
    assert not alive and p.exitcode == 0 and q.get(timeout=5) == (2, 3)


def _take_in_child(ring: gather.BufferRing, q) -> None:
    q.put(ring.take(2, (3,), np.dtype(np.uint8), pinned=False).shape)
