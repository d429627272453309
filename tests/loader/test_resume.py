"""Exact mid-epoch resume: save after k batches, restore in a fresh loader, compare with an
uninterrupted run; which states are refused, and the epoch an iter() fixes."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.loader import DataLoader
from fastdata.shards.tar import write_tar_shard
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning",
                                        "ignore:Unclosed:ResourceWarning")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("resume") / "ds", 40, 6)


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("resume_bad") / "ds", 40, 6, bad=(3, 17, 18))


def _ids(batch) -> list[int]:
    return [int(i) for i in batch["cls"]]


def check_resume(
    make: Callable[[], ShardedDataset], *, epoch: int, num_workers: int, batch_size: int,
    midpoints: list[int], resume_workers: int | None = None,
) -> None:
    """For each k, stop after k batches, save, restore in a fresh loader and check the rest.

    Same worker count: the remaining batches equal the uninterrupted run's, in order. Another
    worker count: every remaining sample exactly once.
    """
    def loader(ds: ShardedDataset, nw: int) -> DataLoader:
        return DataLoader(ds, batch_size=batch_size, num_workers=nw)

    ds = make()
    ds.set_epoch(epoch)
    full = [_ids(b) for b in loader(ds, num_workers)]
    assert len(full) == len(loader(ds, num_workers))
    resume_workers = num_workers if resume_workers is None else resume_workers
    for k in midpoints:
        ds = make()
        ds.set_epoch(epoch)
        dl = loader(ds, num_workers)
        it = iter(dl)
        first = [_ids(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(dl.state_dict()))  # must survive a checkpoint file
        del it
        ds2 = make()
        dl2 = loader(ds2, resume_workers)
        dl2.load_state_dict(state)
        ds2.set_epoch(epoch)  # the usual training loop calls this again: must keep the resume state
        rest = [_ids(b) for b in dl2]
        if resume_workers == num_workers:
            assert first + rest == full, f"k={k}"
        else:
            got = sorted(i for b in first + rest for i in b)
            assert got == sorted(i for b in full for i in b), f"k={k}"
        ds2.set_epoch(epoch + 1)  # the next epoch starts from scratch
        before = len(ds2.skipped)
        assert sum(len(b["cls"]) for b in dl2) == len(ds2) - (len(ds2.skipped) - before)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_resume_same_workers_exact_order(shards, num_workers, world):
    for rank in range(world):
        make = lambda: ShardedDataset(shards, shuffle=ShuffleOptions(open_shards=3, buffer_size=5),  # noqa: E731
                                      seed=11, rank=rank, world_size=world)
        n = len(DataLoader(make(), batch_size=4, num_workers=num_workers))
        check_resume(make, epoch=1, num_workers=num_workers, batch_size=4, midpoints=[0, 1, 3, n - 1, n])


@pytest.mark.parametrize(("before", "after"), [(2, 0), (0, 2), (2, 3)])
def test_resume_other_worker_count_exactly_once(shards, before, after):
    make = lambda: ShardedDataset(shards, shuffle=True, seed=2)  # noqa: E731
    check_resume(make, epoch=0, num_workers=before, batch_size=3, midpoints=[1, 5], resume_workers=after)


def test_resume_with_skipped_samples_is_exact(bad_shards):
    make = lambda: ShardedDataset(bad_shards, shuffle=True, seed=5, on_error="skip")  # noqa: E731
    check_resume(make, epoch=2, num_workers=2, batch_size=4, midpoints=[2, 4, 7])


def test_resume_samples_per_epoch(shards):
    make = lambda: ShardedDataset(shards, shuffle=True, samples_per_epoch=30)  # noqa: E731
    check_resume(make, epoch=3, num_workers=2, batch_size=4, midpoints=[1, 4])


def test_dataset_state_dict_without_dataloader(shards):
    ds = ShardedDataset(shards, shuffle=True, seed=9)
    ds.set_epoch(4)
    full = [s["cls"] for s in ds]
    for k in (0, 1, 13, 40):
        ds = ShardedDataset(shards, shuffle=True, seed=9)
        ds.set_epoch(4)
        it = iter(ds)
        first = [next(it)["cls"] for _ in range(k)]
        state = ds.state_dict()
        fresh = ShardedDataset(shards, shuffle=True, seed=9)
        fresh.load_state_dict(state)
        assert first + [s["cls"] for s in fresh] == full
        assert [s["cls"] for s in fresh] == full  # applied once: iterating again restarts the epoch


def test_plain_torch_dataloader_resumes_from_dataset_state(shards):
    ds = ShardedDataset(shards, shuffle=True, seed=1)
    full = [_ids(b) for b in DataLoader(ds, batch_size=4, num_workers=2)]
    dl = DataLoader(ShardedDataset(shards, shuffle=True, seed=1), batch_size=4, num_workers=2)
    it = iter(dl)
    first = [_ids(next(it)) for _ in range(3)]
    state = dl.state_dict()
    del it
    ds2 = ShardedDataset(shards, shuffle=True, seed=1)
    ds2.load_state_dict(state["dataset"])
    rest = [_ids(b) for b in torch.utils.data.DataLoader(ds2, batch_size=4, num_workers=2)]
    assert first + rest == full


def test_persistent_workers_restart_on_load(shards):
    make = lambda: ShardedDataset(shards, shuffle=True, seed=3)  # noqa: E731
    full = [_ids(b) for b in DataLoader(make(), batch_size=4, num_workers=2)]
    dl = DataLoader(make(), batch_size=4, num_workers=2, persistent_workers=True)
    list(dl)  # workers are up and hold an old copy of the dataset
    src = DataLoader(make(), batch_size=4, num_workers=2)
    it = iter(src)
    first = [_ids(next(it)) for _ in range(2)]
    dl.load_state_dict(src.state_dict())
    del it
    assert first + [_ids(b) for b in dl] == full


def test_state_validation(shards):
    state = ShardedDataset(shards, seed=1).state_dict()
    with pytest.raises(ValueError, match="state_dict does not match this dataset: seed=1 in the state, 2 here"):
        ShardedDataset(shards, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size=1 in the state, 2 here"):
        ShardedDataset(shards, seed=1, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not a ShardedDataset state"):
        ShardedDataset(shards).load_state_dict({"epoch": 1})
    bad = dict(state, stages=[[1, [99]]])
    ds = ShardedDataset(shards, seed=1)
    with pytest.raises(ValueError, match="logical worker 0 consumed 99 samples; its part of the epoch has 40"):
        ds.load_state_dict(bad)  # at load, not at the first batch
    with pytest.raises(TypeError, match="need a fastdata.ShardedDataset"):
        DataLoader(list(range(3))).state_dict()


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_workers_walk_the_epoch_their_iter_started(tmp_path: Path) -> None:
    """A worker read the epoch from shared memory when it got round to its first walk, after the
    loader's iter() had fixed the epoch (and its resume state): set_epoch right after iter() moved
    late-starting worker processes to the new epoch, unlike every other path."""
    from fastdata.loader import DataLoader

    src = make_shards(tmp_path / "ds", 12, 3)

    def keys(batches) -> list[list[str]]:
        return [list(b["__key__"]) for b in batches]

    expected = keys(DataLoader(ShardedDataset(src, shuffle=True), batch_size=2, num_workers=2))  # epoch 0
    for kw in ({"decode_threads": 1}, {}):
        dl = DataLoader(ShardedDataset(src, shuffle=True), batch_size=2, num_workers=2, **kw)
        it = iter(dl)
        dl.set_epoch(1)  # the workers (forked or spawned by iter()) may not have started yet
        assert keys(it) == expected, kw


def test_dataset_load_state_dict_takes_a_loader_state(tmp_path: Path) -> None:
    """DataLoader.load_state_dict takes a dataset's state; the reverse failed with a misleading
    'world_size=None in the state ... pass the states of all ranks as a list'."""
    from fastdata.loader import DataLoader

    src = make_shards(tmp_path / "ds", 10, 3)
    dl = DataLoader(ShardedDataset(src, shuffle=True), batch_size=3)
    full = [k for b in dl for k in b["__key__"]]
    it = iter(dl)
    first = list(next(it)["__key__"])
    for state in (dl.state_dict(), [dl.state_dict()]):
        ds = ShardedDataset(src, shuffle=True)
        ds.load_state_dict(state)
        assert first + [s["__key__"] for s in ds] == full


def test_a_state_saved_with_other_shuffle_options_is_refused(seven):
    """The shuffle options fix the order: resuming under other ones skipped the wrong samples
    (the consumed prefix of the old order), silently losing some and repeating others."""
    a = ShardedDataset(seven, shuffle=ShuffleOptions(buffer_size=4))
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    for other in (True, ShuffleOptions(buffer_size=5), ShuffleOptions(buffer_size=4, open_shards=2),
                  ShuffleOptions(buffer_size=4, within_shard=False)):
        with pytest.raises(ValueError, match="state_dict does not match this dataset: shuffle="):
            ShardedDataset(seven, shuffle=other).load_state_dict(state)
        with pytest.raises(ValueError, match="state_dict does not match this dataset: shuffle="):
            ShardedDataset(seven, shuffle=other).load_state_dict([state])
    b = ShardedDataset(seven, shuffle=ShuffleOptions(buffer_size=4))
    b.load_state_dict(state)  # the same options: accepted, the rest comes out
    assert len(list(b)) == 4


def test_a_state_of_other_data_says_so_and_older_states_still_load(seven, tmp_path):
    state = ShardedDataset(seven, shuffle=True).state_dict()
    other = tmp_path / "o.tar"
    write_tar_shard(other, [{"__key__": f"o{k}", "cls": b"1"} for k in range(7)])
    with pytest.raises(ValueError, match="fingerprint=.*saved over other data"):
        ShardedDataset([str(other)], shuffle=True).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "shuffle_options"}  # saved before the key existed
    ShardedDataset(seven, shuffle=True).load_state_dict(older)
    with pytest.raises(ValueError, match=r"lacks \['seed'\]"):  # a missing field is no match
        ShardedDataset(seven, shuffle=True).load_state_dict({k: v for k, v in state.items() if k != "seed"})


@pytest.mark.parametrize("path", ["workers", "threads"])
def test_len_after_a_resume_is_the_whole_epoch_on_the_loader_and_its_iterator(seven, path):
    # len(loader) stays the whole epoch's count after a resume, as torch's DataLoader and torchdata's
    # StatefulDataLoader report it (an LR schedule sized epochs * len(loader) stays right); the iterator of the
    # worker path had no len() at all (TypeError from torch's infinite sampler) where the threads' had one.
    from fastdata import DataLoader

    def loader() -> DataLoader:
        return DataLoader(ShardedDataset(seven, shuffle=True, seed=3), batch_size=2, num_workers=2,
                          decode_threads=1 if path == "threads" else 0)

    first = loader()
    whole = len(first)
    it = iter(first)
    done = [next(it) for _ in range(2)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    rest = iter(again)
    assert len(again) == len(rest) == whole == 4
    assert len(done) + len(list(rest)) == whole
