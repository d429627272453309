"""CUDAPrefetcher on the CPU (thread prefetch path): the same batches in the same order, errors at
their batch, early breaks, closing, statistics, state_dict, arguments."""
from __future__ import annotations

import _thread
import gc
import json
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import pytest
import torch

from fastdata.gpu import IMAGENET_MEAN, IMAGENET_STD, Normalize
from fastdata.prefetch import CUDAPrefetcher, PrefetchOptions, resolve_device
from fastdata.prefetch._queue import Stats
from tests.helpers.batches import batch_cls
from tests.helpers.shards import make_shards
from tests.helpers.prefetch import (RangeDataset, nested_batches, normalize_reference, prefetch_threads,
                                    wait_no_prefetch_threads)


def test_same_batches_same_order_nested() -> None:
    batches = nested_batches()
    with CUDAPrefetcher(batches, device="cpu", depth=3) as pf:
        got = list(pf)
        assert len(got) == len(batches)
        for g, b in zip(got, batches):
            assert g is b  # CPU without a transform: the very same objects
        assert pf.stats()["batches"] == len(batches)
    assert not wait_no_prefetch_threads()


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
    assert not wait_no_prefetch_threads()
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
        assert not wait_no_prefetch_threads(), f"thread left after break in epoch {epoch}"
    assert [int(b[0]) for b in pf] == list(range(20))
    assert pf.stats()["epochs"] == 5
    pf.close()
    assert not prefetch_threads()


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
    assert not wait_no_prefetch_threads()


def test_gc_stops_thread() -> None:
    def slow():
        for i in range(1000):
            time.sleep(0.001)
            yield i

    pf = CUDAPrefetcher(_Regen(slow), device="cpu")
    it = iter(pf)
    next(it)
    assert prefetch_threads()
    del pf, it
    gc.collect()
    assert not wait_no_prefetch_threads()


@pytest.mark.timeout(15)  # a hang guard: the source alone runs 20 s
def test_keyboard_interrupt_while_waiting() -> None:
    def slow():
        for i in range(100):
            time.sleep(0.2)
            yield i

    pf = CUDAPrefetcher(_Regen(slow), device="cpu")
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    seen = 0
    with pytest.raises(KeyboardInterrupt):
        for _ in pf:
            seen += 1
    assert seen < 100  # interrupted while waiting for the source, not after it ended
    timer.join()
    assert not wait_no_prefetch_threads()
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


def test_torch_dataloader_persistent_workers_several_epochs() -> None:
    loader = torch.utils.data.DataLoader(
        RangeDataset(), batch_size=4, num_workers=2, persistent_workers=True, shuffle=False
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
            assert not wait_no_prefetch_threads()
        else:
            assert len(prefetch_threads()) == 1
    pf.close()
    assert not wait_no_prefetch_threads()
    del loader


def test_prefetcher_with_transform_on_cpu() -> None:
    batches = [(torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8), torch.tensor([i])) for i in range(6)]
    norm = Normalize(dtype=torch.float32)
    with CUDAPrefetcher(batches, device="cpu", transform=norm) as pf:
        for (img, label), (src, lab) in zip(pf, batches):
            torch.testing.assert_close(img, normalize_reference(src, IMAGENET_MEAN, IMAGENET_STD))
            assert label is lab


def test_stats_quantiles() -> None:
    s = Stats()
    for i in range(1, 101):
        s.add_wait(i / 100, 0)
    snap = s.snapshot()
    assert snap["wait_p50_s"] == 0.5 and snap["wait_p99_s"] == 0.99 and snap["wait_max_s"] == 1.0


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_counts_only_batches_handed_over(tmp_path, num_workers: int) -> None:
    import json

    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader

    make_shards(tmp_path / "ds", 40, 6)

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


def test_a_prefetcher_left_open_is_stopped_before_the_interpreter_finalizes() -> None:
    """A script whose last loop ran over a CUDAPrefetcher it never closed ended with SIGABRT (exit
    134, "terminate called without an active exception") in 4-7 of 8 runs, 6 of 6 with a device
    transform busy in the next epoch started ahead: the daemon thread was in torch code when the
    interpreter finalized, and pthread_exit's unwinding through torch's C++ frames aborted. An
    atexit hook now stops and joins every producer thread first. (Checked here in process: the hook
    ends a busy look-ahead thread.)"""
    import torch

    from fastdata.prefetch import _prefetcher

    hook = _prefetcher._stop_runs_at_exit  # registered with atexit (measured at exit: 0 aborts in 24 runs)
    busy = threading.Event()

    class Batches:
        epochs = 0

        def __iter__(self) -> Iterator[torch.Tensor]:
            self.epochs += 1
            return iter([torch.full((4,), self.epochs)] * 3)

    def transform(x: torch.Tensor) -> torch.Tensor:
        if int(x[0]) == 2:  # the epoch started ahead
            busy.set()
            time.sleep(0.05)
        return x + 0

    p = CUDAPrefetcher(Batches(), device="cpu", transform=transform)
    try:
        assert len(list(p)) == 3
        assert busy.wait(10)
        thread = p._run.thread
        assert thread is not None and thread.is_alive()
        hook()
        assert not thread.is_alive()
    finally:
        p.close()


def test_two_threads_iterating_one_prefetcher_get_no_internal_error() -> None:
    """One thread's iter() ends the other's run (as a second iter() does in one thread); the ended loop
    stops cleanly. Before: 'prefetch thread exited without finishing the epoch' (the stopped consumer
    took the stop for a dead producer) or 'cannot join thread before it is started'."""
    pf = CUDAPrefetcher([torch.full((2,), i) for i in range(40)], device="cpu")
    errors: list[BaseException] = []
    counts: list[int] = []

    def loop() -> None:
        try:
            n = 0
            for batch in pf:
                assert int(batch[0]) == n  # in order, from the start of the epoch, nothing skipped
                n += 1
            counts.append(n)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    for _ in range(12):
        threads = [threading.Thread(target=loop) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    pf.close()
    assert errors == []
    assert len(counts) == 24 and max(counts) == 40  # the run started last always completes


def test_state_dict_between_iter_and_the_first_batch_is_the_new_epochs_start(loader_factory):
    """Before: ``state_dict()`` right after ``iter(P)`` returned None (and, after a break, the stale state of
    the abandoned epoch, whose resume skipped batches of the epoch the consumer had just begun)."""
    make = loader_factory
    full = [batch_cls(b) for b in make()]
    with CUDAPrefetcher(make(), device="cpu") as P:
        it = iter(P)
        state = P.state_dict()
        assert state is not None and state["batches"] == 0
        next(it)
        it.close()  # a break after one batch
        it = iter(P)  # a new epoch, from its first batch, as a plain loop's iter() gives
        state = json.loads(json.dumps(P.state_dict()))
        assert state["batches"] == 0
        assert [batch_cls(b) for b in it] == full
    resumed = make()
    resumed.load_state_dict(state)
    assert [batch_cls(b) for b in resumed] == full  # resuming there replays the whole epoch, as the loop did
