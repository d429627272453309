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


def _wait_no_threads(timeout: float = 2.0) -> list[str]:
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
    assert time.monotonic() - t0 < 2.0
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
    def loader():
        for i in range(12):
            time.sleep(0.02)
            yield i

    def run(wrap: bool) -> float:
        source = _Regen(loader)
        it = CUDAPrefetcher(source, device="cpu") if wrap else source
        t0 = time.perf_counter()
        for _ in it:
            time.sleep(0.02)
        return time.perf_counter() - t0

    plain, prefetched = run(False), run(True)
    assert prefetched < 0.8 * plain, (plain, prefetched)


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
        ({"device": "nonsense"}, "device must be a str, int, torch.device or None, got 'nonsense'"),
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
        assert not _wait_no_threads()
    pf.close()
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


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict:
    counts = {"pinned": 0, "device": 0}

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
    monkeypatch.setattr(stage, "side_stream", lambda d: _FakeStream())
    monkeypatch.setattr(stage, "_pinned_empty", pinned)
    monkeypatch.setattr(stage, "_device_empty", device_empty)
    monkeypatch.setattr(stage, "_to_device", lambda t, d: t.clone())
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
    assert s["batches"] == 40 and s["bytes"] > 0 and s["queued_bytes"] == 0
    assert s["pinned_allocs"] == fake_cuda["pinned"] <= 3 * 2  # 3 slots, each grows at most a couple of times
    allocs = s["pinned_allocs"]
    assert list(pf)[5]["s"] == 5  # a second epoch reuses the ring: no new pinned buffers
    assert pf.stats()["pinned_allocs"] == allocs and pf.stats()["copy_s"] > 0
    pf.close()
    assert pf.stats()["pinned_bytes"] == 0
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
        assert pf.stats()["pinned_allocs"] <= (depth + 1) * 6  # 64 KiB .. 2 MiB: six sizes per slot
        for i, _ in enumerate(pf):
            if i == 3:
                time.sleep(0.2)  # let the thread fill the queue
                assert pf.stats()["queued_bytes"] > 0
                break
        assert pf.stats()["queued_bytes"] == 0  # batches staged ahead and dropped at the break
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


def test_marks_bound_gpu_run_ahead() -> None:
    class Gate:
        def __init__(self) -> None:
            self.open = threading.Event()

        def synchronize(self) -> None:
            self.open.wait(5)

    marks = stage.Marks(depth=2)
    stop = threading.Event()
    marks.wait_room(2, stop)  # batches 0..1 in flight, room for batch 2
    done = threading.Event()
    t = threading.Thread(target=lambda: (marks.wait_room(3, stop), done.set()), name="test-marks")
    t.start()
    assert not done.wait(0.1)  # batch 3 must wait until batch 0 finished on the GPU
    gate = Gate()
    marks.post(gate)
    assert not done.wait(0.1)  # posted but not finished
    gate.open.set()
    assert done.wait(2)
    t.join()
    stop.set()
    marks.wait_room(100, stop)  # a stop request never blocks


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
    assert pf2.state_dict() == pf2._iterable.state_dict()  # epoch done: nothing in flight any more
    pf2.close()
    with pytest.raises(TypeError, match="has no state_dict"):
        CUDAPrefetcher([1, 2], device="cpu").state_dict()
