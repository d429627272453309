"""DataLoader(decode_threads=N): the same batches, order and resume states as worker processes, in
threads, with batch buffers that are reused but never overwritten under their holder."""
from __future__ import annotations

import gc
import multiprocessing
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastdata
from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.errors import DecodeError
from fastdata.loader import DataLoader, _pool, _rows, _threads
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import ResizeCenterCrop
from tests.helpers.batches import assert_resumes_across_paths, assert_same, batch_keys, epoch_on_path
from tests.helpers.shards import make_shards, varied_size


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


N = 45
BAD = (5, 30)  # corrupt JPEGs in the "bad" copy of the data set
SIZE = 24  # 3 x 24 x 24 uint8 = 1728 bytes: big enough to be written in place


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("threads") / "ds", N, 7, image=varied_size, txt=True,
                       bad_field="jpg")


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("threads_bad") / "ds", N, 7, image=varied_size, txt=True,
                       bad_field="jpg", bad=BAD)


def _make(shards: Path, **kw: Any) -> ShardedDataset:
    kw.setdefault("shuffle", ShuffleOptions(open_shards=3, buffer_size=5))
    kw.setdefault("seed", 7)
    kw.setdefault("preprocess", ResizeCenterCrop(SIZE))
    return ShardedDataset(shards, **kw)


def _decode_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fastdata-decode")]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize(("drop_last", "batch_size"), [(False, 4), (True, 4), (False, 64)])
def test_threads_equal_worker_path(shards, num_workers, drop_last, batch_size):
    kw = dict(batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
    for epoch, threads in ((0, 2), (1, 3)):
        ds_t, ds_w = _make(shards), _make(shards)
        ds_t.set_epoch(epoch), ds_w.set_epoch(epoch)
        dl = DataLoader(ds_t, decode_threads=threads, **kw)
        got = epoch_on_path(dl, "threads")
        assert_same(got, epoch_on_path(DataLoader(ds_w, **kw), "workers"))
        assert len(got) == len(dl)
        assert set(got[0]) == {"__key__", "jpg", "cls", "txt"} and got[0]["jpg"].shape[1:] == (3, SIZE, SIZE)
    if not drop_last and batch_size == 4:
        assert sorted(batch_keys(got)) == [f"s{i:04d}" for i in range(N)]
    assert _decode_threads_alive() == []


@pytest.mark.parametrize("rank", [0, 1])
def test_threads_equal_worker_path_ranks_padding_and_samples_per_epoch(shards, rank):
    for extra in ({"even": "pad"}, {"samples_per_epoch": 60}):
        make = lambda extra=extra: _make(shards, rank=rank, world_size=4, **extra)  # noqa: E731
        kw = dict(batch_size=3, num_workers=3)
        assert_same(epoch_on_path(DataLoader(make(), decode_threads=2, **kw), "threads"),
                    epoch_on_path(DataLoader(make(), **kw), "workers"))


def test_samples_are_written_in_place_and_buffers_are_reused(shards):
    ds = _make(shards, shuffle=False)
    start = ds.loader_seam.epoch_start(2)
    it = _threads.thread_batches(ds, start, threads=2, batch_size=4, drop_last=False,
                                 collate_fn=torch.utils.data.default_collate, pin=None)
    ref = list(DataLoader(_make(shards, shuffle=False), batch_size=4, num_workers=2))
    got = []
    for j, fb in enumerate(it):  # the consumer drops each batch: buffers come back to the ring
        assert torch.equal(fb.batch["jpg"], ref[j]["jpg"]) and fb.batch["__key__"] == ref[j]["__key__"]
        got.append(fb.batch["__key__"])
        del fb
    assert it.stats["in_place"] > N // 2  # after the first sample fixed the layout, rows land in place
    assert it.stats["allocated"] <= _threads.LOOKAHEAD + 1 + _rows.RING_SPARE  # bounded memory


def test_batches_held_by_the_consumer_are_never_overwritten(shards):
    ref = list(DataLoader(_make(shards), batch_size=2, num_workers=2))
    dl = DataLoader(_make(shards), batch_size=2, num_workers=2, decode_threads=2)
    kept = []
    for j, batch in enumerate(dl):  # keep every third batch (a view, a NumPy array or the dict)
        if j % 3 == 0:
            kept.append((j, batch["jpg"][:1]))
        elif j % 3 == 1:
            kept.append((j, batch["jpg"].numpy()))
        del batch
    for j, x in kept:
        assert torch.equal(torch.as_tensor(x), ref[j]["jpg"][: len(x)]), f"batch {j} was overwritten"


def test_storage_use_count_sees_views_and_numpy():
    """Guards the torch behaviour the buffer ring relies on (torch._C._storage_Use_Count)."""
    t = torch.zeros(4, 8)
    base = _rows.storage_users(t)
    v = t[:2]
    assert _rows.storage_users(t) > base
    a = v.numpy()
    del v
    assert _rows.storage_users(t) > base  # the array keeps the view alive
    del a
    assert _rows.storage_users(t) == base
    s = t[1:3].reshape(-1)
    assert _rows.storage_users(t) > base
    del s
    assert _rows.storage_users(t) == base


@pytest.mark.parametrize(("before", "after"), [("workers", "threads"), ("threads", "workers"), ("threads", "threads")])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_across_paths(shards, before, after, num_workers):
    threads = {"workers": 0, "threads": 2}

    def loader(path: str) -> DataLoader:
        ds = _make(shards)
        ds.set_epoch(2)
        return DataLoader(ds, batch_size=4, num_workers=num_workers, decode_threads=threads[path])

    assert_resumes_across_paths(loader, before, after, N)
    assert _decode_threads_alive() == []


def test_resume_with_another_worker_count(shards):
    dl = DataLoader(_make(shards), batch_size=4, num_workers=2, decode_threads=2)
    it = iter(dl)
    first = batch_keys([next(it) for _ in range(3)])
    state = dl.state_dict()
    del it
    dl2 = DataLoader(_make(shards), batch_size=4, num_workers=3, decode_threads=2)
    dl2.load_state_dict(state)
    rest = batch_keys(epoch_on_path(dl2, "threads"))
    assert sorted(first + rest) == [f"s{i:04d}" for i in range(N)]


def test_dataset_state_follows_with_one_virtual_worker(shards):
    ds = _make(shards)
    it = iter(DataLoader(ds, batch_size=4, decode_threads=2))
    [next(it) for _ in range(3)]
    ref = _make(shards)
    it_ref = iter(ref)
    [next(it_ref) for _ in range(12)]
    assert ds.state_dict() == ref.state_dict()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [4, 64])
def test_skipped_samples_shift_batches_like_workers(bad_shards, num_workers, batch_size):
    ds_t, ds_w = _make(bad_shards, on_error="skip"), _make(bad_shards, on_error="skip")
    kw = dict(batch_size=batch_size, num_workers=num_workers)
    got = epoch_on_path(DataLoader(ds_t, decode_threads=2, **kw), "threads")
    assert_same(got, epoch_on_path(DataLoader(ds_w, **kw), "workers"))
    assert sum(len(b["cls"]) for b in got) == N - len(BAD)
    assert sorted(s["key"] for s in ds_t.skipped) == sorted(s["key"] for s in ds_w.skipped) == ["s0005", "s0030"]


def test_skips_and_resume(bad_shards):
    make = lambda: _make(bad_shards, on_error="skip")  # noqa: E731
    full = epoch_on_path(DataLoader(make(), batch_size=3, num_workers=2), "workers")
    for k in (2, 6, 9):
        dl = DataLoader(make(), batch_size=3, num_workers=2, decode_threads=3)
        it = iter(dl)
        first = [next(it) for _ in range(k)]
        state = dl.state_dict()
        del it
        dl2 = DataLoader(make(), batch_size=3, num_workers=2, decode_threads=1)
        dl2.load_state_dict(state)
        assert_same(first + epoch_on_path(dl2, "threads"), full)


def _worker_error_batch(bad_shards: Path) -> int:
    """How many batches the worker path yields before raising on the corrupt sample."""
    count = 0
    with pytest.raises(DecodeError):
        for _ in DataLoader(_make(bad_shards, shuffle=False), batch_size=4, num_workers=2):
            count += 1
    return count


def test_errors_reach_the_consumer_at_the_same_batch_with_traceback(bad_shards):
    expected = _worker_error_batch(bad_shards)
    # the failed worker-path iterator is cyclic garbage whose __del__ joins worker processes for
    # seconds; collected now, not by a garbage collection that happens to run in a decode thread
    gc.collect()
    count = 0
    with pytest.raises(DecodeError, match=r"s0005.*'jpg'") as info:
        for _ in DataLoader(_make(bad_shards, shuffle=False), batch_size=4, num_workers=2, decode_threads=2):
            count += 1
    assert count == expected
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "fastdata-decode-" in notes and "virtual worker" in notes and "sample 5" in notes
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_load_chunk" in frames  # the pool thread's frames are kept
    gc.collect()
    assert _decode_threads_alive() == []


def test_transform_errors_propagate(shards):
    def boom(img: Any) -> Any:
        raise RuntimeError("transform exploded")

    dl = DataLoader(_make(shards, transform=boom), batch_size=4, num_workers=2, decode_threads=2)
    with pytest.raises(RuntimeError, match="transform exploded"):
        next(iter(dl))
    gc.collect()
    assert _decode_threads_alive() == []


def test_mismatched_sample_shapes_fail_like_torch(shards):
    def odd(img: Any) -> Any:
        return img[:, : 1 + int(img.sum()) % 3]  # a size that depends on the content

    kw = dict(batch_size=4, num_workers=2)
    with pytest.raises(RuntimeError):  # in a worker: "Trying to resize storage that is not resizable"
        list(DataLoader(_make(shards, transform=odd, shuffle=False), **kw))
    gc.collect()  # the failed worker-path iterator goes now (see fastdata._util.release_frames)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):  # torch, in process
        list(DataLoader(_make(shards, transform=odd, shuffle=False), decode_threads=2, **kw))


def test_early_break_and_close_leave_no_threads(shards):
    dl = DataLoader(_make(shards), batch_size=4, num_workers=2, decode_threads=3)
    for _ in dl:
        assert len(_decode_threads_alive()) == 3
        break
    gc.collect()
    assert _decode_threads_alive() == []
    it = iter(dl)
    next(it)
    it.close()
    assert _decode_threads_alive() == []
    it.close()  # twice is fine
    with pytest.raises(StopIteration):
        next(it)


def test_threads_paused_around_fork_and_batches_unharmed(shards):
    ref = list(DataLoader(_make(shards), batch_size=4, num_workers=2))
    dl = DataLoader(_make(shards), batch_size=4, num_workers=2, decode_threads=2)
    it = iter(dl)
    got = [next(it) for _ in range(2)]
    assert _decode_threads_alive()
    _pool._pause_before_fork()  # what os.fork runs first
    assert _decode_threads_alive() == []
    it._inner._pool.ensure_running()  # another thread asking during the fork window: no restart
    assert _decode_threads_alive() == []
    _pool._resume_after_fork()  # what os.fork runs in the parent afterwards
    got.append(next(it))  # restarted on demand
    # a DataLoader with forked worker processes elsewhere, mid-epoch
    other = DataLoader(_make(shards, shuffle=False), batch_size=8, num_workers=2,
                       multiprocessing_context=multiprocessing.get_context("fork"))
    assert sum(len(b["cls"]) for b in other) == N
    got.extend(it)
    assert_same(got, ref)


def test_global_rng_matches_worker_path(shards):
    draws = []
    for threads in (2, 0):
        torch.manual_seed(0)
        epoch_on_path(DataLoader(_make(shards), batch_size=8, num_workers=2, decode_threads=threads),
               "threads" if threads else "workers")
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])


def test_pin_memory_without_accelerator_warns_like_torch(shards):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = epoch_on_path(DataLoader(_make(shards), batch_size=8, num_workers=2, pin_memory=True, decode_threads=2),
                     "threads")
    if not torch.accelerator.is_available():
        assert any("no accelerator is found" in str(w.message) for w in caught)
    assert_same(got, list(DataLoader(_make(shards), batch_size=8, num_workers=2)))


def test_custom_collate_runs_in_process(shards):
    collate = lambda b: [(s["__key__"], s["cls"], int(s["jpg"].sum())) for s in b]  # noqa: E731
    kw = dict(batch_size=5, num_workers=2, collate_fn=collate)
    assert epoch_on_path(DataLoader(_make(shards), decode_threads=2, **kw), "threads") == \
        epoch_on_path(DataLoader(_make(shards), **kw), "workers")


@pytest.mark.parametrize("kind", [tuple, list])
def test_tuple_and_list_samples_in_place(shards, kind):
    kw = dict(batch_size=4, num_workers=2)
    make = lambda: _make(shards, sample_transform=lambda s: kind((s["jpg"], s["cls"], s["__key__"])))  # noqa: E731
    got = epoch_on_path(DataLoader(make(), decode_threads=2, **kw), "threads")
    ref = epoch_on_path(DataLoader(make(), **kw), "workers")
    assert len(got) == len(ref)
    for x, y in zip(got, ref):
        assert type(x) is type(y) is list and len(x) == 3
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
    ds = make()
    it = _threads.thread_batches(ds, ds.loader_seam.epoch_start(2), threads=2, batch_size=4, drop_last=False,
                                 collate_fn=torch.utils.data.default_collate, pin=None)
    assert sum(len(fb.batch[0]) for fb in it) == N and it.stats["in_place"] > N // 2


def test_pool_threads_use_one_torch_thread_like_workers(shards):
    seen = set()

    def probe(img: Any) -> Any:
        seen.add((threading.current_thread().name.startswith("fastdata-decode"), torch.get_num_threads()))
        return img

    before = torch.get_num_threads()
    epoch_on_path(DataLoader(_make(shards, transform=probe), batch_size=8, num_workers=2, decode_threads=2), "threads")
    assert seen == {(True, 1)}
    assert torch.get_num_threads() == before  # the caller's setting is untouched


def test_cache_is_filled_from_threads_then_served_by_the_fast_path(shards, tmp_path):
    make = lambda: _make(shards, cache=tmp_path / "c")  # noqa: E731
    kw = dict(batch_size=4, num_workers=2)
    ref = epoch_on_path(DataLoader(_make(shards), **kw), "workers")
    dl = DataLoader(make(), decode_threads=2, **kw)
    first = epoch_on_path(dl, "threads")  # fills the store from two threads
    assert list(first[0]) == ["__key__", "cls", "txt", "jpg"]  # cache order of keys
    again = epoch_on_path(dl, "cached")
    assert_same(again, first)
    for a, b in zip(first, ref):
        assert a["__key__"] == b["__key__"] and torch.equal(a["jpg"], b["jpg"])


def test_option_is_validated(shards, tmp_path):
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"decode_threads must be an int >= 0 .* got"):
            DataLoader(_make(shards), batch_size=4, decode_threads=bad)
    with pytest.raises(ValueError, match="decode_threads=2: it needs a fastdata.ShardedDataset, got a list"):
        DataLoader([1, 2, 3], batch_size=2, decode_threads=2)
    with pytest.raises(ValueError, match=r"decode_threads=2: batch_size=None"):
        DataLoader(_make(shards), batch_size=None, decode_threads=2)
    with pytest.raises(ValueError, match="decode_threads=2: worker_init_fn= cannot run"):
        DataLoader(_make(shards), batch_size=4, num_workers=2, worker_init_fn=lambda w: None, decode_threads=2)
    assert DataLoader(_make(shards), batch_size=4, decode_threads=0).decode_threads == 0


@pytest.mark.cuda
def test_pinned_batches_through_the_prefetcher_cuda(shards):
    from fastdata.prefetch import CUDAPrefetcher

    ref = list(DataLoader(_make(shards), batch_size=4, num_workers=2))
    dl = DataLoader(_make(shards), batch_size=4, num_workers=2, decode_threads=2, pin_memory=True)
    first = next(iter(dl))
    assert first["jpg"].is_pinned() and first["cls"].is_pinned()
    with CUDAPrefetcher(dl, device="cuda") as pf:
        got = [{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in pf]
    assert_same(got, ref)
    plain = DataLoader(_make(shards), batch_size=4, num_workers=2, decode_threads=2)  # no pin_memory
    with CUDAPrefetcher(plain, device="cuda") as pf:  # sets fast_path_pinned: rows land page-locked
        got = [{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in pf]
    assert_same(got, ref)
    first = next(iter(plain))
    assert first["jpg"].is_pinned() and not first["cls"].is_pinned()


def test_no_worker_count_warning_without_workers(shards):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dl = DataLoader(_make(shards), batch_size=8, num_workers=16, decode_threads=2)
        assert sum(len(b["cls"]) for b in dl) == N
    assert not [w for w in caught if "worker processes in total" in str(w.message)]


def test_next_epoch_starts_in_place_with_the_same_buffers(shards):
    ds = _make(shards)

    def epoch() -> dict[str, int]:
        it = _threads.thread_batches(ds, ds.loader_seam.epoch_start(2), threads=2, batch_size=4, drop_last=False,
                                     collate_fn=torch.utils.data.default_collate, pin=None)
        for fb in it:
            del fb
        return it.stats

    first = epoch()
    assert first["copied"] > 0  # dispatched before the first sample showed the layout
    second = epoch()
    assert second["copied"] == 0 and second["in_place"] == N
    assert second["allocated"] == first["allocated"]  # no new buffers: the ring carried over


def test_a_stale_layout_is_replaced(shards):
    ds = _make(shards)
    kw = dict(batch_size=4, num_workers=2, decode_threads=2)
    epoch_on_path(DataLoader(ds, **kw), "threads")  # layout: 3 x 24 x 24
    ds.transform = lambda img: img[:, :12]  # now 3 x 12 x 24
    got = epoch_on_path(DataLoader(ds, **kw), "threads")
    ref = epoch_on_path(DataLoader(_make(shards, transform=lambda img: img[:, :12]), batch_size=4, num_workers=2), "workers")
    assert_same(got, ref)
    it = _threads.thread_batches(ds, ds.loader_seam.epoch_start(2), threads=2, batch_size=4, drop_last=False,
                                 collate_fn=torch.utils.data.default_collate, pin=None)
    assert sum(len(fb.batch["cls"]) for fb in it) == N and it.stats["copied"] == 0


def test_shard_readers_are_not_closed_under_a_reading_thread(tmp_path):
    """Many tiny shards and a wide shuffle make the dataset's reader cache evict constantly; an
    eviction must never close a reader another thread is reading (it did, before the fix)."""
    with ShardWriter(tmp_path / "ds", max_samples=3) as w:
        for i in range(600):
            w.write({"__key__": f"s{i:05d}", "bin": np.full(2000, i % 251, np.uint8).tobytes(), "cls": str(i).encode()})
    make = lambda: ShardedDataset(tmp_path / "ds", shuffle=ShuffleOptions(open_shards=1, buffer_size=500),  # noqa: E731
                                  seed=3)
    ref = batch_keys(DataLoader(make(), batch_size=16, num_workers=1))
    for _ in range(5):
        assert batch_keys(DataLoader(make(), batch_size=16, num_workers=1, decode_threads=4)) == ref


def test_hdf5_shards(tmp_path):
    with ShardWriter(tmp_path / "h5", format="hdf5", max_samples=10) as w:
        for i in range(N):
            img = synth_image(np.random.default_rng(i), 30 + (i * 7) % 20, 30 + (i * 5) % 20)
            w.write({"__key__": f"s{i:04d}", "jpg": jpeg_bytes(img, 90), "cls": i})
    make = lambda: _make(tmp_path / "h5")  # noqa: E731
    kw = dict(batch_size=4, num_workers=2)
    assert_same(epoch_on_path(DataLoader(make(), decode_threads=3, **kw), "threads"),
                epoch_on_path(DataLoader(make(), **kw), "workers"))


def test_timeout_like_torch(shards):
    def slow(img: Any) -> Any:
        time.sleep(1.0)
        return img

    dl = DataLoader(_make(shards, transform=slow), batch_size=4, num_workers=2, decode_threads=1, timeout=0.3)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.3 seconds"):
        next(iter(dl))
    gc.collect()
    deadline = time.monotonic() + 10  # the timed-out thread ends after its current sample (not joined)
    while _decode_threads_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _decode_threads_alive() == []


def test_dtypes_numpy_lacks_are_written_by_torch(shards):
    def to_bf16(s: dict[str, Any]) -> dict[str, Any]:
        return {"x": s["jpg"].to(torch.bfloat16), "k": s["__key__"]}

    make = lambda: _make(shards, sample_transform=to_bf16)  # noqa: E731
    kw = dict(batch_size=4, num_workers=2)
    got = epoch_on_path(DataLoader(make(), decode_threads=2, **kw), "threads")
    assert got[0]["x"].dtype == torch.bfloat16
    assert_same(got, epoch_on_path(DataLoader(make(), **kw), "workers"))


def _receive(q: Any, acks: Any, go: Any, out: Any) -> None:
    t = q.get()  # a batch sent by the loading process: this process maps its memory
    acks.put(True)
    go.wait(20)
    out.put(t.numpy().tobytes())


def test_a_batch_sent_to_another_process_is_not_overwritten_by_later_batches(tiny_jpeg_shards: Path) -> None:
    """A batch put on a torch.multiprocessing queue moves its storage into shared memory, which the receiving
    process maps; the ring's buffer was that storage, so the ring reused it once the sender dropped the
    batch and the receiver's tensor changed under it (worker-path batches are fresh memory each)."""
    ctx = multiprocessing.get_context("fork")
    q, acks, out, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_receive, args=(q, acks, go, out), daemon=True)
    p.start()
    try:
        dl = fastdata.DataLoader(fastdata.ShardedDataset(tiny_jpeg_shards, preprocess=ResizeCenterCrop(32)), batch_size=2,
                                 decode_threads=2)
        it = iter(dl)
        batch = next(it)["jpg"]
        sent = batch.numpy().tobytes()
        q.put(batch)
        assert acks.get(timeout=20)
        del batch
        for _ in range(2):  # more batches over the same ring
            for b in it:
                b["jpg"].fill_(0)
            it = iter(dl)
        go.set()
        assert out.get(timeout=20) == sent
    finally:
        go.set()
        p.join(20)


def _conj(s: dict[str, Any]) -> dict[str, Any]:
    return {"spec": torch.fft.fft2(s["jpg"].float()).conj(), "k": s["__key__"]}  # conjugate bit set (a lazy view)


def _quantized(s: dict[str, Any]) -> dict[str, Any]:
    return {"q": torch.quantize_per_tensor(s["jpg"].float(), 0.5, 0, torch.quint8), "k": s["__key__"]}


def _sparse(s: dict[str, Any]) -> dict[str, Any]:
    return {"sp": s["jpg"].float().to_sparse(), "k": s["__key__"]}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated, still in use
@pytest.mark.parametrize("sample_transform", [_conj, _quantized, _sparse])
def test_tensors_numpy_cannot_copy_are_collated_as_torch_collates_them(tiny_jpeg_shards: Path, sample_transform: Any) -> None:
    """Sample tensors with the conjugate bit, quantized or sparse ones were written in place through
    Tensor.numpy(), which refuses them: the thread decoder failed ("Can't call numpy() on Tensor that has
    conjugate bit set", an INTERNAL ASSERT, "can't convert Sparse layout tensor to numpy") where
    default_collate in the loading process batches the first two and refuses the third in its own words."""
    make = lambda: fastdata.ShardedDataset(tiny_jpeg_shards, preprocess=ResizeCenterCrop(32),  # noqa: E731
                                           sample_transform=sample_transform)
    outcomes = []
    for threads in (0, 2):
        try:
            outcomes.append([b for b in fastdata.DataLoader(make(), batch_size=3, decode_threads=threads)])
        except RuntimeError as e:
            outcomes.append(str(e))
    if sample_transform is _sparse:
        assert outcomes[1] == outcomes[0] and "sparse tensors are not currently supported" in outcomes[0]
        return
    (ref, got), key = outcomes, next(k for k in outcomes[0][0] if k != "k")
    assert [b["k"] for b in got] == [b["k"] for b in ref]
    for x, y in zip(got, ref):
        assert x[key].dtype == y[key].dtype and torch.equal(x[key].dequantize() if x[key].is_quantized else x[key],
                                                            y[key].dequantize() if y[key].is_quantized else y[key])
