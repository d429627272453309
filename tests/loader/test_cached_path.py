"""Cached fast path of fastdata.DataLoader: same batches as the worker path, exact resume across paths."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fastdata.cache import Cache
from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.errors import CacheError
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import ResizeCenterCrop
from tests.helpers.batches import assert_resumes_across_paths, assert_same, batch_keys, epoch_on_path
from tests.helpers.shards import make_shards, varied_size


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


N = 45
BAD = (5, 30)  # undecodable cls: skipped with on_error="skip"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """(shards, cache dir with a complete store for ResizeCenterCrop(16))."""
    root = tmp_path_factory.mktemp("fastpath")
    shards = make_shards(root / "ds", N, 7, image=varied_size, txt=True)
    info = _make(shards, root / "cache").build_cache()
    assert info.fill_ratio == 1.0
    return shards, root / "cache"


def _make(shards: Path, cache: Path, **kw: Any) -> ShardedDataset:
    kw.setdefault("shuffle", ShuffleOptions(open_shards=3, buffer_size=5))
    kw.setdefault("seed", 7)
    return ShardedDataset(shards, preprocess=ResizeCenterCrop(16), cache=cache, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("drop_last", "batch_size"), [(False, 4), (True, 4), (False, 64)])
def test_fast_path_equals_worker_path(data, num_workers, drop_last, batch_size):
    shards, cache = data
    kw = dict(batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
    for epoch in (0, 1):
        ds_fast, ds_work = _make(shards, cache), _make(shards, cache)
        ds_fast.set_epoch(epoch), ds_work.set_epoch(epoch)
        fast = DataLoader(ds_fast, **kw)
        got = epoch_on_path(fast, "cached")
        assert_same(got, epoch_on_path(DataLoader(ds_work, cached_fast_path=False, **kw), "workers"))
        assert len(got) == len(fast)
        assert list(got[0]) == ["__key__", "cls", "txt", "jpg"] and got[0]["jpg"].shape[1:] == (3, 16, 16)
    if not drop_last and batch_size == 4:
        assert len(set(batch_keys(got))) == N


def test_fast_path_batches_are_owned(data):
    shards, cache = data
    batches = list(DataLoader(_make(shards, cache), batch_size=8, num_workers=2))
    ptrs = {b["jpg"].untyped_storage().data_ptr() for b in batches}
    assert len(ptrs) == len(batches)  # a fresh tensor per batch, never a reused buffer
    before = batches[1]["jpg"].clone()
    batches[0]["jpg"].zero_()  # writable (not the read-only map) and independent of the other batches
    assert torch.equal(batches[1]["jpg"], before)


@pytest.mark.parametrize("rank", [0, 1])
def test_fast_path_equals_worker_path_ranks_padding_and_samples_per_epoch(data, rank):
    shards, cache = data
    for extra in ({"even": "pad"}, {"samples_per_epoch": 60}):
        make = lambda: _make(shards, cache, rank=rank, world_size=4, **extra)  # noqa: E731
        kw = dict(batch_size=3, num_workers=3)
        assert_same(epoch_on_path(DataLoader(make(), **kw), "cached"),
                    epoch_on_path(DataLoader(make(), cached_fast_path=False, **kw), "workers"))


def _strict_cls(data: bytes) -> int:
    i = int(bytes(data))
    if i in BAD:
        raise ValueError(f"bad label {i}")
    return i


def test_skipped_samples_shift_batches_like_workers(data):
    shards, cache = data
    make = lambda: _make(shards, cache, on_error="skip", decode={"cls": _strict_cls})  # noqa: E731
    ds_fast, ds_work = make(), make()
    kw = dict(batch_size=4, num_workers=2)
    fast = epoch_on_path(DataLoader(ds_fast, **kw), "cached")
    assert_same(fast, epoch_on_path(DataLoader(ds_work, cached_fast_path=False, **kw), "workers"))
    assert sum(len(b["cls"]) for b in fast) == N - len(BAD)
    assert sorted(s["key"] for s in ds_fast.skipped) == sorted(s["key"] for s in ds_work.skipped) == ["s0005", "s0030"]


def test_a_few_missing_samples_are_computed_in_process(tmp_path, monkeypatch):
    shards = make_shards(tmp_path / "ds", N, 7, image=varied_size, txt=True, bad=())
    broken = tmp_path / "broken"
    with ShardWriter(broken, max_samples=7) as w:  # sample 30 has a corrupt JPEG: it can never be cached
        for s in ShardedDataset(shards, decode=False):
            w.write({**s, "jpg": b"not a jpeg" if s["__key__"] == "s0030" else s["jpg"]})
    make = lambda: ShardedDataset(broken, preprocess=ResizeCenterCrop(16), cache=tmp_path / "c",  # noqa: E731
                                  on_error="skip", shuffle=True, seed=1)
    info = make().build_cache()
    assert info.num_valid == N - 1
    with open(info.path / "valid.bin", "r+b") as f:  # sample 12 unfilled again
        f.seek(12)
        f.write(b"\0")
    kw = dict(batch_size=4, num_workers=2)
    dl = DataLoader(make(), **kw)
    epoch_on_path(dl, "workers")
    assert "has 43 of 45 samples filled; rank 0 reads 45 in epoch 0 (at most 0 may be missing)" in dl.fallback_reason
    with open(info.path / "valid.bin", "r+b") as f:
        f.seek(12)
        f.write(b"\0")
    monkeypatch.setattr("fastdata.loader._cached.MISSING_FRACTION", 0.05)  # 2 of 45 may be missing
    ds_fast, ds_work = make(), make()
    fast = epoch_on_path(DataLoader(ds_fast, **kw), "cached")
    assert Cache(tmp_path / "c").info(info.key).num_valid == N - 1  # sample 12 was filled on the way
    assert_same(fast, epoch_on_path(DataLoader(ds_work, cached_fast_path=False, **kw), "workers"))
    assert [s["key"] for s in ds_fast.skipped] == [s["key"] for s in ds_work.skipped] == ["s0030"]


@pytest.mark.parametrize(("before", "after"), [("workers", "cached"), ("cached", "workers"), ("cached", "cached")])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_across_paths(data, before, after, num_workers):
    shards, cache = data
    mode = {"workers": False, "cached": "auto"}

    def loader(path: str, nw: int = num_workers) -> DataLoader:
        ds = _make(shards, cache)
        ds.set_epoch(2)
        return DataLoader(ds, batch_size=4, num_workers=nw, cached_fast_path=mode[path])

    assert_resumes_across_paths(loader, before, after, N)


def test_resume_with_other_worker_count_across_paths(data):
    shards, cache = data
    make = lambda: _make(shards, cache)  # noqa: E731
    full = batch_keys(DataLoader(make(), batch_size=4, num_workers=2, cached_fast_path=False))
    dl = DataLoader(make(), batch_size=4, num_workers=2, cached_fast_path=False)
    it = iter(dl)
    first = batch_keys([next(it) for _ in range(3)])
    state = dl.state_dict()
    del it
    dl2 = DataLoader(make(), batch_size=4, num_workers=3)
    dl2.load_state_dict(state)
    rest = batch_keys(epoch_on_path(dl2, "cached"))
    assert sorted(first + rest) == sorted(full) and len(first + rest) == N


def test_auto_falls_back_and_says_why(data, tmp_path):
    shards, cache = data
    # incomplete store: a fresh cache filled by half an epoch
    part = DataLoader(_make(shards, tmp_path / "c2"), batch_size=4, num_workers=0)
    it = iter(part)
    [next(it) for _ in range(3)]
    del it
    dl = DataLoader(_make(shards, tmp_path / "c2"), batch_size=4, num_workers=2)
    first = epoch_on_path(dl, "workers")  # fills the rest
    assert "lacks" in dl.fallback_reason or "filled" in dl.fallback_reason
    assert_same(epoch_on_path(dl, "cached"), first)  # complete now: the next epoch takes the fast path
    cases = [
        (dict(transform=lambda x: x.flip(-1)), {}, "transform= runs per sample"),
        (dict(sample_transform=lambda s: s), {}, "sample_transform="),
        ({}, dict(collate_fn=lambda b: b), "custom collate_fn"),
        ({}, dict(worker_init_fn=lambda w: None), "worker_init_fn"),
        ({}, dict(batch_size=None), r"batch_size=None"),
    ]
    for ds_kw, dl_kw, reason in cases:
        dl_kw.setdefault("batch_size", 4)
        dl = DataLoader(_make(shards, cache, **ds_kw), num_workers=0, **dl_kw)
        next(iter(dl))
        assert dl.last_path == "workers" and reason in dl.fallback_reason
    dl = DataLoader(ShardedDataset(shards, fields=["cls"]), batch_size=4)
    next(iter(dl))
    assert dl.last_path == "workers" and "no cache= store" in dl.fallback_reason


def test_rank_needs_only_its_own_samples(data, tmp_path):
    shards, _ = data
    make = lambda rank: _make(shards, tmp_path / "c", rank=rank, world_size=2)  # noqa: E731
    epoch_on_path(DataLoader(make(0), batch_size=4, num_workers=2), "workers")  # fills rank 0's half of epoch 0
    epoch_on_path(DataLoader(make(0), batch_size=4, num_workers=2), "cached")
    dl = DataLoader(make(1), batch_size=4, num_workers=2)
    epoch_on_path(dl, "workers")
    assert "samples rank 1 reads in epoch 0" in dl.fallback_reason


def test_forced_mode(data, tmp_path):
    shards, cache = data
    empty = DataLoader(_make(shards, tmp_path / "c3"), batch_size=4, cached_fast_path=True)
    with pytest.raises(CacheError, match=r"cached_fast_path=True: cache store .* has 0 of 45 samples filled; "
                                         r"rank 0 reads 45 in epoch 0 \(at most 0 may be missing\); fill it first"):
        iter(empty)
    with pytest.raises(ValueError, match="cached_fast_path=True: transform= runs per sample"):
        DataLoader(_make(shards, cache, transform=lambda x: x), batch_size=4, cached_fast_path=True)
    with pytest.raises(ValueError, match="cached_fast_path=True: the dataset is a list, not a fastdata.ShardedDataset"):
        DataLoader([1, 2], cached_fast_path=True)
    with pytest.raises(ValueError, match="cached_fast_path must be 'auto', True or False, got 1"):
        DataLoader([1, 2], cached_fast_path=1)
    # forced: a custom collate_fn runs in this process on the same samples
    collate = lambda b: [(s["__key__"], s["cls"], s["jpg"].sum().item()) for s in b]  # noqa: E731
    kw = dict(batch_size=5, num_workers=2, collate_fn=collate)
    forced = DataLoader(_make(shards, cache), cached_fast_path=True, **kw)
    assert epoch_on_path(forced, "cached") == epoch_on_path(DataLoader(_make(shards, cache), **kw), "workers")


def _flip(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return image.flip(-1) if torch.rand((), generator=generator) < 0.5 else image


def test_rows_a_transform_replaces_are_gathered_unpinned(data, monkeypatch):
    """With pinned fast-path batches asked for, the rows a transform replaces (read once, never handed out)
    are gathered into unpinned buffers; without a transform the batch's rows are the pinned ones. The
    batches are the worker path's either way."""
    from fastdata.loader._gather import FastGather

    shards, cache = data
    asked: list[bool] = []
    real = FastGather.batch

    def batch(self: FastGather, store: Any, rows: list[int], *, pinned: bool) -> Any:
        asked.append(pinned)
        return real(self, store, rows, pinned=False)  # page-locked memory needs an accelerator

    monkeypatch.setattr(FastGather, "batch", batch)
    for transform, want in ((None, True), (_flip, False)):
        asked.clear()
        kw = dict(batch_size=4, num_workers=2)
        fast = DataLoader(_make(shards, cache, transform=transform), cached_fast_path=True, **kw)
        fast.pin_fast_path()
        got = epoch_on_path(fast, "cached")
        assert asked and set(asked) == {want}
        assert_same(got, epoch_on_path(DataLoader(_make(shards, cache, transform=transform), cached_fast_path=False,
                                                  **kw), "workers"))


def test_no_workers_started_and_store_held_open(data):
    shards, cache = data
    dl = DataLoader(_make(shards, cache), batch_size=8, num_workers=2, persistent_workers=True)
    epoch_on_path(dl, "cached")
    assert dl._iterator is None  # persistent workers were never started
    (info,) = Cache(cache).list()
    assert info.in_use  # the main process holds the store: safe from eviction between epochs
    assert Cache(cache, max_bytes=1).evict() == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_global_rng_and_pin_memory_match_worker_path(data, num_workers):
    shards, cache = data
    draws = []
    batches = []
    for mode in ("auto", False):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dl = DataLoader(_make(shards, cache), batch_size=8, num_workers=num_workers, pin_memory=True,
                            cached_fast_path=mode)
            batches.append(epoch_on_path(dl, "cached" if mode else "workers"))
        if not torch.accelerator.is_available():
            assert any("no accelerator is found" in str(w.message) for w in caught)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])
    assert_same(batches[0], batches[1])


def test_fill_epoch_and_cached_epoch_give_the_same_keys_in_the_same_order(tmp_path):
    shards = make_shards(tmp_path / "ds", N, 7, image=varied_size, txt=True)
    fill = list(_make(shards, tmp_path / "cache", shuffle=False))
    hit = list(_make(shards, tmp_path / "cache", shuffle=False))
    assert [list(s) for s in fill] == [list(s) for s in hit] == [["__key__", "cls", "txt", "jpg"]] * N
    assert all(torch.equal(a["jpg"], b["jpg"]) for a, b in zip(fill, hit))


def test_prefetcher_over_the_fast_path_keeps_exact_resume(data):
    from fastdata.prefetch import CUDAPrefetcher

    shards, cache = data
    full = epoch_on_path(DataLoader(_make(shards, cache), batch_size=4, num_workers=2, cached_fast_path=False), "workers")
    dl = DataLoader(_make(shards, cache), batch_size=4, num_workers=2)
    with CUDAPrefetcher(dl, device="cpu") as pf:  # reads ahead in its own thread
        it = iter(pf)
        first = [next(it) for _ in range(3)]
        state = pf.state_dict()
    assert dl.last_path == "cached" and state["batches"] == 3
    dl2 = DataLoader(_make(shards, cache), batch_size=4, num_workers=2)
    dl2.load_state_dict(state)
    assert_same(first + epoch_on_path(dl2, "cached"), full)


def test_virtual_workers_keep_their_shards_open(data):
    shards, cache = data
    ds = _make(shards, cache, shuffle=ShuffleOptions(open_shards=3, buffer_size=0))
    opened = []
    real = ds.source._opener
    ds.source._opener = lambda i: opened.append(i) or real(i)
    epoch_on_path(DataLoader(ds, batch_size=2, num_workers=3), "cached")
    assert sorted(opened) == list(range(7))  # each shard opened once, not once per switch between workers


def _float_cls(data: bytes) -> float:
    return float(bytes(data)) / 4


@pytest.mark.parametrize("num_workers", [0, 3])
@pytest.mark.parametrize(("drop_last", "batch_size"), [(False, 4), (True, 4), (False, 64)])
@pytest.mark.parametrize("decode", [None, {"cls": _strict_cls}, {"cls": _float_cls}])
def test_later_epochs_collate_from_the_memo_columns(data, monkeypatch, num_workers, drop_last, batch_size, decode):
    """One loader over three epochs: from the second on, the uncached fields of whole batches come
    from MetaMemo's columns (no per-sample dicts), bit for bit what the workers give; with skipped
    samples (on_error="skip") the batches around them take the per-sample path."""
    from fastdata.loader._cached import MetaMemo

    shards, cache = data
    kw = dict(batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
    extra: dict[str, Any] = {} if decode is None else {"decode": decode, "on_error": "skip"}
    skips = decode is not None and decode["cls"] is _strict_cls
    loader = DataLoader(_make(shards, cache, **extra), **kw)
    for epoch in range(3):
        if epoch == 2 and not skips:  # every sample memoized: no per-sample lookup at all
            def per_sample(self: Any, g: int) -> Any:
                raise AssertionError(f"sample {g} looked up one by one")
            monkeypatch.setattr(MetaMemo, "get", per_sample)
        loader.dataset.set_epoch(epoch)
        got = epoch_on_path(loader, "cached")
        ref_ds = _make(shards, cache, **extra)
        ref_ds.set_epoch(epoch)
        assert_same(got, epoch_on_path(DataLoader(ref_ds, cached_fast_path=False, **kw), "workers"))
    memo = loader._gather.metas
    assert memo.regular and len(memo) == N - (len(BAD) if skips else 0)


def test_meta_memo_collates_like_default_collate():
    from torch.utils.data import default_collate

    from fastdata.loader._cached import MetaMemo

    memo = MetaMemo()
    metas = {g: {"__key__": f"k{g}", "cls": g - 7, "w": g / 3, "ok": g % 2 == 0, "raw": bytes([g % 256])}
             for g in range(0, 3000, 3)}
    for g, m in metas.items():
        memo.put(g, m)
    rows = np.array([2997, 0, 3, 1500, 3], dtype=np.int64)
    assert memo.regular and memo.has_all(rows) and not memo.has_all(np.array([1, 3]))
    got, want = memo.collate(rows), default_collate([metas[g] for g in rows.tolist()])
    assert list(got) == list(want)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        else:
            assert got[k] == want[k], k
    assert memo.get(1500) == metas[1500] and memo.get(1) is None
    d = memo.get(3)
    d["cls"] = 99  # a new dict each time: a collate_fn may change it
    assert memo.get(3)["cls"] == -4


@pytest.mark.parametrize("odd", [{"__key__": "x", "cls": 1 << 70}, {"__key__": "x", "cls": None},
                                 {"__key__": "x", "cls": True}, {"cls": 1, "__key__": "x"},
                                 {"__key__": "x"}, {"__key__": "x", "cls": "1"}])
def test_meta_memo_turns_irregular_and_keeps_every_sample(odd):
    from fastdata.loader._cached import MetaMemo

    memo = MetaMemo()
    memo.put(0, {"__key__": "a", "cls": 1})
    memo.put(5, odd)
    assert not memo.regular and not memo.has_all(np.array([0]))
    assert memo.get(0) == {"__key__": "a", "cls": 1} and memo.get(5) == odd and len(memo) == 2
    memo.put(7, {"__key__": "b", "cls": 2})
    assert memo.get(7) == {"__key__": "b", "cls": 2}


def test_meta_memo_limit_and_unmemoizable_values():
    from fastdata.loader._cached import MetaMemo

    memo = MetaMemo(limit=2)
    memo.put(0, {"__key__": "x" * 300})  # too long to keep
    memo.put(1, {"__key__": "a"})
    memo.put(2, {"__key__": "b"})
    memo.put(3, {"__key__": "c"})  # over the limit
    assert [memo.get(g) for g in range(4)] == [None, {"__key__": "a"}, {"__key__": "b"}, None] and len(memo) == 2


def test_meta_memo_skips_a_long_value_and_stays_regular():
    from fastdata.loader._cached import MetaMemo

    memo = MetaMemo()
    memo.put(0, {"__key__": "a", "cls": 1})
    memo.put(1, {"__key__": "b" * 300, "cls": 2})  # not kept; the others stay in columns
    memo.put(2, {"__key__": "c", "cls": 3})
    assert memo.regular and memo.get(1) is None and memo.has_all(np.array([0, 2])) and len(memo) == 2


def test_cached_path_state_moves_past_skips_after_a_workers_last_batch(tmp_path, monkeypatch) -> None:
    """A virtual worker whose walk ends in skipped samples after its last batch moves its position to its end,
    as a worker process's report-only result does: the cached path's state lagged ([6, 3] against [6, 5]), and
    a resume from it read those samples again and reported their skips twice."""
    import multiprocessing as mp
    import warnings

    import numpy as np

    from fastdata import Cache, DataLoader, ShardedDataset
    from fastdata.cli._synth import jpeg_bytes, synth_image
    from fastdata.loader import _cached
    from fastdata.shards.writer import ShardWriter
    from fastdata.transforms import ResizeCenterCrop

    monkeypatch.setattr(_cached, "MISSING_FRACTION", 0.5)  # 2 bad samples of 11 may take the cached path
    with ShardWriter(tmp_path / "ds", max_samples=4) as w:
        for i in range(11):
            jpg = b"not a jpeg" if i in (9, 10) else jpeg_bytes(synth_image(np.random.default_rng(i), 20, 24), 90)
            w.write({"__key__": f"k{i:03d}", "jpg": jpg, "cls": i})

    def make(cache: Cache | None) -> ShardedDataset:
        return ShardedDataset(tmp_path / "ds", preprocess=ResizeCenterCrop(8), on_error="skip", cache=cache)

    cache = Cache(tmp_path / "cache")
    kw = dict(batch_size=3, num_workers=2, multiprocessing_context=mp.get_context("fork"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make(cache).build_cache()
        states = {}
        for path, c in (("workers", None), ("cached", cache)):
            loader = DataLoader(make(c), **kw)
            assert sum(1 for _ in loader) == 3 and loader.last_path == path
            states[path] = loader.state_dict()["dataset"]["stages"]
    assert states["cached"] == states["workers"] == [[2, [6, 5]]]
