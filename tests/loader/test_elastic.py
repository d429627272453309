"""Elastic resume: a state saved at (world_size W1, num_workers N1), loaded at (W2, N2).

Every sample the interrupted epoch had not yielded is yielded exactly once by the new ranks,
and every new rank yields the same number of batches (what DDP's lockstep needs)."""
from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest

from fastdata.dataset import ShardedDataset, ShuffleOptions
from fastdata.dataset._elastic import elastic_split
from fastdata.loader import DataLoader
from fastdata.shards.tar import write_tar_shard
from tests.helpers.ranks import cls_ids, rank_loader
from tests.helpers.shards import make_shards


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


def test_a_state_of_another_rank_is_refused_after_an_elastic_resume_and_warned_about_otherwise(seven):
    """Another rank's state was taken without a word. Ranks have the same per-worker counts and run in
    lockstep, so a checkpoint saved by rank 0 alone resumes every rank exactly unless samples were
    skipped: it is used, with a warning (refusing it would make such checkpoints unusable). After an
    elastic resume the ranks' positions differ: refused."""
    whole = cls_ids(ShardedDataset(seven, rank=1, world_size=2, shuffle=True))
    a = ShardedDataset(seven, rank=0, world_size=2, shuffle=True)
    it = iter(a)
    next(it)
    b = ShardedDataset(seven, rank=1, world_size=2, shuffle=True)
    with pytest.warns(RuntimeWarning, match="rank 0's state, loaded on rank 1"):
        b.load_state_dict(a.state_dict())
    assert cls_ids(b) == whole[1:]
    first = rank_loader(seven, 0, 1, batch_size=1)
    resized = rank_loader(seven, 0, 2, batch_size=1)
    with pytest.warns(UserWarning, match="repeats 1 of them"):  # 7 samples, 2 ranks, one worker each
        resized.load_state_dict([first.state_dict()])  # elastic: 1 rank -> 2
    next(iter(resized))
    with pytest.raises(ValueError, match="rank 0's state.*this is rank 1.*elastic"):
        ShardedDataset(seven, rank=1, world_size=2).load_state_dict(resized.state_dict())


def test_same_world_size_after_an_elastic_resume_keeps_equal_batch_counts(seven):
    """An elastic rest gives ranks unequal sample counts (equal batch counts for the batch size it
    was split for); resuming it at the same world size with another batch size (or num_workers)
    continued each rank's own rest, so ranks yielded different batch counts: a DDP hang."""
    first = rank_loader(seven, 0, 1, batch_size=1)
    states = [first.state_dict()]  # saved before any batch: all 7 samples remain
    resized = [rank_loader(seven, r, 4, batch_size=2) for r in range(4)]
    for dl in resized:
        dl.load_state_dict(states)
    assert [len(list(dl)) for dl in resized] == [1, 1, 1, 1]  # the elastic rest: 2+2+2+1 samples
    for dl in resized:
        dl.load_state_dict(states)
    states = [dl.state_dict() for dl in resized]  # the elastic era, nothing consumed yet
    for batch_size in (2, 1):  # 2: the split's own batch size, continued exactly; 1: a new split
        again = [rank_loader(seven, r, 4, batch_size=batch_size) for r in range(4)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for dl in again:
                dl.load_state_dict(states)
        got = [list(dl) for dl in again]
        counts = [len(b) for b in got]
        assert len(set(counts)) == 1, (batch_size, counts)  # was [2, 2, 2, 1] with batch_size=1
        assert [len(dl) for dl in again] == counts
        ids = sorted(x for b in got for batch in b for x in batch)
        if batch_size == 2:
            assert ids == list(range(7)) and not caught
        else:  # one worker per rank, 7 samples, 4 ranks: README's exception 5, even="pad" repeats one
            assert sorted(set(ids)) == list(range(7)) and len(ids) == 8
            assert any("repeats 1 of them" in str(w.message) for w in caught)


def test_elastic_resume_with_even_drop_and_fewer_samples_left_than_ranks(seven):
    """README, elastic exception 5: with one worker per rank and fewer than W2 samples left,
    even="drop" leaves them out with a warning (it raised ValueError)."""
    first = rank_loader(seven, 0, 1, batch_size=1, even="drop")
    it = iter(first)
    for _ in range(6):
        next(it)
    states = [first.state_dict()]  # 1 sample left
    resized = [rank_loader(seven, r, 4, batch_size=2, even="drop") for r in range(4)]
    for dl in resized:
        with pytest.warns(UserWarning, match="leaves 1 of them out"):
            dl.load_state_dict(states)
    assert [list(dl) for dl in resized] == [[], [], [], []]


def test_samples_per_epoch_windows_continue_the_stream_after_a_resize(seven):
    """samples_per_epoch=5 rounds to 6 positions per epoch at 2 ranks and 8 at 4: the epochs after a
    resize started at e*8, so stream positions 6 and 7 were never read and 14, 15 were read early."""
    def loaders(world):
        return [rank_loader(seven, r, world, batch_size=2, samples_per_epoch=5) for r in range(world)]

    def epoch(dls, e):
        for dl in dls:
            dl.set_epoch(e)
        return [x for dl in dls for batch in dl for x in batch]

    two = loaders(2)
    seen = epoch(two, 0)  # stream positions 0-5
    four = loaders(4)
    for dl in four:
        dl.load_state_dict([dl2.state_dict() for dl2 in two])  # saved at the end of epoch 0
    seen += epoch(four, 1)  # positions 6-13: the rest of pass 0 and all of pass 1
    assert sorted(seen) == sorted([*range(7), *range(7)])
    assert four[0].state_dict()["dataset"]["stream_origin"] == [1, 6]
    again = loaders(4)  # a restarted job at the new world size keeps the stream where it was
    for dl, old in zip(again, four):
        dl.load_state_dict(old.state_dict())
    assert epoch(again, 2) == epoch(four, 2)


@pytest.mark.parametrize("steps", [2, 99])  # 99: the whole epoch (a checkpoint taken after it)
def test_elastic_resume_with_drop_last_and_less_than_a_round_left(tmp_path: Path, steps: int) -> None:
    """drop_last=True and fewer than new_world x batch_size samples left (none, at the end of an
    epoch): load_state_dict raised ValueError; the README promises floor(R / (W2 B)) = 0 batches."""
    from fastdata.loader import DataLoader

    src = make_shards(tmp_path / "ds", 11, 3)

    def loader(rank: int, world: int) -> DataLoader:
        return DataLoader(ShardedDataset(src, rank=rank, world_size=world, shuffle=True), batch_size=2,
                          drop_last=True)

    states = []
    for r in range(2):
        dl = loader(r, 2)  # 6 samples per rank (one pad repeat), 3 batches
        it = iter(dl)
        for _ in range(min(steps, len(dl))):
            next(it)
        states.append(dl.state_dict())
    left = 12 - 2 * 2 * min(steps, 3)  # 4 or 0
    for world in (1, 3):
        counts = []
        for r in range(world):
            dl = loader(r, world)
            dl.load_state_dict(states)
            counts.append(len(list(dl)))
            dl.set_epoch(1)  # the next epoch: the plain split at the new world size
            assert len(list(dl)) == len(dl) > 0
        assert counts == [left // (world * 2)] * world  # 3 ranks with 4 left (or none): no batch, no error


def test_no_torch_length_warning_after_an_epoch_of_another_length(tmp_path: Path) -> None:
    """torch's iterator compares the batches it yields with the sample count of the latest len(loader)
    call; after a len() in a shorter epoch (here an elastic resume with nothing left: 0) it warned at
    every batch of the next epoch ('Length of IterableDataset ... was reported to be 0')."""
    import warnings

    from fastdata.loader import DataLoader

    src = make_shards(tmp_path / "ds", 8, 3)
    states = []
    for r in range(2):
        dl = DataLoader(ShardedDataset(src, rank=r, world_size=2), batch_size=1)
        list(dl)  # the whole epoch: a checkpoint taken after it
        states.append(dl.state_dict())
    for num_workers in (0, 2):
        dl = DataLoader(ShardedDataset(src, rank=0, world_size=1), batch_size=1, num_workers=num_workers)
        dl.load_state_dict(states)  # elastic: 2 ranks -> 1
        assert len(dl) == 0 and list(dl) == []
        dl.set_epoch(1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(dl)) == len(dl) == 8


@pytest.mark.parametrize(("steps", "drop_last"), [(2, False), (1, True)])
def test_len_of_an_elastic_epoch_is_the_batches_it_yields(tmp_path: Path, steps: int, drop_last: bool) -> None:
    """len(loader) in the rest of an epoch resumed at another world size split len(dataset) evenly
    over the workers, not as the elastic split does: it said 2 batches (or 0) where 1 came."""
    from fastdata.loader import DataLoader

    src = make_shards(tmp_path / "ds", 7, 3)
    dl = DataLoader(ShardedDataset(src, rank=0, world_size=1, shuffle=True), batch_size=2, drop_last=drop_last)
    it = iter(dl)
    for _ in range(steps):
        next(it)
    states = [dl.state_dict()]
    for rank in range(2):
        dl = DataLoader(ShardedDataset(src, rank=rank, world_size=2, shuffle=True), batch_size=2,
                        num_workers=2, decode_threads=1, drop_last=drop_last)
        dl.load_state_dict(states)  # elastic: 1 rank -> 2
        assert len(dl) == len(list(dl))


def test_one_ranks_state_after_an_elastic_resume_with_another_loader_is_refused(seven):
    """After an elastic resume the ranks hold different sample counts (7 over
    4 ranks: 2, 2, 2, 1), equal in batches only for the loader the rest was split for. Each rank loading
    its own state with batch_size=1 gave [2, 2, 2, 1] batches: a DDP hang. The state now records the
    loader it was split for; another one is refused (the list of every rank's is split again)."""
    first = rank_loader(seven, 0, 1, batch_size=1)
    resized = [rank_loader(seven, r, 4, batch_size=2) for r in range(4)]
    for dl in resized:
        dl.load_state_dict([first.state_dict()])
    states = [dl.state_dict() for dl in resized]
    assert states[0]["dataset"]["split_for"] == [2, 1, False]
    for batch_size, num_workers in ((1, 0), (2, 2), (3, 0)):
        again = [rank_loader(seven, r, 4, batch_size=batch_size, num_workers=num_workers) for r in range(4)]
        with pytest.raises(ValueError, match=r"rank 0's rest of epoch 0 after an elastic resume: the ranks hold "
                                             r"\[2, 2, 2, 1\] samples, split for equal batch counts with batch_size=2"
                                             r".*Load the list of every rank's state"):
            again[0].load_state_dict(states[0])
    same = [rank_loader(seven, r, 4, batch_size=2) for r in range(4)]  # the loader it was split for: exact
    for dl, st in zip(same, states):
        dl.load_state_dict(st)
    got = [list(dl) for dl in same]
    assert [len(b) for b in got] == [1, 1, 1, 1] and sorted(x for b in got for y in b for x in y) == list(range(7))
    for dl, st in zip([rank_loader(seven, r, 4, batch_size=1) for r in range(4)], [d.state_dict() for d in same]):
        dl.load_state_dict(st)  # the rest read to its end: nothing left on any rank, any loader will do
        assert list(dl) == []
    relisted = [rank_loader(seven, r, 4, batch_size=1) for r in range(4)]  # the list, split again for batch_size=1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one worker per rank: even="pad" repeats one
        for dl in relisted:
            dl.load_state_dict(states)
    assert relisted[0].state_dict()["dataset"]["split_for"] == [1, 1, False]
    for dl, st in zip([rank_loader(seven, r, 4, batch_size=1) for r in range(4)], [d.state_dict() for d in relisted]):
        dl.load_state_dict(st)  # now split for batch_size=1: each rank's own state is taken
        assert len(list(dl)) == 2
