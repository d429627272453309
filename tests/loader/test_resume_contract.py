"""The resume contract of ``fastdata.DataLoader``: one case per point of docs/guide/resume-contract.md.

Every case runs on every loader path (``PATHS``: worker processes, the thread decoder, the cached fast
path, in-process) and compares with an uninterrupted run of the same seed on that path: the keys and
pixels of every batch, and for the TrainStep case the losses and parameters, bit for bit. The data is
tiny (24 JPEGs of 12x10 px in 3 shards, 8 px after ``preprocess``) and no loader has more than 2 workers.
"""
from __future__ import annotations

import json
import random
import warnings
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fastdata
from fastdata import CheckpointError, CUDAPrefetcher, DataLoader, FastdataError, ShardedDataset, StateError
from fastdata.gpu import Normalize
from fastdata.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop, ResizeCenterCrop
from tests.helpers.images import jpeg
from tests.helpers.shards import make_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SAMPLES, BATCH = 24, 4
# every path with the worker count that fixes the order; "cached" reads a filled store in this process
PATHS: dict[str, dict[str, Any]] = {
    "workers": dict(num_workers=2, cached_fast_path=False),
    "threads": dict(num_workers=2, decode_threads=2),
    "cached": dict(num_workers=2, cached_fast_path=True),
    "inproc": dict(num_workers=0, cached_fast_path=False),
}
LAST_PATH = {"workers": "workers", "threads": "threads", "cached": "cached", "inproc": "workers"}
ALL_PATHS = pytest.mark.parametrize("path", list(PATHS))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """24 samples (jpg, cls) in 3 tar shards, and a cache store of them, filled (the cached path's)."""
    root = tmp_path_factory.mktemp("contract")
    make_shards(root / "shards", SAMPLES, 8, key="k{i:03d}", cls=lambda i: i % 3, image=lambda i: jpeg(i, 12, 10))
    cache = root / "cache"
    ShardedDataset(root / "shards", preprocess=ResizeCenterCrop(8), cache=cache).build_cache()
    return SimpleNamespace(shards=root / "shards", cache=cache, refs={})


def make(data: SimpleNamespace, path: str, *, num_workers: int | None = None, cache: Any = "default",
         ds: dict[str, Any] | None = None, **kw: Any) -> DataLoader:
    """A fresh loader (and dataset) on ``path``; ``ds``: more ShardedDataset options."""
    options = {**PATHS[path], **kw}
    if num_workers is not None:
        options["num_workers"] = num_workers
    if cache == "default":
        cache = data.cache if path == "cached" else None
    dataset = ShardedDataset(data.shards, **{"shuffle": True, "seed": 7, "preprocess": ResizeCenterCrop(8),
                                             "cache": cache, **(ds or {})})
    return DataLoader(dataset, batch_size=BATCH, **options)


def record(batches: Iterable[Any], take: int | None = None) -> list[tuple[list[str], torch.Tensor]]:
    """(keys, pixels) of each batch, at most ``take`` of them (then the loop breaks)."""
    out = []
    for b in batches:
        out.append((list(b["__key__"]), b["jpg"].clone()))
        if take is not None and len(out) == take:
            break
    return out


def same(got: list[Any], want: list[Any]) -> None:
    assert [k for k, _ in got] == [k for k, _ in want]
    for j, ((_, a), (_, b)) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"pixels of batch {j}"


def epoch(loader: DataLoader, path: str, e: int | None = None, take: int | None = None) -> list[Any]:
    if e is not None:
        loader.set_epoch(e)
    got = record(loader, take)
    assert loader.last_path == LAST_PATH[path], loader.fallback_reason
    return got


def reference(data: SimpleNamespace, path: str, epochs: int = 2, **kw: Any) -> list[list[Any]]:
    """The uninterrupted run on ``path``: every epoch's (keys, pixels) (computed once per settings)."""
    key = (path, epochs, repr(sorted(kw.items())))
    if key not in data.refs:
        loader = make(data, path, **kw)
        data.refs[key] = [epoch(loader, path, e) for e in range(epochs)]
    return data.refs[key]


def saved(state: Any) -> Any:
    """The state as a checkpoint file gives it back (JSON)."""
    return json.loads(json.dumps(state))


def pixels_by_key(epochs: list[list[Any]]) -> dict[tuple[int, str], torch.Tensor]:
    return {(e, k): px for e, batches in enumerate(epochs) for keys, pxs in batches for k, px in zip(keys, pxs)}


# ----------------------------------------------------------------------------------------------- the cases

@ALL_PATHS
def test_an_epoch_boundary_state(data, path):
    """A state saved after an epoch's last batch resumes with nothing of that epoch and the next one whole;
    one saved after set_epoch(next) resumes with that epoch whole: no epoch skipped or replayed."""
    ref = reference(data, path)
    loader = make(data, path)
    epoch(loader, path, 0)
    end = saved(loader.state_dict())
    assert end["batches"] == len(ref[0])
    loader.set_epoch(1)
    start = saved(loader.state_dict())
    assert start["batches"] == 0 and start["dataset"]["epoch"] == 1
    for state in (end, start):
        fresh = make(data, path)
        fresh.load_state_dict(state)
        assert fresh.state_dict() == state
        if state is end:
            assert record(fresh) == []  # the rest of epoch 0
        same(epoch(fresh, path, 1), ref[1])


@ALL_PATHS
def test_break_then_resume(data, path):
    """An early break, twice: each resume continues exactly, and ``batches`` counts across both."""
    ref = reference(data, path)[1]
    first = make(data, path)
    head = epoch(first, path, 1, take=1)
    state = saved(first.state_dict())
    second = make(data, path)
    second.load_state_dict(state)
    assert second.state_dict() == state
    second.set_epoch(1)  # the loop calls it again: the loaded position stays
    middle = record(second, take=2)
    state = saved(second.state_dict())
    assert state["batches"] == 3
    third = make(data, path)
    third.load_state_dict(state)
    assert third.state_dict() == state
    same(head + middle + epoch(third, path), ref)
    assert third.state_dict()["batches"] == len(ref)


@ALL_PATHS
def test_break_next_epoch_then_resume(data, path):
    """A break in one epoch leaves the next one whole; a break there resumes exactly."""
    ref = reference(data, path)
    loader = make(data, path)
    same(epoch(loader, path, 0, take=2), ref[0][:2])
    head = epoch(loader, path, 1, take=3)
    same(head, ref[1][:3])
    fresh = make(data, path)
    fresh.load_state_dict(saved(loader.state_dict()))
    same(head + epoch(fresh, path, 1), ref[1])


@ALL_PATHS
def test_an_iterator_made_before_the_load(data, path):
    """Iterators made before load_state_dict (one started, one not) raise StateError at their next
    next(); the next iter() yields exactly the rest of the loaded state."""
    ref = reference(data, path)[1]
    src = make(data, path)
    head = epoch(src, path, 1, take=2)
    state = saved(src.state_dict())
    loader = make(data, path)
    started = iter(loader)
    next(started)
    untouched = iter(loader)
    loader.load_state_dict(state)
    for it in (started, untouched):
        with pytest.raises(StateError, match="made before load_state_dict"):
            next(it)
    same(head + epoch(loader, path), ref)
    assert loader.state_dict()["batches"] == len(ref)


@ALL_PATHS
def test_loading_into_live_persistent_workers(data, path):
    """A load into a loader whose persistent workers are up (iterating the next epoch) ends that
    iteration with StateError, not with an empty epoch, and resumes exactly."""
    ref = reference(data, path)[1]
    loader = make(data, path, persistent_workers=PATHS[path]["num_workers"] > 0)
    epoch(loader, path, 0)
    loader.set_epoch(1)
    live = iter(loader)
    next(live)
    src = make(data, path)
    head = epoch(src, path, 1, take=3)
    loader.load_state_dict(saved(src.state_dict()))
    with pytest.raises(StateError):
        next(live)
    same(head + epoch(loader, path), ref)


@ALL_PATHS
def test_the_prefetcher_ahead_into_the_next_epoch(data, path):
    """The prefetcher's state is the position of the last batch handed over, also when it has read
    into the next epoch: at the end of an epoch and in the next one."""
    ref = reference(data, path)
    gen = dict(generator=torch.Generator().manual_seed(0))  # the next epoch starts in the prefetcher's thread
    with CUDAPrefetcher(make(data, path, **gen), device="cpu", depth=2) as batches:
        batches.set_epoch(0)
        same(record(batches), ref[0])
        end = saved(batches.state_dict())
        head = record(batches, take=2)  # epoch 1 (set_epoch drives the epochs)
        mid = saved(batches.state_dict())
    same(head, ref[1][:2])
    assert (end["batches"], end["dataset"]["epoch"], mid["batches"]) == (len(ref[0]), 0, 2)
    for state, want in ((end, [[], ref[1]]), (mid, [ref[1][2:]])):
        with CUDAPrefetcher(make(data, path, **gen), device="cpu", depth=2) as batches:
            batches.load_state_dict(state)
            assert batches.state_dict() == state
            first = state["dataset"]["epoch"]
            for e, rest in zip(range(first, 2), want):
                batches.set_epoch(e)
                same(record(batches), rest)


def _trainer(seed: int = 0) -> fastdata.TrainStep:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(3 * 8 * 8, 3))
    return fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              torch.nn.functional.cross_entropy, input_key="jpg", target_key="cls", grad_accum=2)


def _train(step: fastdata.TrainStep, batches: CUDAPrefetcher, e: int, take: int | None = None) -> list[torch.Tensor]:
    batches.set_epoch(e)
    losses = []
    for batch in batches:
        losses.append(step(batch))
        if take is not None and len(losses) == take:
            break
    return losses


@ALL_PATHS
def test_a_checkpoint_with_a_trainstep(data, path, tmp_path):
    """save_checkpoint mid-epoch (mid-accumulation too) and load_checkpoint give the uninterrupted
    run's losses and parameters bit for bit; a checkpoint that does not fit changes nothing."""
    norm = Normalize(keys=["jpg"])
    step = _trainer()
    with CUDAPrefetcher(make(data, path), device="cpu", transform=norm) as batches:
        full = _train(step, batches, 0) + _train(step, batches, 1)
    want = [p.detach().clone() for p in step.module.parameters()]

    step = _trainer()
    with CUDAPrefetcher(make(data, path), device="cpu", transform=norm) as batches:
        losses = _train(step, batches, 0) + _train(step, batches, 1, take=3)
        fastdata.save_checkpoint(tmp_path / "c.pt", step, loader=batches, epoch=1)
    step = _trainer(seed=1)  # other weights: the checkpoint brings the right ones
    with CUDAPrefetcher(make(data, path), device="cpu", transform=norm) as batches:
        other = make(data, path, ds=dict(seed=8))  # a loader over another order: refused whole
        before = [p.detach().clone() for p in step.module.parameters()]
        with pytest.raises(CheckpointError, match="seed=7 in the state, 8 here"):
            fastdata.load_checkpoint(tmp_path / "c.pt", step, loader=other)
        assert all(torch.equal(a, b) for a, b in zip(before, step.module.parameters())) and step.steps == 0
        start = fastdata.load_checkpoint(tmp_path / "c.pt", step, loader=batches).epoch
        losses += _train(step, batches, start)
    assert len(losses) == len(full) and all(torch.equal(a, b) for a, b in zip(losses, full))
    assert all(torch.equal(a, b) for a, b in zip(want, step.module.parameters()))


@ALL_PATHS
def test_a_topology_change(data, path):
    """Every rank's states at world size 2 resume at world sizes 1 and 3 (other worker counts): each
    remaining sample exactly once, the same batch count on every rank, the same pixels."""
    px = pixels_by_key(reference(data, path))
    states, heads = [], []
    for rank in range(2):
        loader = make(data, path, ds=dict(rank=rank, world_size=2))
        heads += [k for keys, _ in epoch(loader, path, 1, take=rank + 1) for k in keys]
        states.append(saved(loader.state_dict()))
    for world, workers in ((1, 1), (3, 2)):
        rests, counts = [], set()
        for rank in range(world):
            loader = make(data, path, num_workers=workers, ds=dict(rank=rank, world_size=world))
            loader.load_state_dict(states)
            got = record(loader)
            counts.add(len(got))
            for keys, pxs in got:
                rests += keys
                assert all(torch.equal(px[(1, k)], p) for k, p in zip(keys, pxs))
        assert sorted(heads + rests) == sorted(k for _, k in px if _ == 1), world
        assert len(counts) == 1, counts


@ALL_PATHS
def test_a_resume_during_the_cache_fill(data, path, tmp_path):
    """A run interrupted while it fills the cache store resumes exactly (the store half filled), and
    the epoch after it reads the full store (on the cached path: in this process)."""
    ref = reference(data, path)
    fill = tmp_path / "cache"
    # the cached path reads the store once it is full ("auto"); the others fill it on their own path
    options = dict(cache=fill, cached_fast_path="auto" if path == "cached" else False)
    ahead = dict(prefetch_factor=1) if PATHS[path]["num_workers"] and path != "threads" else {}
    first = make(data, path, **options, **ahead)
    first.set_epoch(0)
    head = record(first, take=1)
    state = saved(first.state_dict())
    resumed = make(data, path, **options)
    store = resumed.dataset.loader_seam.cache_store()
    assert 0 < store.num_valid() < SAMPLES  # interrupted while it filled the store
    resumed.load_state_dict(state)
    rest = record(resumed)
    assert resumed.last_path == ("workers" if path == "cached" else LAST_PATH[path])
    same(head + rest, ref[0])
    same(epoch(resumed, path, 1), ref[1])  # the store is full: the cached path reads it


@ALL_PATHS
def test_chains_of_resumes(data, path):
    """Chains of resumes (each a fresh loader; every other one on this path, the rest on random paths,
    with 0 to 2 workers): every sample of every epoch exactly once, with its pixels; ``batches``
    counts every batch of the epoch, and each state survives a load unchanged."""
    rng = random.Random(list(PATHS).index(path))
    px = pixels_by_key(reference(data, path, epochs=3))
    seen: dict[int, list[str]] = {0: [], 1: [], 2: []}
    state, e, resumes, done = None, 0, 0, 0
    while e < 3:
        hop = path if resumes % 2 == 0 else rng.choice(list(PATHS))
        loader = make(data, hop, num_workers=rng.choice([0, 1, 2]))
        if state is not None:
            loader.load_state_dict(state)
            assert loader.state_dict() == state
        loader.set_epoch(e)
        take = rng.choice([0, 1, 2])
        got = record(loader, take) if take else []
        for keys, pxs in got:
            seen[e] += keys
            assert all(torch.equal(px[(e, k)], p) for k, p in zip(keys, pxs))
        done += len(got)
        state = saved(loader.state_dict())
        assert state["batches"] == done
        resumes += 1
        if take and len(got) < take:  # the epoch ended before the break
            e, done = e + 1, 0
    assert resumes >= 10
    for e, keys in seen.items():
        assert sorted(keys) == sorted(f"k{i:03d}" for i in range(SAMPLES)), e


_BAD = [None, "1", 1.5, True, -1, 10**9, [], {}, [[1]]]


def _garbles(good: dict[str, Any], foreign: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """Damaged and foreign states: each comes with a label for the failure message."""
    yield "not a dict", 7
    yield "a string", "state"
    yield "an empty list", []
    yield "a list of non-states", [1, 2]
    for key in good:
        yield f"without {key}", {k: v for k, v in good.items() if k != key}
        for bad in _BAD:
            yield f"{key}={bad!r}", {**good, key: bad}
    ds = good["dataset"]
    for key in ds:
        yield f"dataset without {key}", {**good, "dataset": {k: v for k, v in ds.items() if k != key}}
        for bad in _BAD:
            yield f"dataset {key}={bad!r}", {**good, "dataset": {**ds, key: bad}}
    for key, value in [
        ("stages", [[2, [99, 0]]]), ("stages", [[2, [0]]]), ("stages", [[0, []]]), ("stages", [[2, [-1, 0]]]),
        ("stages", [["2", [0, 0]]]), ("stages", [[2, [0.5, 0]]]), ("stages", [[2, [0, 0], 5]]),
        ("stages", [[1, [3]], [2, [0, 99]]]), ("next_worker", 2), ("rank", 5), ("world_size", 0), ("epoch", 1.5),
        ("version", 7), ("eras", [{"world_size": 2}]), ("stream_origin", ["a", 0]),
        ("eras", [{"world_size": 1, "workers": None, "stages": [[[1, [99]]]]}]),
    ]:
        yield f"dataset {key}={value!r}", {**good, "dataset": {**ds, key: value}}
    yield "eras with a split of other ranks", {**good, "dataset": {
        **ds, "eras": [{"world_size": 1, "workers": None, "stages": [[[1, [2]]]]}], "split": [[1], [2]]}}
    yield "version 7", {**good, "version": 7}
    yield "num_workers of other positions", {**good, "num_workers": 1}
    yield "a list with one bad rank", [good, {**good, "dataset": {**ds, "rank": 1, "stages": 3}}]
    yield from foreign.items()


# The garbles that load, per path, and why each is a state after all (every other one is refused)
_ACCEPTED = {
    "dataset epoch=1000000000",  # an epoch is any int >= 0: the same positions in a later epoch
    "dataset shuffle=True",  # the state's own value (it was saved with shuffle=True)
    "dataset samples_per_epoch=None",  # the state's own value
    "dataset without shuffle_options",  # states saved before shuffle_options lack it: not checked then
    "dataset without next_worker",  # states saved before next_worker lack it: 0, this state's value
}
ACCEPTED = {
    "workers": _ACCEPTED, "threads": _ACCEPTED, "cached": _ACCEPTED,
    # num_workers=1 instead of 0: both are one walk, so the positions (one logical worker) are the same
    "inproc": _ACCEPTED | {"num_workers of other positions"},
}


@ALL_PATHS
def test_garbled_and_foreign_states(data, path, tmp_path):
    """Damaged, out-of-range and foreign states are refused at load_state_dict with a FastdataError
    (StateError) and change nothing, on the loader, the prefetcher and through load_checkpoint;
    a state that loads iterates without any error (nothing is deferred to a worker)."""
    src = make(data, path)
    epoch(src, path, 1, take=2)
    good = saved(src.state_dict())
    step = _trainer()
    other_seed = make(data, path, ds=dict(seed=8))
    other_seed.set_epoch(1)
    foreign = {
        "a TrainStep state": step.state_dict(),
        "an optimizer state": step.optimizer.state_dict(),
        "prefetcher statistics": CUDAPrefetcher([], device="cpu").stats(),
        "a torchdata StatefulDataLoader state": {"_snapshot": {"_main_snapshot": {}}, "_steps_since_snapshot": 0},
        "another seed's state": saved(other_seed.state_dict()),
        "a world_size=2 state": saved(make(data, path, ds=dict(rank=1, world_size=2)).state_dict()),
    }
    target = make(data, path)
    before = target.state_dict()
    accepted = []
    for label, state in _garbles(good, foreign):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # another rank's state is taken with a warning
                target.load_state_dict(state)
        except FastdataError:
            assert target.state_dict() == before, label
            continue
        except Exception as e:  # noqa: BLE001 - the point: nothing else comes out
            pytest.fail(f"{label}: {type(e).__name__}: {e}")
        accepted.append(label)
        record(target)  # it loaded: it iterates without an error
        target = make(data, path)
        before = target.state_dict()
    assert set(accepted) == ACCEPTED[path], accepted  # the garbles that are states after all

    with CUDAPrefetcher(make(data, path), device="cpu") as batches:
        it = iter(batches)
        head = record(it, take=1)
        for label, state in [("version 7", {**good, "version": 7}), *foreign.items()]:
            with pytest.raises(FastdataError):
                batches.load_state_dict(state)
        assert len(head) + len(record(it)) == len(reference(data, path)[0])  # the epoch went on

    fastdata.save_checkpoint(tmp_path / "c.pt", step, loader_state={**good, "dataset": {**good["dataset"], "epoch": 1.5}})
    untouched = _trainer(seed=1)
    weights = [p.detach().clone() for p in untouched.module.parameters()]
    with pytest.raises(CheckpointError, match="epoch must be an int"):
        fastdata.load_checkpoint(tmp_path / "c.pt", untouched, loader=make(data, path))
    assert all(torch.equal(a, b) for a, b in zip(weights, untouched.module.parameters()))


def jitter(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A user's random transform: it draws from the generator fastdata passes (one per sample)."""
    return (image.int() + torch.randint(-20, 21, (), generator=generator)).clamp(0, 255).to(torch.uint8)


RANDOM = Compose([RandomResizedCrop(6, scale=(0.3, 1.0)), RandomHorizontalFlip(), jitter])


@ALL_PATHS
def test_a_cpu_random_transform(data, path):
    """Random CPU augmentation drawn from the per-sample generator gives a resumed epoch the same pixels,
    batch for batch with the same worker count and sample for sample with another."""
    ref = reference(data, path, ds=dict(transform=RANDOM))[1]
    assert len({tuple(px[0].flatten().tolist()) for _, px in ref}) > 1
    loader = make(data, path, ds=dict(transform=RANDOM))
    head = epoch(loader, path, 1, take=2)
    state = saved(loader.state_dict())
    resumed = make(data, path, ds=dict(transform=RANDOM))
    resumed.load_state_dict(state)
    same(head + epoch(resumed, path), ref)
    px = pixels_by_key([[], ref])
    other = make(data, path, num_workers=1, ds=dict(transform=RANDOM))
    other.load_state_dict(state)
    rest = record(other)
    assert sorted(k for keys, _ in head + rest for k in keys) == sorted(k for _, k in px)
    assert all(torch.equal(px[(1, k)], p) for keys, pxs in rest for k, p in zip(keys, pxs))


# ----------------------------------------------------------------------------------------------- trainers

@ALL_PATHS
def test_lightning_resumes_a_fit_mid_epoch(data, path, tmp_path):
    """Lightning's Trainer sets each epoch (through ``loader.sampler``) and saves the loader's state in its
    checkpoints: a fit sees a plain loop's batches, and ``fit(ckpt_path=...)`` from a mid-epoch checkpoint
    exactly the uninterrupted fit's remaining ones."""
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 3)
            self.seen: list[Any] = []

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            self.seen.append((list(batch["__key__"]), batch["jpg"].clone()))
            return torch.nn.functional.cross_entropy(self.net(batch["jpg"].float().mean(dim=(2, 3))), batch["cls"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    options = dict(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                   enable_model_summary=False)
    full = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning.Trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1)],
                          **options).fit(full, make(data, path))
        resumed = Model()
        loader = make(data, path)
        lightning.Trainer(enable_checkpointing=False, **options).fit(
            resumed, loader, ckpt_path=str(tmp_path / "epoch=1-step=8.ckpt"))
    assert loader.last_path == LAST_PATH[path]
    ref = reference(data, path)
    same(full.seen, ref[0] + ref[1])
    same(resumed.seen, full.seen[8:])


@ALL_PATHS
def test_accelerate_prepare_save_state_and_load_state(data, path, tmp_path):
    """``Accelerator.prepare`` gives the loader itself (the same batches; a DataLoader accelerate builds
    from its arguments gets plain batches too, never a private type), and ``save_state``/``load_state``
    resume it exactly; so does a CUDAPrefetcher registered for checkpointing."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.data_loader import prepare_data_loader

    ref = reference(data, path)[0]
    model = torch.nn.Linear(3, 3)
    acc = accelerate.Accelerator(cpu=True)
    _, _, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), make(data, path))
    assert isinstance(loader, DataLoader) and loader.collate_fn is torch.utils.data.default_collate
    rebuilt = prepare_data_loader(make(data, path))  # as prepare() rebuilt it before: torch's iteration
    same(record(rebuilt), ref)
    head = epoch(loader, path, 0, take=2)
    acc.save_state(tmp_path / "a")
    acc = accelerate.Accelerator(cpu=True)
    _, _, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), make(data, path))
    acc.load_state(tmp_path / "a")
    same(head + epoch(loader, path), ref)

    acc = accelerate.Accelerator(cpu=True)
    batches = CUDAPrefetcher(make(data, path), device=acc.device)
    acc.register_for_checkpointing(batches)
    head = record(batches, take=3)
    acc.save_state(tmp_path / "b")
    batches.close()
    acc = accelerate.Accelerator(cpu=True)
    with CUDAPrefetcher(make(data, path), device=acc.device) as batches:
        acc.register_for_checkpointing(batches)
        acc.load_state(tmp_path / "b")
        same(head + record(batches), ref)


def test_every_case_runs_on_every_path():
    """The contract's cases (docs/guide/resume-contract.md links each) all take the ``path`` parameter."""
    cases = [name for name, fn in globals().items() if name.startswith("test_") and hasattr(fn, "pytestmark")]
    assert len(cases) == 14  # Lightning and Accelerate: one point, two cases
    for name in cases:
        marks = [m for m in globals()[name].pytestmark if m.name == "parametrize"]
        assert marks and list(marks[0].args[1]) == list(PATHS), name
