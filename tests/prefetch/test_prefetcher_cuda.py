"""CUDA tests of CUDAPrefetcher (skipped without a GPU by tests/conftest.py).

The consumer here is deliberately slow *on the GPU* (``torch.cuda._sleep`` on its stream before it
reads a batch) and drops each batch right after reading it, so a missing stream wait, a missing
``record_stream`` or a pinned buffer reused too early shows up as wrong values."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from fastdata.gpu import IMAGENET_MEAN, IMAGENET_STD, Normalize
from fastdata.prefetch import CUDAPrefetcher, _stage as stage


pytestmark = pytest.mark.cuda


DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    """Calibrate torch.cuda._sleep (spins for a number of GPU clock cycles)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 2_000_000
    torch.cuda._sleep(n)  # warm-up
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / max(start.elapsed_time(end), 1e-3)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Exact, order-independent checksum of a tensor's values (int64, on the tensor's device)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(raw.numel(), device=t.device, dtype=torch.int64) % 251 + 1
    return (raw * weights).sum() + raw.numel()


def _random_batch(g: torch.Generator, i: int, max_n: int = 16) -> dict:
    n = int(torch.randint(1, max_n + 1, (1,), generator=g))
    img = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
    if i % 3 == 0:
        img = img.contiguous(memory_format=torch.channels_last)
    return {
        "img": img,
        "feat": torch.randn(n, 17, generator=g).t(),  # dense, non-contiguous
        "cls": torch.randint(0, 1000, (n,), generator=g),
        "mask": torch.rand(n, 5, generator=g) > 0.5,
        "pair": (torch.randn(2, n, dtype=torch.float64, generator=g), f"key{i}"),
        "idx": i,
    }


def _leaves(batch: dict) -> list[torch.Tensor]:
    return [batch["img"], batch["feat"], batch["cls"], batch["mask"], batch["pair"][0]]


def _threads() -> list[str]:
    deadline = time.monotonic() + 20  # a hang guard: threads end within ms when they end
    while time.monotonic() < deadline:
        names = [t.name for t in threading.enumerate() if t.name.startswith("fastdata-prefetch")]
        if not names:
            return []
        time.sleep(0.01)
    return names


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_equals_sync_copy_with_slow_consumer(depth: int, cycles_per_ms: float) -> None:
    g = torch.Generator().manual_seed(depth)
    batches = [_random_batch(g, i) for i in range(150)]
    expected = [[int(_digest(t.to(DEV))) for t in _leaves(b)] for b in batches]
    pf = CUDAPrefetcher(batches, device=DEV, depth=depth)
    digests = []
    for epoch in range(2):
        got = []
        for i, b in enumerate(pf):
            assert b["idx"] == i and b["pair"][1] == f"key{i}"
            assert all(t.device == DEV for t in _leaves(b))
            assert b["img"].stride() == batches[i]["img"].stride()
            torch.cuda._sleep(int(cycles_per_ms * (0.5 if i % 7 else 3)))  # slow, uneven GPU consumer
            got.append(torch.stack([_digest(t) for t in _leaves(b)]))
            del b  # drop it at once: the allocator may hand the memory out again
        digests.append([d.tolist() for d in got])
    torch.cuda.synchronize()
    assert digests[0] == expected and digests[1] == expected
    s = pf.stats()
    assert s["batches"] == 300 and s["bytes"] > 0 and s["copy_s"] > 0 and s["copy_gbps"] > 0
    pf.close()
    assert not _threads()


def test_busy_copy_stream_new_epoch_and_consumer_wait(cycles_per_ms: float) -> None:
    """The side stream is kept busy before each epoch, so every copy of an epoch is still queued when
    the consumer has taken all of its batches and the next epoch packs the same pinned slots again.
    Catches a slot repacked before its copy ran and a consumer stream that does not wait for the copy."""

    class Epochs:  # different contents every epoch, so a repacked slot shows as a wrong value
        epoch = 0

        def __iter__(self):
            e, self.epoch = self.epoch, self.epoch + 1
            return iter([torch.full((1 << 18,), 10 * e + i, dtype=torch.int64) for i in range(3)])

    pf = CUDAPrefetcher(Epochs(), device=DEV, depth=2)  # 3 slots, 3 batches: epoch e+1 reuses epoch e's slots
    got = []
    for _ in range(6):
        with torch.cuda.stream(stage.side_stream(DEV)):
            torch.cuda._sleep(int(cycles_per_ms * 20))
        for b in pf:
            got.append(torch.stack([b.min(), b.max()]))
            del b
    torch.cuda.synchronize()
    pf.close()
    assert [g.tolist() for g in got] == [[10 * e + i] * 2 for e in range(6) for i in range(3)]
    assert not _threads()


def test_batch_tensors_already_on_device_are_ordered(cycles_per_ms: float) -> None:
    """A loader that makes device tensors (on the prefetch thread's stream, late): the transform on the
    side stream and the consumer must both see the finished values."""
    n = 1 << 20

    def source():
        for i in range(20):
            x = torch.empty(n, dtype=torch.int32, device=DEV)
            torch.cuda._sleep(int(cycles_per_ms * 2))  # on the producer thread's current stream
            x.fill_(i)
            yield {"x": x, "i": i}

    class Re:
        def __iter__(self):
            return source()

    got = []
    with CUDAPrefetcher(Re(), device=DEV, transform=lambda b: {**b, "y": b["x"] * 2}) as pf:
        for b in pf:
            assert b["x"].device == DEV and b["y"].device == DEV
            got.append((b["i"], torch.stack([b["x"].min(), b["x"].max(), b["y"].min(), b["y"].max()])))
            del b
        torch.cuda.synchronize()
    assert [(i, g.tolist()) for i, g in got] == [(i, [i, i, 2 * i, 2 * i]) for i in range(20)]


def test_transforms_match_cpu_reference() -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (8, 3, 24, 24), dtype=torch.uint8, generator=g), torch.arange(8)) for _ in range(10)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        norm = Normalize(IMAGENET_MEAN, IMAGENET_STD, dtype=dtype, channels_last=True)
        cpu_norm = Normalize(IMAGENET_MEAN, IMAGENET_STD, dtype=dtype, channels_last=True)
        with CUDAPrefetcher(batches, device=DEV, transform=norm) as pf:
            for (img, label), (src, src_label) in zip(pf, batches):
                assert img.device == DEV and img.dtype == dtype
                assert img.is_contiguous(memory_format=torch.channels_last)
                assert label.device == DEV and torch.equal(label.cpu(), src_label)
                ref = cpu_norm(src)
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(img.cpu().float(), ref.float(), atol=tol, rtol=tol)
                # against the plain formula as well
                m = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
                s = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
                plain = ((src.float() / 255 - m) / s).to(dtype).float()
                torch.testing.assert_close(img.cpu().float(), plain, atol=tol * 2, rtol=tol * 2)


def _host_allocs() -> int | None:
    stats = torch.cuda.host_memory_stats()
    for key in ("num_host_alloc", "allocations.allocated"):
        if key in stats:
            return int(stats[key])
    return None


def test_no_pinned_allocation_after_warmup() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [_random_batch(g, i) for i in range(40)]
    pf = CUDAPrefetcher(batches, device=DEV, depth=2)
    for _ in range(2):  # warm-up: the ring reaches the largest batch size
        for b in pf:
            pass
    torch.cuda.synchronize()
    ours, host = pf.stats()["pinned_allocs"], _host_allocs()
    assert 0 < ours <= 3 * 2
    for _ in range(5):
        for b in pf:
            pass
    torch.cuda.synchronize()
    assert pf.stats()["pinned_allocs"] == ours
    if host is not None:
        assert _host_allocs() == host
    assert pf.stats()["pinned_bytes"] > 0
    pf.close()
    assert pf.stats()["pinned_bytes"] == 0


def test_memory_reserved_flat_over_30_epochs() -> None:
    g = torch.Generator().manual_seed(2)
    batches = [_random_batch(g, i, max_n=64) for i in range(20)]
    pf = CUDAPrefetcher(batches, device=DEV, depth=2, transform=Normalize(dtype=torch.bfloat16))
    reserved = []
    for epoch in range(30):
        for b in pf:
            b["img"].float().mean()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved(DEV))
    pf.close()
    # no growth after warm-up (one small-pool segment of slack for timing-dependent reuse)
    assert max(reserved[10:]) <= max(reserved[:10]) + (2 << 20), reserved
    assert reserved[-1] == reserved[-5], reserved
    assert stage.side_stream(DEV) is pf._stager.stream  # one persistent stream, not one per epoch


@pytest.mark.parametrize("depth", [1, 2])
def test_backpressure_bounds_device_memory(cycles_per_ms: float, depth: int) -> None:
    """The documented bound, at epoch boundaries too: device memory for batches never exceeds
    (depth + 1) batches plus the one the consumer still holds, although the host never syncs and
    runs far ahead of the GPU; and the allocator does not grow either (the producer waits for the GPU)."""
    nbytes = 16 << 20
    batch = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    acc = torch.zeros((), dtype=torch.int64, device=DEV)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(DEV)
    with CUDAPrefetcher([batch] * 12, device=DEV, depth=depth) as pf:
        for b in pf:  # warm-up epoch: the caching allocator reaches its working set
            acc += b[-4096:].sum()
        del b
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(DEV)
        reserved = torch.cuda.memory_reserved(DEV)
        for epoch in range(3):
            for b in pf:
                torch.cuda._sleep(int(cycles_per_ms * 5))  # the GPU is the bottleneck
                acc += b[-4096:].sum()  # reads the batch; no batch-sized temporaries
        torch.cuda.synchronize()
        s = pf.stats()
    peak = torch.cuda.max_memory_allocated(DEV) - base
    assert peak <= (depth + 2) * nbytes + (1 << 20), (peak / nbytes, s)
    assert torch.cuda.memory_reserved(DEV) <= reserved + 2 * nbytes, (torch.cuda.memory_reserved(DEV), reserved)
    assert s["throttle_s"] > 0 and s["lookahead_epochs"] >= 3


def test_pinned_slots_are_exact_size() -> None:
    """Staging slots are registered memory of the batch's size (+ <= 1/16), not PyTorch's
    power-of-two pinned blocks: pinned memory is bounded by (depth + 1) batches."""
    depth = 2
    nbytes = 38_535_168  # 256 x 3 x 224 x 224 uint8: 64 MiB per slot if rounded to a power of two
    batches = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(2)] * 3
    before = len(stage._REGISTERED)  # slots of other live prefetchers, if any
    with CUDAPrefetcher(batches, device=DEV, depth=depth) as pf:
        for b in pf:
            pass
        torch.cuda.synchronize()
        s = pf.stats()
        assert len(stage._REGISTERED) == before + depth + 1, "cudaHostRegister path not taken (fallback allocator)"
    assert s["pinned_bytes"] == (depth + 1) * stage.slot_capacity(nbytes) <= (depth + 1) * nbytes * 17 // 16, s
    assert len(stage._REGISTERED) == before  # unregistered at close


def test_parallel_pack_equals_reference(cycles_per_ms: float) -> None:
    g = torch.Generator().manual_seed(11)
    batches = []
    for i in range(8):
        img = torch.randint(0, 256, (4, 3, 600, 700), dtype=torch.uint8, generator=g)  # 5 MB
        batches.append({"img": img.contiguous(memory_format=torch.channels_last) if i % 2 else img,
                        "t": torch.randn(500, 900, generator=g).t(), "cls": torch.arange(4) + i})
    expected = [[int(_digest(t.to(DEV))) for t in (b["img"], b["t"], b["cls"])] for b in batches]
    with CUDAPrefetcher(batches, device=DEV, depth=2, pack_threads=4) as pf:
        for epoch in range(2):
            got = []
            for b in pf:
                torch.cuda._sleep(int(cycles_per_ms * 1))
                got.append(torch.stack([_digest(b[k]) for k in ("img", "t", "cls")]))
                del b
            assert [x.tolist() for x in got] == expected
        s = pf.stats()
    assert s["pack_threads"] == 4 and s["pack_gbps"] > 0


def test_pinned_source_is_copied_directly() -> None:
    class DS(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((3, 8, 8), i, dtype=torch.uint8), "y": i}

    loader = torch.utils.data.DataLoader(DS(), batch_size=8, num_workers=2, pin_memory=True, persistent_workers=True)
    pf = CUDAPrefetcher(loader, device=DEV)
    for epoch in range(3):
        ys = []
        for b in pf:
            assert b["x"].device == DEV and b["y"].device == DEV
            assert torch.equal(b["x"][:, 0, 0, 0].long().cpu(), b["y"].cpu())
            ys.extend(b["y"].tolist())
        assert ys == list(range(64))
    assert pf.stats()["pinned_allocs"] == 0  # everything came pinned: no staging needed
    pf.close()


def test_keep_on_host_and_passthrough() -> None:
    on_dev = torch.ones(3, device=DEV)
    batches = [{"x": torch.full((4,), i), "meta": {"ids": torch.arange(2)}, "dev": on_dev, "s": "a"} for i in range(5)]
    with CUDAPrefetcher(batches, device=DEV, keep_on_host=["meta"]) as pf:
        for i, b in enumerate(pf):
            assert b["x"].device == DEV and int(b["x"][0]) == i
            assert b["meta"] is batches[i]["meta"] and b["meta"]["ids"].device.type == "cpu"
            assert b["dev"] is on_dev and b["s"] == "a"


def test_errors_break_close_cuda() -> None:
    def source():
        for i in range(5):
            yield torch.full((1024,), i)
        raise KeyError("shard-000003.tar: missing member")

    class Re:
        def __iter__(self):
            return source()

    pf = CUDAPrefetcher(Re(), device=DEV)
    seen = []
    with pytest.raises(KeyError, match="missing member"):
        for b in pf:
            seen.append(int(b[0]))
    assert seen == [0, 1, 2, 3, 4]
    for b in pf:
        break
    pf.close()
    pf.close()
    assert not _threads()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_local_rank_selects_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    with CUDAPrefetcher([torch.ones(2)] * 3, depth=1) as pf:
        assert pf.device == torch.device("cuda", 1)
        for b in pf:
            assert b.device == torch.device("cuda", 1)


def test_cached_fast_path_gathers_pinned_and_reuses_buffers(tmp_path) -> None:
    """A CUDAPrefetcher over fastdata.DataLoader: the cached fast path gathers straight into pinned,
    reused buffers (copied directly, no pack); a buffer is reused only after its copy finished, so
    every batch arrives intact although the host runs ahead."""
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.transforms import ResizeCenterCrop
    from tests.helpers.shards import make_shards

    make_shards(tmp_path / "ds", 96, 16, image=(80, 72))

    def make() -> ShardedDataset:
        return ShardedDataset(tmp_path / "ds", preprocess=ResizeCenterCrop(64), cache=tmp_path / "cache",
                              shuffle=True, seed=1)

    make().build_cache()
    ref_loader = DataLoader(make(), batch_size=16, num_workers=2)
    ref = {}
    for epoch in range(3):
        ref_loader.set_epoch(epoch)
        ref[epoch] = [(b["__key__"], b["jpg"].clone()) for b in ref_loader]
    loader = DataLoader(make(), batch_size=16, num_workers=2, gather_threads=2)
    with CUDAPrefetcher(loader, device=DEV, depth=2) as pf:
        assert loader.fast_path_pinned
        for epoch in range(3):
            pf.set_epoch(epoch)
            got = []
            for b in pf:
                assert loader.last_path == "cached" and b["jpg"].device == DEV
                torch.cuda._sleep(2_000_000)  # a slow GPU, a host that never waits: a buffer
                got.append((b["__key__"], b["jpg"] + 0))  # reused too early would show as wrong pixels
            torch.cuda.synchronize()
            assert [k for k, _ in got] == [k for k, _ in ref[epoch]]
            assert all(torch.equal(x.cpu(), y) for (_, x), (_, y) in zip(got, ref[epoch]))
        s = pf.stats()
    assert s["pinned_allocs"] <= 3  # only the small 'cls' field is packed; images come pinned
    assert loader._gather.ring.allocated <= 8  # reused across batches and epochs


def test_high_priority_side_stream() -> None:
    lo, hi = torch.cuda.Stream.priority_range()  # (lowest priority, highest priority): hi <= lo
    batches = [{"x": torch.full((1 << 16,), i, dtype=torch.int32)} for i in range(6)]
    pf = CUDAPrefetcher(batches, device=DEV, stream_priority="high")
    got = [int(b["x"][-1]) for b in pf]
    assert got == list(range(6))
    assert pf._stager.stream.priority == hi and stage.side_stream(DEV).priority == 0
    assert stage.side_stream(DEV, True) is pf._stager.stream  # one per device and priority
    pf.close()
