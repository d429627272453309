"""CPU tests of CUDAPrefetcher (thread prefetch path), the batch tree walker, the GPU transforms on CPU
tensors, and the CUDA staging logic run with stand-ins for streams, events and device memory."""
from __future__ import annotations

import _thread
import collections
import contextlib
import dataclasses
import gc
import sys
import threading
import time
import traceback
import weakref
from typing import NamedTuple

import numpy as np
import pytest
import torch

from fastdata.prefetch import _stage as stage
from fastdata.prefetch._queue import Stats
from fastdata.prefetch.tree import format_path, keys_matcher, map_tensors, tensor_leaves
from fastdata.gpu import IMAGENET_MEAN, IMAGENET_STD, ChannelsLast, Compose, Normalize, ToDtype
from fastdata.prefetch import CUDAPrefetcher, PrefetchOptions, resolve_device


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


@dataclasses.dataclass(frozen=True)
class Sample:
    x: torch.Tensor
    meta: dict
    extra: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1), init=False)


def _batches(n: int = 12, seed: int = 0) -> list:
    """Predictable nested batches: contents derive from the index."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        img = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8, generator=g)
        dd = collections.defaultdict(list, {"k": torch.full((2,), i)})
        out.append(
            {
                "img": img,
                "cls": torch.arange(2) + i,
                "key": f"s{i}",
                "n": i,
                "arr": np.full(3, i),
                "pair": Pair(img.float(), i),
                "list": [torch.tensor(float(i)), "x", (torch.ones(i % 3), None)],
                "sample": Sample(torch.full((3,), i), {"id": i}),
                "dd": dd,
                "empty": torch.empty(0, 4),
            }
        )
    return out


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fastdata-prefetch")]


def _wait_no_threads(timeout: float = 20.0) -> list[str]:  # a hang guard: threads end within ms when they end
    deadline = time.monotonic() + timeout
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


def _assert_same(a, b) -> None:
    """Same structure, same types, equal tensors, identical non-tensor leaves."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a is b


# --- tree walking -------------------------------------------------------------------------------


def test_map_tensors_rebuilds_every_container_type() -> None:
    batch = _batches(3)[2]
    out = map_tensors(batch, lambda t, p: t.clone())
    _assert_same(out, batch)
    assert out["dd"].default_factory is list and out["img"] is not batch["img"]
    assert out["arr"] is batch["arr"] and out["sample"].meta is batch["sample"].meta
    paths = [format_path(p) for p, _ in tensor_leaves(batch)]
    assert "batch['pair'].image" in paths and "batch['sample'].extra" in paths and "batch['list'][2][0]" in paths
    kept = tensor_leaves(batch, skip=keys_matcher(["pair", "image", 0]))
    assert all("pair" not in p and 0 not in p for p, _ in kept)


# --- CPU prefetcher semantics ------------------------------------------------------------------------


def test_same_batches_same_order_nested() -> None:
    batches = _batches()
    with CUDAPrefetcher(batches, device="cpu", depth=3) as pf:
        got = list(pf)
        assert len(got) == len(batches)
        for g, b in zip(got, batches):
            assert g is b  # CPU without a transform: the very same objects
        assert pf.stats()["batches"] == len(batches)
    assert not _wait_no_threads()


def test_device_none_and_non_tensor_batches() -> None:
    items = ["a", 1, None, (2, "b"), {"x": [3]}]
    pf = CUDAPrefetcher(items)
    assert pf.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert list(pf) == items and len(pf) == 5
    pf.close()


def _explode_at(n: int):
    for i in range(n):
        yield torch.full((2,), i)
    raise ValueError(f"corrupt sample {n}")


class _Regen:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __iter__(self):
        return self.fn(*self.args)


def test_error_reaches_consumer_at_its_batch_with_traceback() -> None:
    pf = CUDAPrefetcher(_Regen(_explode_at, 3), device="cpu", depth=2)
    got = []
    with pytest.raises(ValueError, match="corrupt sample 3") as info:
        for b in pf:
            got.append(int(b[0]))
    assert got == [0, 1, 2]
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_explode_at" in names  # the original raising frame travelled with the exception
    if sys.version_info >= (3, 11):  # add_note: where it failed travels with the error
        assert any("at batch 3" in n and "fastdata-prefetch" in n for n in info.value.__notes__)
    assert not _wait_no_threads()
    # the prefetcher is still usable: a new epoch starts cleanly
    with pytest.raises(ValueError, match="corrupt sample 3"):
        list(pf)
    pf.close()


def test_transform_error_names_batch() -> None:
    def transform(b):
        if int(b[0]) == 2:
            raise RuntimeError("bad transform")
        return b * 10

    pf = CUDAPrefetcher([torch.full((1,), i) for i in range(5)], device="cpu", transform=transform)
    got = []
    with pytest.raises(RuntimeError, match="bad transform") as info:
        for b in pf:
            got.append(int(b[0]))
    assert got == [0, 10]
    assert "transform" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    pf.close()


def test_early_break_and_reiteration() -> None:
    batches = [torch.full((3,), i) for i in range(20)]
    pf = CUDAPrefetcher(batches, device="cpu", depth=2)
    for epoch in range(4):
        for i, b in enumerate(pf):
            assert int(b[0]) == i
            if i == epoch:
                break
        assert not _wait_no_threads(), f"thread left after break in epoch {epoch}"
    assert [int(b[0]) for b in pf] == list(range(20))
    assert pf.stats()["epochs"] == 5
    pf.close()
    assert not _threads()


def test_new_iteration_stops_the_unfinished_one() -> None:
    pf = CUDAPrefetcher(list(range(10)), device="cpu")
    first = iter(pf)
    assert next(first) == 0
    second = iter(pf)
    assert list(second) == list(range(10))
    assert list(first) == []  # the first epoch was stopped when the second started
    pf.close()


def test_close_idempotent_and_closed_behaviour() -> None:
    pf = CUDAPrefetcher(list(range(100)), device="cpu")
    it = iter(pf)
    assert next(it) == 0
    pf.close()
    pf.close()
    assert list(it) == []
    with pytest.raises(RuntimeError, match="closed"):
        iter(pf)
    assert not _wait_no_threads()


def test_gc_stops_thread() -> None:
    def slow():
        for i in range(1000):
            time.sleep(0.001)
            yield i

    pf = CUDAPrefetcher(_Regen(slow), device="cpu")
    it = iter(pf)
    next(it)
    assert _threads()
    del pf, it
    gc.collect()
    assert not _wait_no_threads()


def test_keyboard_interrupt_while_waiting() -> None:
    def slow():
        for i in range(100):
            time.sleep(0.2)
            yield i

    pf = CUDAPrefetcher(_Regen(slow), device="cpu")
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in pf:
            pass
    assert time.monotonic() - t0 < 10  # a hang guard: the source alone runs 20 s
    timer.join()
    assert not _wait_no_threads()
    pf.close()


def test_len_passthrough() -> None:
    assert len(CUDAPrefetcher(range(7), device="cpu")) == 7
    with pytest.raises(TypeError):
        len(CUDAPrefetcher(_Regen(_explode_at, 1), device="cpu"))


def test_backpressure_bounds_read_ahead() -> None:
    pulled = []

    def source():
        for i in range(30):
            pulled.append(i)
            yield i

    pf = CUDAPrefetcher(_Regen(source), device="cpu", depth=3)
    for i in pf:
        time.sleep(0.002)
        # queued (<= depth) + the one being put + the one the consumer holds
        assert len(pulled) - (i + 1) <= 3 + 1
    pf.close()


def test_overlaps_loader_and_consumer() -> None:
    """The next batch is being loaded while the consumer still holds the current one. (The time this
    saves: benchmarks/prefetch_overlap.py, recorded in docs/design/prefetch_overlap.md.)"""
    started = [threading.Event() for _ in range(6)]

    def loader():
        for i in range(6):
            started[i].set()
            yield i

    overlapped = []
    for i in CUDAPrefetcher(_Regen(loader), device="cpu"):
        overlapped.append(i == 5 or started[i + 1].wait(30))  # 30 s: a hang guard, not a speed
    assert overlapped == [True] * 6
    for e in started:
        e.clear()
    plain = iter(_Regen(loader))  # without the prefetcher the next item is loaded only when asked for
    next(plain)
    assert not started[1].is_set()


def test_stats_fields() -> None:
    def loader():
        for i in range(5):
            time.sleep(0.01)
            yield torch.zeros(4)

    pf = CUDAPrefetcher(_Regen(loader), device="cpu")
    list(pf)
    s = pf.stats()
    for key in ("batches", "wait_s", "wait_p50_s", "wait_p99_s", "bytes", "copy_s", "pinned_bytes", "load_s"):
        assert key in s
    assert s["batches"] == 5 and s["bytes"] == 0 and s["pinned_bytes"] == 0
    assert 0 < s["wait_p50_s"] <= s["wait_p99_s"] <= s["wait_max_s"] <= s["wait_s"]
    assert s["load_s"] >= 0.04
    pf.reset_stats()
    assert pf.stats()["batches"] == 0
    pf.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"depth": 0}, "depth must be an int >= 1, got 0"),
        ({"depth": "2"}, "depth must be an int >= 1, got '2'"),
        ({"depth": True}, "depth must be an int >= 1, got True"),
        ({"keep_on_host": [1.5]}, "keep_on_host keys must be str or int, got 1.5"),
        ({"keep_on_host": object()}, "keep_on_host must be a key or a sequence"),
        ({"transform": 5}, "transform must be callable or None, got 5"),
        ({"device": "meta"}, "device must be 'cpu' or a CUDA device, got 'meta'"),
        ({"device": "cuda:0"}, "device='cuda:0' requested but CUDA is not available"),
        ({"device": "nonsense"}, "device must be 'cpu', 'cuda', 'cuda:N', a CUDA index, a torch.device or None, "
                                 "got 'nonsense'"),
    ],
)
def test_argument_validation(kwargs: dict, match: str) -> None:
    if "cuda" in str(kwargs.get("device")) and torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match=match):
        CUDAPrefetcher([1], **kwargs)
    with pytest.raises(ValueError, match="iterable must be iterable"):
        CUDAPrefetcher(5)  # type: ignore[arg-type]


def test_one_shot_iterator_warns() -> None:
    with pytest.warns(UserWarning, match="one-shot iterator"):
        pf = CUDAPrefetcher(iter([1, 2]), device="cpu")
    assert list(pf) == [1, 2] and list(pf) == []
    pf.close()


def test_keep_on_host_normalised() -> None:
    assert PrefetchOptions(keep_on_host="meta").keep_on_host == ("meta",)
    assert PrefetchOptions(keep_on_host=["a", 1]).keep_on_host == ("a", 1)


def test_device_from_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device(None) == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device(0) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer, got 'one'"):
        resolve_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ValueError, match="device index 5"):
        resolve_device(None)


class _RangeDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((3, 2, 2), i, dtype=torch.uint8), "y": i, "name": f"n{i}"}


def test_torch_dataloader_persistent_workers_several_epochs() -> None:
    loader = torch.utils.data.DataLoader(
        _RangeDataset(), batch_size=4, num_workers=2, persistent_workers=True, shuffle=False
    )
    expected = [b["y"].tolist() for b in loader]
    pf = CUDAPrefetcher(loader, device="cpu", depth=2, transform=Normalize())
    assert len(pf) == len(loader) == 10
    for epoch in range(3):
        seen = []
        for i, b in enumerate(pf):
            assert b["x"].dtype == torch.float32 and b["name"] == [f"n{j}" for j in b["y"].tolist()]
            seen.append(b["y"].tolist())
            if epoch == 1 and i == 3:
                break
        assert seen == (expected[:4] if epoch == 1 else expected), epoch
        # a finished epoch keeps the thread (it already runs the next epoch); a break stops it
        if epoch == 1:
            assert not _wait_no_threads()
        else:
            assert len(_threads()) == 1
    pf.close()
    assert not _wait_no_threads()
    del loader


# --- transforms (device-side, run here on CPU tensors) ----------------------------------------------


def _reference(x: torch.Tensor, mean, std, dim: int = -3) -> torch.Tensor:
    shape = [1] * x.dim()
    shape[dim] = len(mean)
    m = torch.tensor(mean, dtype=torch.float32).view(shape)
    s = torch.tensor(std, dtype=torch.float32).view(shape)
    return (x.to(torch.float32) / 255 - m) / s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_normalize_matches_reference(dtype: torch.dtype, channels_last: bool) -> None:
    x = torch.randint(0, 256, (4, 3, 9, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batch = {"img": x, "label": torch.arange(4), "mask": torch.zeros(4, 9, 7, dtype=torch.uint8)}
    out = Normalize(IMAGENET_MEAN, IMAGENET_STD, dtype=dtype, channels_last=channels_last)(batch)
    ref = _reference(x, IMAGENET_MEAN, IMAGENET_STD)
    assert out["img"].dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out["img"].float(), ref.to(dtype).float(), atol=tol, rtol=tol)
    assert out["img"].is_contiguous(memory_format=torch.channels_last) == channels_last
    assert out["label"] is batch["label"] and out["mask"] is batch["mask"]  # not image-like: untouched


def test_normalize_single_image_keys_and_errors() -> None:
    x = torch.randint(0, 256, (3, 5, 5), dtype=torch.uint8)
    out = Normalize(keys=[0])((x, x))
    torch.testing.assert_close(out[0], _reference(x, IMAGENET_MEAN, IMAGENET_STD))
    assert out[1] is x
    gray = torch.randint(0, 256, (2, 1, 4, 4), dtype=torch.uint8)
    torch.testing.assert_close(Normalize([0.5], [0.25])(gray), _reference(gray, [0.5], [0.25]))
    f = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(Normalize(keys=["f"])({"f": f})["f"], _reference(f * 255, IMAGENET_MEAN, IMAGENET_STD))
    with pytest.raises(ValueError, match=r"batch\['m'\] has shape \(2, 4, 4\), expected 3 channels at dim -3"):
        Normalize(keys=["m"])({"m": torch.zeros(2, 4, 4, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"channels_last needs a 4-D or 5-D tensor, batch\[0\]"):
        Normalize(channels_last=True)([x])
    with pytest.raises(ValueError, match="std must be > 0"):
        Normalize(std=(0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match="mean and std differ in length"):
        Normalize(mean=(0.5,), std=(0.2, 0.2))
    with pytest.raises(ValueError, match="dtype must be one of"):
        Normalize(dtype=torch.int32)
    with pytest.raises(ValueError, match="keys must be a non-empty"):
        Normalize(keys=[])


def test_todtype_channelslast_compose() -> None:
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    torch.testing.assert_close(ToDtype(torch.float32, scale=True)(x), x.float() / 255)
    assert ToDtype(torch.float16)(x).dtype == torch.float16
    cl = ChannelsLast()({"a": x, "b": torch.zeros(3)})
    assert cl["a"].is_contiguous(memory_format=torch.channels_last) and torch.equal(cl["a"], x)
    both = Compose(ToDtype(torch.bfloat16, scale=True), ChannelsLast())(x)
    assert both.dtype == torch.bfloat16 and both.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not callable"):
        Compose(ToDtype(), 3)


def test_prefetcher_with_transform_on_cpu() -> None:
    batches = [(torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8), torch.tensor([i])) for i in range(6)]
    norm = Normalize(dtype=torch.float32)
    with CUDAPrefetcher(batches, device="cpu", transform=norm) as pf:
        for (img, label), (src, lab) in zip(pf, batches):
            torch.testing.assert_close(img, _reference(src, IMAGENET_MEAN, IMAGENET_STD))
            assert label is lab


# --- CUDA staging logic, run on CPU with stand-ins for streams, events and device memory -----------


class _FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.recorded = 0

    def record(self, stream=None) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.5


class _FakeStream:
    def wait_event(self, event) -> None:
        assert event.recorded

    def wait_stream(self, stream) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict:
    counts = {"pinned": 0, "device": 0, "high_priority_streams": 0}

    def pinned(n: int) -> torch.Tensor:
        counts["pinned"] += 1
        return torch.empty(n, dtype=torch.uint8)

    def device_empty(n: int, device) -> torch.Tensor:
        counts["device"] += 1
        return torch.full((n,), 0xAB, dtype=torch.uint8)  # garbage, like fresh device memory

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    def side_stream(d, high_priority: bool = False) -> _FakeStream:
        counts["high_priority_streams"] += high_priority
        return _FakeStream()

    monkeypatch.setattr(stage, "side_stream", side_stream)
    monkeypatch.setattr(stage, "_pinned_empty", pinned)
    monkeypatch.setattr(stage, "_device_empty", device_empty)
    monkeypatch.setattr(stage, "_to_device", lambda t, d: t.clone())
    monkeypatch.setattr(stage, "_set_current_stream", lambda s: None)
    return counts


def _random_batch(g: torch.Generator, i: int) -> dict:
    n = int(torch.randint(1, 5, (1,), generator=g))
    img = torch.randint(0, 256, (n, 3, 6, 5), dtype=torch.uint8, generator=g)
    return {
        "img": img.contiguous(memory_format=torch.channels_last) if i % 2 else img,
        "f": torch.randn(n, 7, generator=g).t(),  # non-contiguous, dense
        "exp": torch.randn(3, 1, generator=g).expand(3, 4),  # overlapping: packed contiguous
        "b": torch.rand(n, generator=g) > 0.5,
        "d": torch.randn(2, 2, dtype=torch.float64, generator=g),
        "s": torch.tensor(i),
        "z": torch.empty(0, 3),
        "meta": {"key": f"k{i}", "host": torch.full((2,), i)},
    }


def test_cuda_stager_logic_on_cpu(fake_cuda: dict) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [_random_batch(g, i) for i in range(40)]
    expected = [map_tensors(b, lambda t, p: t.clone()) for b in batches]
    pf = CUDAPrefetcher(batches, device="cuda", depth=2, keep_on_host=["host"])
    got = []
    for b in pf:
        got.append(b)  # keep every batch: later copies must never overwrite earlier ones
    for b, src, e in zip(got, batches, expected):
        _assert_same(b, e)
        assert b["meta"]["host"] is src["meta"]["host"] and b["meta"]["key"] == src["meta"]["key"]
        assert b["img"].stride() == src["img"].stride() and b["f"].stride() == src["f"].stride()
        assert b["img"].data_ptr() != src["img"].data_ptr()
    s = pf.stats()
    assert s["batches"] == 40 and s["bytes"] > 0
    # the next epoch is already staged ahead (at most depth batches)
    assert 0 <= s["queued_bytes"] <= 2 * s["peak_batch_bytes"]
    assert s["pinned_allocs"] == fake_cuda["pinned"] <= 3 * 6  # 3 slots, each grows a few times
    allocs = s["pinned_allocs"]
    assert list(pf)[5]["s"] == 5  # a second epoch reuses the ring: no new pinned buffers
    assert pf.stats()["pinned_allocs"] == allocs and pf.stats()["copy_s"] > 0
    pf.close()
    assert pf.stats()["pinned_bytes"] == 0 and pf.stats()["queued_bytes"] == 0
    assert not _wait_no_threads()


def test_cuda_stager_ring_growth_and_queued_bytes_on_cpu(fake_cuda: dict) -> None:
    depth = 2
    same = [torch.full((1000,), i, dtype=torch.uint8) for i in range(10)]
    with CUDAPrefetcher(same, device="cuda", depth=depth) as pf:
        assert [int(b[0]) for b in pf] == list(range(10))
        assert pf.stats()["pinned_allocs"] == depth + 1  # one buffer per ring slot, each slot used in turn
    # a batch size that keeps growing: slots grow to powers of two, not once per batch
    growing = [torch.zeros(stage.MIN_SLOT_BYTES + k * 20_000, dtype=torch.uint8) for k in range(60)]
    with CUDAPrefetcher(growing, device="cuda", depth=depth) as pf:
        assert sum(1 for _ in pf) == 60
        # each slot holds the largest batch it staged, rounded up by at most 1/16: the documented bound
        largest = growing[-1].numel()
        assert pf.stats()["pinned_bytes"] <= (depth + 1) * stage.slot_capacity(largest) <= (depth + 1) * largest * 17 / 16
        assert pf.stats()["pinned_allocs"] <= 60
        for i, _ in enumerate(pf):
            if i == 3:
                time.sleep(0.2)  # let the thread fill the queue
                assert pf.stats()["queued_bytes"] > 0
                break
        assert pf.stats()["queued_bytes"] == 0  # batches staged ahead and dropped at the break
    assert stage.slot_capacity(1) == stage.MIN_SLOT_BYTES
    assert stage.slot_capacity((1 << 20) + 1) == (1 << 20) + (1 << 16)  # granule 2 MiB / 32
    assert stage.slot_capacity(38_535_168) == 19 << 21  # 256 x 3 x 224 x 224: 3.4% over
    for n in (65_537, 99_999, 1 << 22, (1 << 22) + 1, 38_535_168, 10**9 + 7):
        assert n <= stage.slot_capacity(n) <= n * 17 / 16
    assert not _wait_no_threads()


def test_cuda_stager_packing_strides() -> None:
    buf = torch.zeros(1 << 12, dtype=torch.uint8)
    cases = [
        torch.randn(3, 4).t(),
        torch.randint(0, 9, (2, 3, 4, 5), dtype=torch.int16).contiguous(memory_format=torch.channels_last),
        torch.randn(1, 3, 1, 2),
        torch.randn(3, 1).expand(3, 5),
        torch.randn(6)[::2],
        torch.tensor(7.0),
    ]
    offset = 0
    for t in cases:
        dst = stage._view(buf, offset, t)
        dst.copy_(t)
        assert torch.equal(dst, t)
        offset += -(-t.numel() * t.element_size() // stage.ALIGN) * stage.ALIGN
    assert stage._dense_strides(cases[0]) == (1, 4)
    assert stage._dense_strides(cases[3]) == (5, 1)  # overlapping -> contiguous
    assert stage._dense_strides(cases[4]) == (1,)  # strided gaps -> contiguous


class _FakeGpu:
    """The consumer's GPU work as a counter that a 'GPU' thread drains one step per ``step_s``; events
    recorded on the consumer stream complete when it has passed them, side-stream events at once."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.enqueued, self.done = step_s, 0, 0
        self.cv = threading.Condition()
        self.stopped = False
        self.consumer = _FakeStream()
        self.thread = threading.Thread(target=self._run, name="test-fake-gpu", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            time.sleep(self.step_s)
            with self.cv:
                if self.done < self.enqueued:
                    self.done += 1
                    self.cv.notify_all()

    def enqueue(self) -> None:
        with self.cv:
            self.enqueued += 1

    def stop(self) -> None:
        self.stopped = True
        self.thread.join()


@pytest.fixture
def fake_gpu(fake_cuda: dict, monkeypatch: pytest.MonkeyPatch):
    """fake_cuda plus GPU progress and live device allocations (index, live count, GPU steps done)."""
    gpu = _FakeGpu(0.002)

    class Event(_FakeEvent):
        def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
            super().__init__()
            self.mark = 0

        def record(self, stream=None) -> None:
            super().record(stream)
            self.mark = gpu.enqueued if stream is gpu.consumer else 0

        def synchronize(self) -> None:
            with gpu.cv:
                while gpu.done < self.mark:
                    gpu.cv.wait(0.1)

        def query(self) -> bool:
            return gpu.done >= self.mark

    live: list = []
    allocs: list[tuple[int, int, int]] = []

    def device_empty(n: int, device) -> torch.Tensor:
        memory = np.full(n, 0xAB, dtype=np.uint8)  # alive as long as any view of the tensor is
        t = torch.from_numpy(memory)
        if n:
            live.append(weakref.ref(memory))
            allocs.append((len(allocs), _in_use(live, gpu), gpu.done))
        return t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.consumer)
    monkeypatch.setattr(stage, "_device_empty", device_empty)
    yield gpu, live, allocs
    gpu.stop()


def _in_use(live: list, gpu: _FakeGpu) -> int:
    """Batches whose device memory is not free for reuse: referenced on the host or with consumer work
    on them not yet finished on the GPU (batch k is the consumer's k-th GPU step)."""
    return sum(1 for k, r in enumerate(live) if r() is not None or gpu.done <= k)


_HAZARDS = {"thread": (False, False), "consumer": (True, False), "at_iter": (False, True)}


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("regime", ["gpu_bound", "host_bound"])
@pytest.mark.parametrize("start", list(_HAZARDS))
def test_device_memory_bound_across_epochs_on_fake_gpu(fake_gpu, monkeypatch, depth: int, regime: str,
                                                       start: str) -> None:
    """The documented bound: device memory for at most depth + 1 batches besides the one the consumer
    still holds (`b` of the previous step while next() runs), counting batches the GPU still works on;
    batch j is staged only once the GPU has finished the consumer's work on batch j - depth - 1. At
    epoch boundaries too (the credits carry on into the next epoch), wherever the next epoch starts:
    in the thread, in the consumer's thread behind a new thread, or at the next iter()."""
    from fastdata.prefetch import _prefetcher

    monkeypatch.setattr(_prefetcher, "_iter_hazards", lambda it: _HAZARDS[start])
    gpu, live, allocs = fake_gpu
    if regime == "host_bound":
        gpu.step_s = 0.0002
    batches = [torch.full((4096,), i, dtype=torch.uint8) for i in range(12)]
    pf = CUDAPrefetcher(batches, device="cuda", depth=depth)
    peak = 0
    for epoch in range(3):
        for i, b in enumerate(pf):  # gpu_bound: the host never waits for the GPU itself
            assert int(b[0]) == i
            gpu.enqueue()
            if regime == "host_bound":
                time.sleep(0.003)
            peak = max(peak, _in_use(live, gpu))
    pf.close()
    assert len(allocs) >= 36 and len(live) == len(allocs)
    peak = max(peak, max(n for _, n, _ in allocs))
    assert peak <= depth + 2, allocs
    if regime == "host_bound":
        assert peak >= depth + 1  # it does run ahead
    for j, _, done in allocs:
        assert done >= j - depth, (j, done, allocs)  # GPU progress: also at the starts of epochs 1 and 2
    if regime == "gpu_bound":
        assert pf.stats()["throttle_s"] > 0


def test_credits_bound_after_break_and_restart(fake_gpu) -> None:
    """A new run (after a break) inherits the last hand-overs' events: no unthrottled burst."""
    gpu, live, allocs = fake_gpu
    depth = 2
    batches = [torch.full((4096,), i, dtype=torch.uint8) for i in range(10)]
    pf = CUDAPrefetcher(batches, device="cuda", depth=depth)
    handed = 0
    for epoch in range(3):
        for i, b in enumerate(pf):
            gpu.enqueue()
            handed += 1
            if i == 4:
                break
    pf.close()
    assert max(n for _, n, _ in allocs) <= depth + 2 + 2 * depth  # + what each break dropped
    # every allocation after the first run's start waited for the GPU like a continuous run would,
    # minus the batches staged and dropped at the breaks (each break drops at most depth)
    for j, _, done in allocs:
        assert done >= j - depth - 2 * depth, (j, done)


def test_parallel_pack_on_fake_cuda(fake_cuda: dict) -> None:
    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, 256, (2, 3, 700, 1100), dtype=torch.uint8, generator=g)  # 4.6 MB
    batch = {
        "img": big,
        "cl": big.contiguous(memory_format=torch.channels_last),
        "t": torch.randn(300, 700, generator=g).t(),  # dense, transposed
        "exp": torch.randn(5, 1, generator=g).expand(5, 3),  # not dense: torch copy
        "half": torch.randn(1000, 3, generator=g).to(torch.bfloat16),
        "b": torch.rand(777, generator=g) > 0.5,
    }
    with CUDAPrefetcher([batch] * 4, device="cuda", depth=2, pack_threads=3) as pf:
        assert pf.stats()["pack_threads"] == 3
        for out in pf:
            _assert_same(out, batch)
            assert out["cl"].stride() == batch["cl"].stride() and out["t"].stride() == batch["t"].stride()
        assert any(t.name.startswith("fastdata-pack-") for t in threading.enumerate())
        s = pf.stats()
        assert s["packed_bytes"] >= 4 * 2 * big.numel() and s["pack_gbps"] > 0
    deadline = time.monotonic() + 20  # a hang guard
    while any(t.name.startswith("fastdata-pack-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name.startswith("fastdata-pack-") for t in threading.enumerate())  # closed with the prefetcher


def test_pack_split_covers_every_byte() -> None:
    a, b = np.arange(10_000, dtype=np.uint8), np.arange(3, dtype=np.uint8)
    da, db = np.zeros_like(a), np.zeros_like(b)
    chunks = stage._split([(da, a), (db, b)], 10_003, 4)
    assert len(chunks) == 4 and sum(len(s) for c in chunks for _, s in c) == 10_003
    for c in chunks:
        stage._run_copies(c)
    assert np.array_equal(da, a) and np.array_equal(db, b)
    with pytest.raises(ValueError, match="pack_threads must be an int >= 1 or None, got 0"):
        CUDAPrefetcher([1], device="cpu", pack_threads=0)
    assert 1 <= stage.default_pack_threads() <= 4


def test_stats_quantiles() -> None:
    s = Stats()
    for i in range(1, 101):
        s.add_wait(i / 100, 0)
    snap = s.snapshot()
    assert snap["wait_p50_s"] == 0.5 and snap["wait_p99_s"] == 0.99 and snap["wait_max_s"] == 1.0


# --- exact resume through the prefetcher ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_counts_only_batches_handed_over(tmp_path, num_workers: int) -> None:
    import json

    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=6) as w:
        for i in range(40):
            w.write({"__key__": f"s{i:04d}", "cls": str(i).encode()})

    def make() -> DataLoader:
        return DataLoader(ShardedDataset(tmp_path / "ds"), batch_size=3, num_workers=num_workers)

    def ids(b) -> list[int]:
        return [int(i) for i in b["cls"]]

    full = [ids(b) for b in make()]
    pf = CUDAPrefetcher(make(), device="cpu", depth=3)
    it = iter(pf)
    first = [ids(next(it)) for _ in range(4)]
    time.sleep(0.05)  # let the thread read ahead
    state = json.loads(json.dumps(pf.state_dict()))
    assert state["batches"] == 4
    pf.close()
    pf2 = CUDAPrefetcher(make(), device="cpu")
    pf2.load_state_dict(state)
    rest = [ids(b) for b in pf2]
    assert first + rest == full
    time.sleep(0.05)  # the same epoch was started ahead: the loader's own state moved on, ours did not
    done = make()
    done.load_state_dict(json.loads(json.dumps(pf2.state_dict())))
    assert list(done) == []  # epoch done: resuming replays nothing
    pf2.close()
    with pytest.raises(TypeError, match="has no state_dict"):
        CUDAPrefetcher([1, 2], device="cpu").state_dict()


# --- seamless epochs -------------------------------------------------------------------------------


class _SlowStartLoader:
    """Each epoch's first batch comes ``startup_s`` late (workers starting); then batches are quick."""

    def __init__(self, n: int, startup_s: float) -> None:
        self.n, self.startup_s, self.iters = n, startup_s, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.iters += 1
        return self._gen()

    def _gen(self):
        time.sleep(self.startup_s)
        for i in range(self.n):
            yield torch.full((4,), i)


@pytest.mark.parametrize("seamless", [True, False])
def test_seamless_epochs_start_the_next_epoch_ahead(seamless: bool) -> None:
    """The loader outpaces compute, but every epoch starts 40 ms late: with seamless epochs the next
    epoch is started while the consumer still works on the last batches, so its start-up is hidden."""
    _check_seamless_wait(seamless)


def test_epochs_started_by_the_consumer_stay_seamless(monkeypatch) -> None:
    """A loader whose iter() forks (but draws no global RNG): the thread ends after each epoch and the
    consumer starts the next one at its next next(), while it still has staged batches to take."""
    from fastdata.prefetch import _prefetcher

    monkeypatch.setattr(_prefetcher, "_iter_hazards", lambda it: (True, False))
    _check_seamless_wait(True)


def test_epochs_of_a_global_rng_loader_start_where_a_plain_loop_starts_them(monkeypatch) -> None:
    from fastdata.prefetch import _prefetcher

    monkeypatch.setattr(_prefetcher, "_iter_hazards", lambda it: (False, True))
    _check_seamless_wait(False)


def _check_seamless_wait(seamless: bool) -> None:
    # seamless: each next epoch's iterator is started ahead (its 40 ms start-up hidden behind the 2 batches
    # queued); a run that is not seamless waits the start-up at every epoch (a sleep: only ever longer). What
    # seamless saves: benchmarks/prefetch_overlap.py --part seamless (docs/design/prefetch_overlap.md).
    loader = _SlowStartLoader(8, startup_s=0.04)
    pf = CUDAPrefetcher(loader, device="cpu", depth=2, seamless=seamless)
    for epoch in range(4):
        got = []
        for b in pf:
            got.append(int(b[0]))
            time.sleep(0.04)  # compute: 2 batches ahead = 80 ms of slack > 40 ms start-up
        assert got == list(range(8))
        if epoch == 0:
            pf.reset_stats()  # the first epoch's start-up cannot be hidden
    s = pf.stats()
    pf.close()
    assert s["batches"] == 24
    # seamless: the fifth epoch is started ahead, unless close() came first
    assert loader.iters in ((4, 5) if seamless else (4,))
    if seamless:
        assert s["lookahead_epochs"] >= 3 and s["lookahead_discarded"] == 0
    else:
        assert s["wait_p99_s"] > 0.03, s  # each epoch start waits for the start-up
        assert s["lookahead_epochs"] == 0


class _Steps(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), i)


def _rng_stream(batches, epochs: int = 3) -> list[float]:
    """A training loop's use of the global torch RNG (dropout), one draw per batch; slow enough
    that the prefetcher reaches the end of each epoch while batches are still staged."""
    out = []
    for _ in range(epochs):
        for b in batches:
            out.append(float(torch.rand(()) + b[0, 0]))
            time.sleep(0.005)
    return out


@pytest.mark.parametrize("own_generator,shuffle", [(False, False), (False, True), (True, True)])
def test_training_rng_stream_is_that_of_a_plain_loop(own_generator: bool, shuffle: bool) -> None:
    """torch's DataLoader draws its workers' base seed from the global RNG at iter() unless it has a
    generator: that draw must happen where a plain loop makes it, not in the thread at a time that
    depends on thread timing (identical runs would then train differently)."""
    def loader():
        return torch.utils.data.DataLoader(
            _Steps(), batch_size=2, shuffle=shuffle,
            generator=torch.Generator().manual_seed(1) if own_generator else None)

    torch.manual_seed(0)
    want = _rng_stream(loader())
    torch.manual_seed(0)
    pf = CUDAPrefetcher(loader(), device="cpu", depth=2)
    got = _rng_stream(pf)
    s = pf.stats()
    pf.close()
    assert got == want
    # with its own generator the loader's iter() touches no global state: epochs still start ahead
    assert s["lookahead_epochs"] >= 2 if own_generator else s["lookahead_epochs"] == 0


class _RecordingLoader(torch.utils.data.DataLoader):
    """Records, at each iter(), the calling thread and fastdata's other threads alive."""

    calls: list[list[str]]

    def __iter__(self):
        me = threading.current_thread()
        self.calls.append([me.name] + sorted(t.name for t in threading.enumerate()
                                             if t is not me and t.name.startswith("fastdata")))
        return super().__iter__()


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="no fork")
def test_forking_loader_starts_its_epochs_in_the_consumer_thread_alone() -> None:
    loader = _RecordingLoader(_Steps(), batch_size=2, num_workers=1, multiprocessing_context="fork",
                              generator=torch.Generator().manual_seed(1))
    loader.calls = []
    want = [b.tolist() for b in torch.utils.data.DataLoader(_Steps(), batch_size=2)]
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    for _ in range(3):
        got = []
        for b in pf:
            got.append(b.tolist())
            time.sleep(0.01)
        assert got == want
    pf.close()
    assert len(loader.calls) >= 3
    assert all(c == ["MainThread"] for c in loader.calls), loader.calls
    # persistent workers alive with a generator: later epochs fork nothing, the thread starts them
    loader = _RecordingLoader(_Steps(), batch_size=2, num_workers=1, multiprocessing_context="fork",
                              persistent_workers=True, generator=torch.Generator().manual_seed(1))
    loader.calls = []
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    for _ in range(3):
        assert [b.tolist() for b in pf] == want
    _wait_for(lambda: len(loader.calls) == 4)
    pf.close()
    assert loader.calls[0] == ["MainThread"] and all(c[0].startswith("fastdata-prefetch") for c in loader.calls[1:])


class _EpochLoader:
    """Batches tagged with the epoch they were made for; records every set_epoch call."""

    def __init__(self, n: int = 5) -> None:
        self.n, self.epoch, self.calls = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        e = self.epoch
        return iter([(e, i) for i in range(self.n)])


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_set_epoch_drives_the_lookahead() -> None:
    loader = _EpochLoader()
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    for epoch in range(4):
        pf.set_epoch(epoch)
        assert list(pf) == [(epoch, i) for i in range(5)]
    _wait_for(lambda: len(loader.calls) == 5)
    assert pf.stats()["lookahead_epochs"] >= 3 and pf.stats()["lookahead_discarded"] == 0
    assert loader.calls == [0, 1, 2, 3, 4]  # each epoch set once; 4 = the one started ahead
    pf.set_epoch(9)  # not the one started ahead: discarded, restarted with 9
    assert list(pf) == [(9, i) for i in range(5)]
    assert pf.stats()["lookahead_discarded"] == 1
    assert list(pf) == [(10, i) for i in range(5)]  # no call: the next epoch number
    pf.close()
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        pf.set_epoch(-1)
    with pytest.raises(TypeError, match="has no set_epoch"):
        CUDAPrefetcher([1], device="cpu").set_epoch(0)


def test_loader_set_epoch_behind_the_prefetcher_discards_the_lookahead() -> None:
    loader = _EpochLoader()
    pf = CUDAPrefetcher(loader, device="cpu", depth=2)
    assert list(pf) == [(0, i) for i in range(5)]
    _wait_for(lambda: pf.stats()["lookahead_epochs"] == 1)  # epoch 0 again started ahead (no set_epoch)
    loader.set_epoch(1)
    with pytest.warns(RuntimeWarning, match=r"call CUDAPrefetcher.set_epoch\(\)|Call CUDAPrefetcher.set_epoch"):
        assert list(pf) == [(1, i) for i in range(5)]
    assert pf.stats()["lookahead_discarded"] == 1
    assert list(pf) == [(1, i) for i in range(5)]  # unchanged epoch: the look-ahead is kept
    assert pf.stats()["lookahead_discarded"] == 1
    pf.close()


def test_distributed_sampler_epochs_through_the_prefetcher() -> None:
    ds = _RangeDataset()
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler)
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected.append([b["y"].tolist() for b in loader])
    assert expected[0] != expected[1]
    pf = CUDAPrefetcher(loader, device="cpu")
    for epoch in range(3):
        pf.set_epoch(epoch)
        assert [b["y"].tolist() for b in pf] == expected[epoch]
    pf.close()


def test_lookahead_error_surfaces_in_the_next_epoch() -> None:
    class Loader:
        iters = 0

        def __iter__(self):
            Loader.iters += 1
            if Loader.iters == 2:
                raise OSError("shard-000007.tar: connection reset")
            return iter(range(3))

    pf = CUDAPrefetcher(Loader(), device="cpu")
    assert list(pf) == [0, 1, 2]  # the failing iter() ran ahead; this epoch is unaffected
    with pytest.raises(OSError, match="connection reset") as info:
        list(pf)
    if sys.version_info >= (3, 11):
        assert any("starting epoch 1 ahead" in n for n in info.value.__notes__)
    assert list(pf) == [0, 1, 2]  # a fresh start
    pf.close()
    assert not _wait_no_threads()


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_across_the_epoch_boundary(tmp_path, num_workers: int) -> None:
    """set_epoch through the prefetcher: epoch 1 is started ahead while epoch 0's last batches are
    consumed; states saved at the boundary and inside epoch 1 resume exactly (nothing twice, nothing lost)."""
    import json

    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=6) as w:
        for i in range(40):
            w.write({"__key__": f"s{i:04d}", "cls": str(i).encode()})

    def make() -> DataLoader:
        return DataLoader(ShardedDataset(tmp_path / "ds", shuffle=True, seed=1), batch_size=3,
                          num_workers=num_workers, persistent_workers=num_workers > 0)

    def ids(b) -> list[int]:
        return [int(i) for i in b["cls"]]

    ref = make()
    expected = []
    for epoch in range(3):
        ref.set_epoch(epoch)
        expected.append([ids(b) for b in ref])
    assert expected[0] != expected[1]
    pf = CUDAPrefetcher(make(), device="cpu", depth=3)
    pf.set_epoch(0)
    assert [ids(b) for b in pf] == expected[0]
    time.sleep(0.1)  # epoch 1 runs ahead
    at_end = json.loads(json.dumps(pf.state_dict()))
    pf.set_epoch(1)
    it = iter(pf)
    first = [ids(next(it)) for _ in range(2)]
    time.sleep(0.1)
    inside = json.loads(json.dumps(pf.state_dict()))
    pf.close()
    assert first == expected[1][:2] and pf.stats()["lookahead_discarded"] == 0
    # from the boundary: nothing left of epoch 0, then all of epoch 1
    a = CUDAPrefetcher(make(), device="cpu")
    a.load_state_dict(at_end)
    assert list(a) == []
    a.set_epoch(1)
    assert [ids(b) for b in a] == expected[1]
    a.close()
    # from inside epoch 1: its rest, then epoch 2 (set_epoch driven: the next number by itself)
    b = CUDAPrefetcher(make(), device="cpu")
    b.load_state_dict(inside)
    b.set_epoch(1)
    assert [ids(x) for x in b] == expected[1][2:]
    assert [ids(x) for x in b] == expected[2]
    b.close()


def test_cuda_prefetcher_asks_the_loader_for_pinned_gathers(fake_cuda: dict) -> None:
    class Loader:
        fast_path_pinned = False

        def pin_fast_path(self):
            self.fast_path_pinned = True

        def __iter__(self):
            return iter([torch.zeros(3)])

    on_cpu, on_cuda = Loader(), Loader()
    CUDAPrefetcher(on_cpu, device="cpu").close()
    CUDAPrefetcher(on_cuda, device="cuda").close()
    assert on_cpu.fast_path_pinned is False and on_cuda.fast_path_pinned is True


def test_second_iterator_of_the_same_epoch_stops_the_first() -> None:
    pf = CUDAPrefetcher(list(range(6)), device="cpu")
    first, second = iter(pf), iter(pf)  # neither advanced yet
    assert list(second) == list(range(6))
    assert list(first) == []  # stopped, not blocked on the pipe the second one owns
    assert list(pf) == list(range(6))
    pf.close()


def test_driven_epochs_then_loader_set_epoch_directly() -> None:
    loader = _EpochLoader(3)
    pf = CUDAPrefetcher(loader, device="cpu")
    pf.set_epoch(0)
    assert list(pf) == [(0, i) for i in range(3)]
    _wait_for(lambda: pf.stats()["lookahead_epochs"] == 1)  # epoch 1 started ahead
    loader.set_epoch(5)  # behind the prefetcher's back
    with pytest.warns(RuntimeWarning, match="discarded and restarted"):
        assert list(pf) == [(5, i) for i in range(3)]
    assert list(pf) == [(6, i) for i in range(3)]  # and on from there
    pf.close()


def test_gc_after_a_finished_epoch_stops_the_persistent_thread() -> None:
    pf = CUDAPrefetcher(list(range(5)), device="cpu")
    assert list(pf) == list(range(5))
    assert _threads()  # waiting for the next epoch, one epoch started ahead
    del pf
    gc.collect()
    assert not _wait_no_threads()


def test_stream_priority_selects_the_side_stream(fake_cuda: dict) -> None:
    batches = [{"x": torch.full((4,), i)} for i in range(5)]
    assert [int(b["x"][0]) for b in CUDAPrefetcher(batches, device="cuda")] == list(range(5))
    assert fake_cuda["high_priority_streams"] == 0
    pf = CUDAPrefetcher(batches, device="cuda", stream_priority="high")
    assert [int(b["x"][0]) for b in pf] == list(range(5))
    assert fake_cuda["high_priority_streams"] == 1
    pf.close()
    with pytest.raises(ValueError, match="stream_priority must be one of"):
        CUDAPrefetcher(batches, device="cuda", stream_priority="urgent")
    # no effect on the CPU, but still validated
    assert len(list(CUDAPrefetcher(batches, device="cpu", stream_priority="high"))) == 5
    with pytest.raises(ValueError, match="stream_priority"):
        CUDAPrefetcher(batches, device="cpu", stream_priority=1)  # type: ignore[arg-type]
