"""Elastic resume: a state saved at (world_size W1, num_workers N1), loaded at (W2, N2).

Every sample the interrupted epoch had not yielded is yielded exactly once by the new ranks,
and every new rank yields the same number of batches (what DDP's lockstep needs).
"""
from __future__ import annotations

import json
import warnings
from collections import Counter
import pytest

from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.dataset._elastic import elastic_split
from fastdata.loader import DataLoader
from fastdata.shards.tar import write_tar_shard

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
BS = 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    dest = tmp_path_factory.mktemp("el")
    sizes = [9, 4, 11, 7, 3, 10, 8, 5]  # 57 samples, uneven shards
    paths, i = [], 0
    for j, size in enumerate(sizes):
        path = dest / f"s{j}.tar"
        write_tar_shard(path, [{"__key__": f"k{i + k:04d}", "cls": str(i + k).encode()} for k in range(size)])
        paths.append(str(path))
        i += size
    return paths


def _collate(samples):
    return [int(s["cls"]) for s in samples]


def _loader(shards, rank, world, workers, *, shuffle=True, even="pad", drop_last=False):
    ds = ShardedDataset(shards, shuffle=ShuffleOptions(open_shards=2, buffer_size=8) if shuffle else False, seed=7,
                        rank=rank, world_size=world, even=even)
    return DataLoader(ds, batch_size=BS, num_workers=workers, collate_fn=_collate, drop_last=drop_last)


def _epoch_multiset(shards, world, workers, **kw) -> Counter:
    """The samples of a whole epoch at ``world`` ranks (a rank's samples do not depend on its worker
    count, so the reference is read in-process: faster, same multiset)."""
    out: Counter = Counter()
    for r in range(world):
        for b in _loader(shards, r, world, 0, **kw):
            out.update(b)
    return out


def _run_partial(shards, world, workers, steps, **kw):
    """Each rank takes ``steps`` batches (lockstep), then saves; returns (seen, states)."""
    seen: Counter = Counter()
    states = []
    for r in range(world):
        loader = _loader(shards, r, world, workers, **kw)
        it = iter(loader)
        for _ in range(steps):
            seen.update(next(it))
        states.append(json.loads(json.dumps(loader.state_dict())))  # checkpoints are JSON-able
        del it
    return seen, states


def _run_rest(shards, world, workers, states, **kw):
    seen: Counter = Counter()
    batches = []
    for r in range(world):
        loader = _loader(shards, r, world, workers, **kw)
        loader.load_state_dict(states)
        n = 0
        for b in loader:
            seen.update(b)
            n += 1
        batches.append(n)
    return seen, batches


GRID = [  # (W1, N1, steps) -> (W2, N2)
    ((2, 2, 3), (1, 0)),
    ((2, 0, 4), (1, 2)),
    ((1, 0, 5), (3, 2)),
    ((1, 2, 3), (3, 0)),  # 45 left: an exact split exists even with one worker per rank
    ((4, 2, 1), (2, 2)),
    ((4, 0, 2), (2, 0)),
    ((3, 1, 2), (2, 3)),
    ((2, 2, 0), (3, 2)),  # nothing consumed yet
]


@pytest.mark.parametrize(("old", "new"), GRID, ids=[f"{a[0]}x{a[1]}->{b[0]}x{b[1]}" for a, b in GRID])
def test_elastic_exactly_once_equal_batches(shards, old, new):
    (w1, n1, steps), (w2, n2) = old, new
    full = _epoch_multiset(shards, w1, n1)
    seen1, states = _run_partial(shards, w1, n1, steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="elastic resume")  # an exact split: no fallback warning
        seen2, batches = _run_rest(shards, w2, n2, states)
    assert seen1 + seen2 == full  # every position of the epoch exactly once (pad repeats are positions)
    assert len(set(batches)) == 1, batches
    # the next epoch is the plain split at the new world size
    nxt: Counter = Counter()
    for r in range(w2):
        loader = _loader(shards, r, w2, 0)
        loader.set_epoch(1)
        nxt.update(c for b in loader for c in b)
    assert sorted(nxt) == list(range(57))


def test_elastic_twice_within_one_epoch(shards):
    full = _epoch_multiset(shards, 2, 2)
    seen1, states = _run_partial(shards, 2, 2, 2)
    seen = seen1
    # 2 -> 3: every new rank reads 1 batch, then saves again (states now carry the era history)
    states3 = []
    for r in range(3):
        loader = _loader(shards, r, 3, 1)
        loader.load_state_dict(states)
        it = iter(loader)
        seen.update(next(it))
        states3.append(loader.state_dict())
    assert all("eras" in s["dataset"] for s in states3)
    seen2, batches = _run_rest(shards, 1, 2, states3)
    assert seen + seen2 == full and len(batches) == 1


def test_elastic_same_rank_resume_after_resize(shards):
    """A state saved during the elastic part resumes at the same world size from one rank's state."""
    _, states = _run_partial(shards, 2, 0, 3)
    loader = _loader(shards, 0, 1, 0)
    loader.load_state_dict(states)
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    rest = [c for b in it for c in b]
    again = _loader(shards, 0, 1, 0)
    again.load_state_dict(state)
    assert [c for b in again for c in b] == rest and first


def test_elastic_drop_last(shards):
    seen1, states = _run_partial(shards, 2, 2, 2, drop_last=True)
    seen2, batches = _run_rest(shards, 3, 2, states, drop_last=True)
    assert len(set(batches)) == 1 and batches[0] > 0
    assert not (seen1 + seen2) - _epoch_multiset(shards, 2, 2)  # nothing read twice


def test_single_state_at_other_world_size_is_refused(shards):
    _, states = _run_partial(shards, 2, 0, 1)
    loader = _loader(shards, 0, 3, 0)
    with pytest.raises(ValueError, match="pass the states of all ranks as a list"):
        loader.load_state_dict(states[0])


def test_rank_states_must_be_complete_and_ordered(shards):
    _, states = _run_partial(shards, 2, 0, 1)
    loader = _loader(shards, 0, 3, 0)
    with pytest.raises(ValueError, match="in rank order"):
        loader.load_state_dict(states[::-1])
    with pytest.raises(ValueError, match="in rank order"):
        loader.load_state_dict(states[:1] + states[:1])


def test_single_worker_without_exact_split_follows_even(shards):
    # 1 -> 3 ranks with num_workers=0: when the last round of batches has fewer samples than ranks,
    # no exact split exists; even="pad" repeats fewer than 3 samples, even="drop" leaves fewer than 3 out
    for even in ("pad", "drop"):
        full = _epoch_multiset(shards, 1, 2, even=even)
        seen1, states = _run_partial(shards, 1, 2, 2, even=even)
        with pytest.warns(UserWarning, match="elastic resume") as rec:
            seen2, batches = _run_rest(shards, 3, 0, states, even=even)
        assert len(set(batches)) == 1
        total = seen1 + seen2
        if even == "pad":
            assert not full - total and 0 < sum((total - full).values()) < 3 and "repeats" in str(rec[0].message)
        else:
            assert not total - full and 0 < sum((full - total).values()) < 3 and "leaves" in str(rec[0].message)


def test_infeasible_split_is_a_precise_error():
    # 9 samples, 2 ranks, 1 worker, batches of 4: ranks would need 2 batches each (>= 10 samples)
    with pytest.raises(ValueError, match="cannot each yield the same number of batches"):
        elastic_split(9, 2, 1, 4)
    assert sum(map(sum, elastic_split(9, 2, 1, 4, even="pad"))) == 10
    assert sum(map(sum, elastic_split(9, 2, 1, 4, even="drop"))) == 8
    assert sum(map(sum, elastic_split(9, 2, 2, 4))) == 9
    for counts in elastic_split(9, 2, 2, 4):
        assert sum(-(-c // 4) for c in counts) == 2


@pytest.mark.filterwarnings("ignore:a streaming \\(URL\\) source:UserWarning")  # unequal ranks: not the point here
def test_streaming_resize_is_a_precise_error(tmp_path):
    ds = ShardedDataset(["http://127.0.0.1:9/a.tar", "http://127.0.0.1:9/b.tar"], rank=0, world_size=1)
    states = [ShardedDataset(["http://127.0.0.1:9/a.tar", "http://127.0.0.1:9/b.tar"], rank=r,
                             world_size=2).state_dict() for r in range(2)]
    with pytest.raises(ValueError, match="streaming .* cannot resume at world_size=1"):
        ds.load_state_dict(states)


@pytest.mark.parametrize("options", [{"samples_per_epoch": 40, "shuffle": True}, {"shuffle": False},
                                     {"even": "drop", "shuffle": True}], ids=["samples_per_epoch", "ordered", "drop"])
def test_elastic_other_epoch_options(shards, options):
    def loader(rank, world):
        ds = ShardedDataset(shards, rank=rank, world_size=world, seed=3, **options)
        ds.set_epoch(2)
        return DataLoader(ds, batch_size=3, num_workers=2, collate_fn=_collate)

    full = Counter(c for r in range(3) for b in loader(r, 3) for c in b)
    seen: Counter = Counter()
    states = []
    for r in range(3):
        it_loader = loader(r, 3)
        it = iter(it_loader)
        for _ in range(2):
            seen.update(next(it))
        states.append(it_loader.state_dict())
        del it
    batches = []
    for r in range(2):
        new = loader(r, 2)
        new.load_state_dict(states)
        n = 0
        for b in new:
            seen.update(b)
            n += 1
        batches.append(n)
    assert seen == full and len(set(batches)) == 1


def test_elastic_on_the_cached_fast_path(tmp_path):
    """Epochs served from the preprocessing cache (no worker processes) resize exactly once too."""
    import numpy as np

    from fastdata.cli._synth import jpeg_bytes, synth_image
    from fastdata.shards.writer import ShardWriter
    from fastdata.transforms import ResizeCenterCrop

    rng = np.random.default_rng(0)
    with ShardWriter(tmp_path / "ds", max_samples=7) as w:
        for i in range(40):
            w.write({"__key__": f"k{i:03d}", "jpg": jpeg_bytes(synth_image(rng, 32, 32), 90), "cls": str(i).encode()})

    def loader(rank, world):
        ds = ShardedDataset(tmp_path / "ds", shuffle=True, seed=1, rank=rank, world_size=world,
                            preprocess=ResizeCenterCrop(16), cache=tmp_path / "cache")
        return DataLoader(ds, batch_size=4, num_workers=2)

    loader(0, 2).dataset.build_cache()
    full = Counter(int(c) for r in range(2) for b in loader(r, 2) for c in b["cls"])
    seen: Counter = Counter()
    states = []
    for r in range(2):
        old = loader(r, 2)
        it = iter(old)
        for _ in range(2):
            seen.update(int(c) for c in next(it)["cls"])
        assert old.last_path == "cached"
        states.append(old.state_dict())
        del it
    batches = []
    for r in range(3):
        new = loader(r, 3)
        new.load_state_dict(states)
        n = 0
        for b in new:
            seen.update(int(c) for c in b["cls"])
            n += 1
        assert new.last_path == "cached"
        batches.append(n)
    assert seen == full and len(set(batches)) == 1
