"""DataLoader(decode_threads=N) when something goes wrong: errors, StopIteration, skips and the skip
budget, timeouts, breaks and stuck threads, as the worker path handles them."""
from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fastdata
from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import ResizeCenterCrop
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def test_a_transform_raising_stopiteration_is_an_error_not_the_end_of_the_epoch(tiny_jpeg_shards: Path) -> None:
    """StopIteration raised by a transform (a stray next() on an exhausted iterator) reached the thread
    decoder's __next__ as such, so the epoch ended silently after 2 of 8 samples; the worker path's
    generator turns it into RuntimeError (PEP 479)."""
    def transform(img: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name.startswith("fastdata-decode") and int(img[0, 0, 0]) == first[0]:
            raise StopIteration
        return img

    ds = fastdata.ShardedDataset(tiny_jpeg_shards, preprocess=ResizeCenterCrop(32), shuffle=False)
    first = [int(next(iter(ds))["jpg"][0, 0, 0])]
    ds.transform = transform
    got = []
    with pytest.raises(RuntimeError, match="StopIteration") as info:
        for b in fastdata.DataLoader(ds, batch_size=2, decode_threads=2):
            got.append(b)
    assert got == [] and isinstance(info.value.__cause__, StopIteration)
    assert "fastdata-decode-" in "\n".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize(("threads", "workers"), [(2, 2), (0, 0), (0, 2)])
def test_a_collate_fn_raising_stopiteration_is_an_error_not_the_end_of_the_data(tiny_jpeg_shards: Path, threads: int,
                                                                                 workers: int) -> None:
    """StopIteration raised by a custom collate_fn ended the epoch silently: on the thread path at once (4 of
    8 samples), with worker processes only that worker's part (torch's worker takes it for the end of its
    dataset), and the cached fast path (a generator) raised RuntimeError: three paths, three outcomes."""
    def collate(batch: list[dict[str, Any]]) -> Any:
        if "k002" in [s["__key__"] for s in batch]:
            raise StopIteration
        return torch.utils.data.default_collate(batch)

    ds = fastdata.ShardedDataset(tiny_jpeg_shards, preprocess=ResizeCenterCrop(32), shuffle=False)
    ctx = multiprocessing.get_context("fork") if workers and not threads else None
    dl = fastdata.DataLoader(ds, batch_size=2, num_workers=workers, decode_threads=threads, collate_fn=collate,
                             multiprocessing_context=ctx)
    with pytest.raises(RuntimeError, match="collate_fn raised StopIteration"):
        for _ in dl:
            pass


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_walk_ending_in_skipped_samples_moves_the_state_as_a_worker_does(tmp_path: Path, drop_last: bool) -> None:
    """A virtual worker whose last samples were skipped (or, with drop_last, dropped with a skip among them)
    after its last batch kept its position before them in state_dict(), while a worker process reports
    its end: the states differed, and a resume from the thread path's state read those samples again and
    reported their skips a second time."""
    src = make_shards(tmp_path / "ds", 11, 4, key="k{i:03d}", image=(20, 24), cls="int", bad=(9, 10),
                      bad_field="jpg")  # worker 1 of 2 reads samples 6-10: ends with two skips
    make = lambda: fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(8), shuffle=False,  # noqa: E731
                                           on_error="skip")
    kw = dict(batch_size=2 if drop_last else 3, num_workers=2, drop_last=drop_last)
    states = {}
    for threads in (0, 2):
        ctx = None if threads else multiprocessing.get_context("fork")
        dl = fastdata.DataLoader(make(), decode_threads=threads, multiprocessing_context=ctx, **kw)
        states[threads] = [dl.state_dict()["dataset"] for _ in dl]
        states[threads].append(dl.state_dict()["dataset"])
    assert states[2] == states[0]
    resumed = fastdata.DataLoader(make(), decode_threads=2, **kw)
    resumed.load_state_dict(states[2][-1])  # the dataset part alone (a loader state has all its keys)
    assert list(resumed) == [] and resumed.dataset.skipped == []


@pytest.mark.parametrize("threads", [0, 2])
def test_a_state_saved_after_skipbudgeterror_resumes_with_the_batch_that_raised_it(tmp_path: Path,
                                                                                   threads: int) -> None:
    """With worker processes the position of the batch whose skips ran past max_skips was recorded before the
    error was raised, so a state saved after SkipBudgetError counted that batch, never yielded, as read: a
    resume lost its samples (the thread decoder resumed them)."""
    from fastdata.errors import SkipBudgetError

    src = make_shards(tmp_path / "ds", 11, 4, key="k{i:03d}", image=(20, 24), cls="int", bad=(1, 4, 7),
                      bad_field="jpg")
    make = lambda **kw: fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(8), shuffle=False,  # noqa: E731
                                                on_error="skip", **kw)
    kw = dict(batch_size=2, num_workers=2, decode_threads=threads,
              multiprocessing_context=None if threads else multiprocessing.get_context("fork"))
    dl = fastdata.DataLoader(make(max_skips=1), **kw)
    keys = []
    with pytest.raises(SkipBudgetError):
        for b in dl:
            keys += b["__key__"]
    resumed = fastdata.DataLoader(make(), **kw)
    resumed.load_state_dict(dl.state_dict())
    keys += [k for b in resumed for k in b["__key__"]]
    assert sorted(keys) == [f"k{i:03d}" for i in range(11) if i not in (1, 4, 7)]


def test_decode_threads_timeout_raises_at_the_timeout(tmp_path: Path, decode_thread_joins: list) -> None:
    """timeout= on the thread path raised only once the stuck transform returned: close() joined the
    thread for up to 10 s after the timeout (the worker path raises at the timeout). The thread is now
    told to stop and left to end on its own; its batch rows are never handed out again."""
    import threading
    import time

    src = make_shards(tmp_path / "ds", 8, 4, key="k{i:03d}", image=(20, 24), cls="int")
    release = threading.Event()

    def stuck(img: Any) -> Any:
        release.wait(20)
        return img

    ds = fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(8), transform=stuck)
    dl = fastdata.DataLoader(ds, batch_size=2, num_workers=1, decode_threads=1, timeout=0.2)
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.2 seconds"):
            next(iter(dl))
        joins = decode_thread_joins
        assert not [w for w in joins if w is None or w > 0], joins  # not after a join of the stuck thread (10 s)
        assert any(t.name.startswith("fastdata-decode") for t in threading.enumerate())  # still stuck, left running
    finally:
        release.set()
    deadline = time.monotonic() + 20
    while any(t.name.startswith("fastdata-decode") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name.startswith("fastdata-decode") for t in threading.enumerate())


def test_decode_threads_break_gives_the_batch_buffers_back(tmp_path: Path) -> None:
    """An early `break` (the iterator dropped, not closed) left the buffers of the batches in flight marked
    busy in the dataset's ring for good: after a few breaks every later epoch allocated fresh batch memory
    (the first-touch cost the ring exists to avoid)."""
    import gc

    src = make_shards(tmp_path / "ds", 12, 4, key="k{i:03d}", image=(20, 24), cls="int")
    ds = fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(32))
    dl = fastdata.DataLoader(ds, batch_size=2, num_workers=1, decode_threads=2)
    for _ in dl:  # learns the layout; the ring holds the epoch's buffers
        pass
    for _ in range(4):
        for _ in dl:
            break
        gc.collect()
    from fastdata.loader import _threads

    before = _threads._CARRY[ds][("buffers", None)].allocated
    for _ in dl:
        pass
    assert _threads._CARRY[ds][("buffers", None)].allocated == before  # every batch reused a ring buffer


def test_thread_decoder_warns_of_skips_when_the_consumer_reaches_them(tmp_path):
    """on_error="warn": the pool meets a bad sample ahead of the consumer; its warning comes when the
    consumer reaches the batch, in batch order (with the skip record), as the skip records do."""
    import time
    import warnings

    from fastdata import DataLoader, ShardedDataset, SkippedSampleWarning
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=10) as w:
        for i in range(20):  # virtual workers: k000-k009, k010-k019
            w.write({"__key__": f"k{i:03d}", "cls": b"x" if i in (2, 10, 13) else str(i).encode()})
    ds = ShardedDataset(tmp_path / "ds", on_error="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(DataLoader(ds, batch_size=3, num_workers=2, decode_threads=2))
        next(it)  # k000 k001 k003 (k002 skipped)
        time.sleep(0.5)  # the pool has loaded ahead (k010, a skip, in worker 1's first batch)
        keys = lambda: [str(c.message).split("'")[1] for c in caught if issubclass(c.category, SkippedSampleWarning)]
        assert keys() == ["k002"]
        list(it)
        assert keys() == ["k002", "k010", "k013"]
    assert [r["key"] for r in ds.skipped] == ["k002", "k010", "k013"]


def _bad_cls(dest: Path, n: int, bad: tuple[int, ...]) -> Path:
    with ShardWriter(dest, max_samples=4) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "cls": b"x" if i in bad else str(i).encode()})
    return dest


def _skipped_keys(ds: ShardedDataset) -> list[str]:
    return [r["key"] for r in ds.skipped]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_thread_decoder_records_skips_when_the_consumer_reaches_them(tmp_path: Path) -> None:
    """The pool loads ahead of the consumer; it recorded skips (and counted them against max_skips)
    as it met them, so dataset.skipped held samples of batches not yet received (not the worker
    path's list) and the budget ran out at whichever sample a thread reached first."""
    import time

    from fastdata.errors import SkipBudgetError
    from fastdata.loader import DataLoader

    src = _bad_cls(tmp_path / "ds", 20, bad=(2, 10, 13))  # virtual workers: k000-k009, k010-k019
    ds = ShardedDataset(src, on_error="skip")
    it = iter(DataLoader(ds, batch_size=3, num_workers=2, decode_threads=2))
    next(it)  # k000 k001 k003 (k002 skipped)
    time.sleep(0.5)  # the pool has loaded ahead (k010, a skip, in worker 1's first batch)
    assert _skipped_keys(ds) == ["k002"]
    list(it)
    assert _skipped_keys(ds) == ["k002", "k010", "k013"]  # batch order, as from worker processes

    for kw in ({"decode_threads": 2}, {}):  # the budget runs out at the same batch as with workers
        ds = ShardedDataset(src, on_error="skip", max_skips=1)
        got = []
        with pytest.raises(SkipBudgetError) as info:
            for batch in DataLoader(ds, batch_size=3, num_workers=2, **kw):
                got.append(list(batch["__key__"]))
        assert got == [["k000", "k001", "k003"]], kw
        assert [r["key"] for r in info.value.skipped] == ["k002", "k010", "k013"], kw  # both in that batch


class _Blocking:
    """sample_transform that blocks on ``release`` from the sample ``first`` on, counting its blocked calls."""

    def __init__(self, first: str) -> None:
        self.first = first
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.blocked = 0

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"] >= self.first:
            with self.lock:
                self.blocked += 1
            self.release.wait(30)
        return sample


def test_closing_a_thread_decoder_with_stuck_threads_waits_once_not_once_per_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """close() (and so a break, Ctrl-C or the pause before a fork) joined each pool thread stuck in a
    transform for _JOIN_S (10 s) in turn: 4 threads stuck on a slow remote read held the consumer
    40 s. One deadline now covers them all, and one warning names them."""
    from fastdata.loader import _pool

    monkeypatch.setattr(_pool, "_JOIN_S", 0.5)
    block = _Blocking("k004")
    loader = DataLoader(ShardedDataset(make_shards(tmp_path / "ds", 12, 4, key="k{i:03d}"), sample_transform=block), batch_size=4,
                        num_workers=1, decode_threads=4)
    it = iter(loader)
    try:
        assert list(next(it)["__key__"]) == ["k000", "k001", "k002", "k003"]
        deadline = time.monotonic() + 10
        while block.blocked < 4 and time.monotonic() < deadline:  # every pool thread is stuck
            time.sleep(0.01)
        assert block.blocked == 4
        waits = request.getfixturevalue("decode_thread_joins")  # the join timeouts of the stuck threads from here
        with pytest.warns(RuntimeWarning, match=r"fastdata-decode-0, .*did not finish their task within 0.5 s"):
            it.close()
        assert len(waits) == 4 and sum(waits) <= 0.5, waits  # one 0.5 s deadline for all: was 4 x 0.5 s
    finally:
        block.release.set()
