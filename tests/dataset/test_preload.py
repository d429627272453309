"""Next-epoch preload in persistent workers (fastdata.dataset._preload): same batches, same resume
states and skip reports as without it; the preload really happens while the workers wait; wrong
guesses are discarded; errors surface at the same batch; workers shut down cleanly."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.errors import DecodeError
from fastdata.loader import DataLoader
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


N = 44
BAD = (5, 21, 30)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("preload") / "ds", N, 6)


def strict_cls(data: bytes) -> int:
    i = int(bytes(data))
    if i in BAD:
        raise ValueError(f"bad label {i}")
    return i


def logged_cls(data: bytes) -> int:
    """Appends one line per decode to $FASTDATA_TEST_DECODE_LOG (inherited by the workers)."""
    with open(os.environ["FASTDATA_TEST_DECODE_LOG"], "a") as f:
        f.write(f"{os.getpid()} {bytes(data).decode()}\n")
    return int(bytes(data))


def _make(shards: Path, **kw: Any) -> ShardedDataset:
    kw.setdefault("shuffle", ShuffleOptions(open_shards=3, buffer_size=5))
    kw.setdefault("seed", 3)
    return ShardedDataset(shards, **kw)


def _loader(ds: ShardedDataset, preload: bool, **kw: Any) -> DataLoader:
    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 2)
    return DataLoader(ds, persistent_workers=True, prefetch_factor=2, preload_next_epoch=preload, **kw)


def _run(loader: DataLoader, epochs: list[int]) -> list[list[tuple[list[str], Any, dict]]]:
    """Per epoch: (keys, cls, state after the batch) of every batch."""
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out.append([(b["__key__"], b["cls"].tolist(), loader.state_dict()) for b in loader])
        time.sleep(0.05)  # the workers' idle time between epochs: the preload runs here
    return out


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("skips", [False, True])
def test_same_batches_states_and_skips_as_without_preload(shards, drop_last, skips):
    kw: dict[str, Any] = {"decode": {"cls": strict_cls}, "on_error": "skip"} if skips else {}
    epochs = [0, 1, 2, 3]
    ds_pre, ds_ref = _make(shards, **kw), _make(shards, **kw)
    got = _run(_loader(ds_pre, True, drop_last=drop_last), epochs)
    want = _run(_loader(ds_ref, False, drop_last=drop_last), epochs)
    assert got == want
    if skips:
        key = lambda r: (r["epoch"], r["key"])  # noqa: E731
        assert sorted(ds_pre.skipped, key=key) == sorted(ds_ref.skipped, key=key)
        assert len([r for r in ds_pre.skipped if r["epoch"] is not None]) == len(BAD) * len(epochs)


def test_the_next_epoch_is_loaded_while_the_workers_wait(shards, tmp_path, monkeypatch):
    log = tmp_path / "decodes.log"
    monkeypatch.setenv("FASTDATA_TEST_DECODE_LOG", str(log))
    loader = _loader(_make(shards, decode={"cls": logged_cls}), True)
    loader.set_epoch(0)
    assert len(list(loader)) == len(loader)
    loader.set_epoch(1)
    deadline = time.monotonic() + 30  # workers done with epoch 0 load epoch 1 (predicted: 0 + 1) meanwhile
    while len(log.read_text().splitlines()) <= N and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(log.read_text().splitlines()) > N, "no sample of epoch 1 was loaded before iter()"
    first = list(loader)
    lines = len(log.read_text().splitlines())  # epoch 0, epoch 1, and at most 2 x 8 of epoch 2 so far
    assert 2 * N <= lines <= 2 * N + 2 * 8
    ref = _make(shards)
    ref.set_epoch(1)
    assert [b["__key__"] for b in first] == [b["__key__"] for b in DataLoader(ref, batch_size=4, num_workers=2)]


@pytest.mark.parametrize("next_epochs", [[0, 0, 0], [7, 2, 3], [1, 5, 6]])
def test_wrong_guesses_are_discarded(shards, next_epochs):
    """The same epoch again (no set_epoch), a jump back, a jump ahead: every epoch equals a fresh run."""
    epochs = [0, *next_epochs]
    got = _run(_loader(_make(shards), True), epochs)
    for e, batches in zip(epochs, got):
        ref = _make(shards)
        ref.set_epoch(e)
        assert [b[0] for b in batches] == [b["__key__"] for b in DataLoader(ref, batch_size=4, num_workers=2)]


def test_an_error_in_a_preloaded_sample_is_raised_at_its_batch(shards):
    def batches_until_error(preload: bool) -> tuple[int, list[tuple[str, str]]]:
        loader = _loader(_make(shards, decode={"cls": strict_cls}), preload)
        loader.set_epoch(0)
        with pytest.raises(DecodeError, match="bad label") as e0:
            list(loader)
        # the error ended epoch 0 early; the next epoch starts after a worker restart or resume
        loader.set_epoch(1)
        n = 0
        with pytest.raises(DecodeError, match="bad label") as e1:
            for _ in loader:
                n += 1
        where = [(str(e.value).splitlines()[0], str(e.value).splitlines()[-1]) for e in (e0, e1)]
        del e0, e1  # their tracebacks hold this frame: a cycle would keep the persistent workers for a GC
        loader._iterator._shutdown_workers()
        return n, where  # the worker that raised, and the sample

    assert batches_until_error(True) == batches_until_error(False)


def test_resume_mid_epoch_after_preloaded_start(shards):
    """A state saved inside an epoch whose start was preloaded resumes to the uninterrupted rest."""
    loader = _loader(_make(shards), True)
    full = _run(loader, [0, 1])[1]
    loader2 = _loader(_make(shards), True)
    _run(loader2, [0])
    loader2.set_epoch(1)
    it = iter(loader2)
    for _ in range(3):
        next(it)
    state = loader2.state_dict()
    del it
    fresh = DataLoader(_make(shards), batch_size=4, num_workers=2)
    fresh.load_state_dict(state)
    assert [b["__key__"] for b in fresh] == [b[0] for b in full[3:]]


def test_spawned_workers_and_clean_shutdown(shards):
    """spawn (the dataset pickled into the workers; forkserver pickles alike): same batches; the
    workers, possibly preloading, shut down without hanging (the atexit hook stops the thread)."""
    loader = _loader(_make(shards), True, num_workers=2, multiprocessing_context="spawn")
    got = _run(loader, [0, 1, 2])
    ref = _run(_loader(_make(shards), False, num_workers=2), [0, 1, 2])
    assert got == ref
    it = loader._iterator
    workers = list(it._workers)
    del loader, it
    for w in workers:
        w.join(timeout=20)
        assert not w.is_alive()


def test_preload_option_is_validated(shards):
    with pytest.raises(ValueError, match="preload_next_epoch"):
        DataLoader(_make(shards), batch_size=4, preload_next_epoch="yes")  # type: ignore[arg-type]


def test_next_epoch_preloaded_during_an_elastic_resume_is_the_plain_split(shards):
    """After an elastic resume (world size 2 -> 1) the workers' plan for the resumed epoch is elastic
    while they preload the next one: that epoch must still be the plain split."""
    def loader(rank: int, world: int, preload: bool) -> DataLoader:
        return _loader(_make(shards, rank=rank, world_size=world), preload, num_workers=2)

    states = []
    for r in range(2):
        dl = DataLoader(_make(shards, rank=r, world_size=2), batch_size=4, num_workers=2)
        it = iter(dl)
        for _ in range(2):
            next(it)
        states.append(dl.state_dict())
        del it
    dl = loader(0, 1, True)
    dl.load_state_dict(states)
    rest = [k for b in dl for k in b["__key__"]]
    time.sleep(0.3)  # the workers' preload (if any) runs while the resumed epoch's plan is in force
    dl.set_epoch(1)
    got = [b["__key__"] for b in dl]
    ref = loader(0, 1, False)
    ref.set_epoch(1)
    assert got == [b["__key__"] for b in ref]
    assert len(rest) == N - 2 * 2 * 4


def test_epochs_as_windows_of_a_stream_samples_per_epoch(shards):
    """samples_per_epoch: epoch e is a window of an endless stream of passes; preloaded the same."""
    def run(preload: bool) -> list:
        return _run(_loader(_make(shards, samples_per_epoch=30), preload), [0, 1, 2, 3])

    assert run(True) == run(False)
