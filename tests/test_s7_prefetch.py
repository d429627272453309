"""Session 7, helper prefetch2: CUDAPrefetcher and the GPU stage's CPU path used as a demanding user would."""
from __future__ import annotations

import json

import pytest
import torch

from tests.test_prefetch import fake_cuda  # noqa: F401  (fixture: CUDA faked on the CPU)

from fastdata.prefetch import CUDAPrefetcher


@pytest.fixture
def loader_factory(tmp_path):
    from fastdata.dataset import ShardedDataset
    from fastdata.loader import DataLoader
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=6) as w:
        for i in range(12):
            w.write({"__key__": f"s{i:04d}", "cls": str(i).encode()})

    def make() -> DataLoader:
        return DataLoader(ShardedDataset(tmp_path / "ds"), batch_size=3)

    return make


def _ids(batch) -> list[int]:
    return [int(i) for i in batch["cls"]]


def test_state_dict_between_iter_and_the_first_batch_is_the_new_epochs_start(loader_factory):
    """Before: ``state_dict()`` right after ``iter(P)`` returned None (and, after a break, the stale state of
    the abandoned epoch, whose resume skipped batches of the epoch the consumer had just begun)."""
    make = loader_factory
    full = [_ids(b) for b in make()]
    with CUDAPrefetcher(make(), device="cpu") as P:
        it = iter(P)
        state = P.state_dict()
        assert state is not None and state["batches"] == 0
        next(it)
        it.close()  # a break after one batch
        it = iter(P)  # a new epoch, from its first batch, as a plain loop's iter() gives
        state = json.loads(json.dumps(P.state_dict()))
        assert state["batches"] == 0
        assert [_ids(b) for b in it] == full
    resumed = make()
    resumed.load_state_dict(state)
    assert [_ids(b) for b in resumed] == full  # resuming there replays the whole epoch, as the loop did


def test_reset_stats_keeps_the_queued_bytes_gauge(fake_cuda):
    """``queued_bytes`` (device bytes staged, not yet handed over) is a memory figure, not a counter: before,
    ``reset_stats()`` while batches were staged zeroed it, and it read negative for the rest of the run."""
    import time

    batches = [torch.full((1000,), i, dtype=torch.uint8) for i in range(8)]
    # seamless=False: a seamless prefetcher may stage the next epoch's first batches before the last
    # loop below ends, and queued_bytes then rightly reads 1000 or 2000 there (a race, seen once in 50)
    with CUDAPrefetcher(batches, device="cuda", depth=2, seamless=False) as pf:
        it = iter(pf)
        next(it)
        deadline = time.monotonic() + 10
        while pf.stats()["queued_bytes"] < 2000 and time.monotonic() < deadline:  # depth batches staged ahead
            time.sleep(0.01)
        queued = pf.stats()["queued_bytes"]
        assert queued == 2000
        pf.reset_stats()
        s = pf.stats()
        assert s["batches"] == 0 and s["bytes"] == 0 and s["queued_bytes"] == queued
        assert sum(1 for _ in it) == 7
        s = pf.stats()
        assert s["batches"] == 7 and s["queued_bytes"] == 0


def test_decode_ahead_state_after_a_new_iter_is_the_new_epochs_start(loader_factory):
    """``DecodeImages.ahead(loader).state_dict()`` after ``iter()`` is the loader's (a new epoch's start), as
    without the wrapper. Before: the state of the batch last yielded by the abandoned iteration, which the
    prefetcher also took as the new epoch's start state (a resume from it skipped batches)."""
    from fastdata import gpu

    make = loader_factory
    full = [_ids(b) for b in make()]
    ahead = gpu.DecodeImages(device="cpu").ahead(make())
    it = iter(ahead)
    next(it), next(it)
    assert ahead.state_dict()["batches"] == 2
    it = iter(ahead)
    assert ahead.state_dict()["batches"] == 0
    assert [_ids(b) for b in it] == full
    with CUDAPrefetcher(gpu.DecodeImages(device="cpu").ahead(make()), device="cpu") as P:
        it = iter(P)
        next(it), next(it)
        it.close()
        it = iter(P)
        assert P.state_dict()["batches"] == 0
        assert [_ids(b) for b in it] == full


@pytest.mark.parametrize("channel_dim", [3, -4])
def test_normalize_with_a_channel_dim_beyond_a_masks_dims_leaves_the_mask_alone(channel_dim):
    """``Normalize(channel_dim=3)`` (NHWC images given by a positive index) over a batch that also holds
    (N, H, W) uint8 masks: before, a bare ``IndexError: tuple index out of range`` from the mask."""
    from fastdata import gpu

    if channel_dim == 3:
        img = torch.randint(0, 256, (2, 5, 6, 3), dtype=torch.uint8)
    else:
        img = torch.randint(0, 256, (3, 2, 5, 6), dtype=torch.uint8)  # channels first of a 4-D batch
    mask = torch.randint(0, 3, (2, 5, 6), dtype=torch.uint8)
    norm = gpu.Normalize(channel_dim=channel_dim)
    out = norm({"img": img, "mask": mask})
    assert out["img"].dtype == torch.float32 and out["mask"] is mask
    assert torch.allclose(out["img"], norm.apply(img))


@pytest.mark.parametrize("keys", [5.0, [1.5], True, [], [None], object()])
def test_decode_images_keys_are_checked_when_built(keys):
    """Before: a float or an object failed with a bare ``TypeError: 'float' object is not iterable``, and
    ``[1.5]``, ``True`` (matching index 1), ``[]`` and ``[None]`` were accepted."""
    from fastdata import gpu

    with pytest.raises(ValueError, match="DecodeImages: keys must be"):
        gpu.DecodeImages(keys=keys, device="cpu")
    assert gpu.DecodeImages(keys="jpg", device="cpu").keys == frozenset({"jpg"})
    assert gpu.DecodeImages(keys=["jpg", 0], device="cpu").keys == frozenset({"jpg", 0})


@pytest.mark.parametrize("shape", [(2, 3, 0, 5), (2, 3, 5, 0)])
def test_an_image_batch_of_empty_images_is_refused(shape):
    """Before: RandomResizedCrop and CenterCrop turned a 0-pixel image into a black one with a NumPy
    divide-by-zero warning, and Resize failed deep in torch ('SymIntArrayRef expected to contain only concrete
    integers')."""
    from fastdata import gpu

    with pytest.raises(ValueError, match=r"ImageBatch: image 0 is empty: shape \(3, "):
        gpu.ImageBatch.from_tensor(torch.zeros(shape, dtype=torch.uint8), [0, 1], 0)
    assert len(gpu.ImageBatch.from_tensor(torch.zeros((0, 3, 4, 4), dtype=torch.uint8), [], 0)) == 0


def test_keys_given_as_bytes_are_refused():
    """``keep_on_host=b"meta"`` (and ``keys=b"img"`` of the transforms and DecodeImages) was read as the
    integer keys (109, 101, 116, 97): indices, silently matching nothing the user meant."""
    from fastdata import gpu

    with pytest.raises(ValueError, match="keep_on_host must be a key or a sequence of keys"):
        CUDAPrefetcher([], device="cpu", keep_on_host=b"meta")
    for make in (gpu.Normalize, gpu.ToDtype, gpu.ChannelsLast, gpu.DecodeImages):
        with pytest.raises(ValueError, match="keys must be None, a key or a sequence of keys"):
            make(keys=bytearray(b"img"))


@pytest.mark.parametrize("wrap", [lambda ib: ("tag", ib), lambda ib: [3, ib], lambda ib: {"x": ["a", ib]}])
def test_images_of_several_sizes_behind_a_string_are_not_passed_on_silently(wrap):
    """Normalize/ToDtype/ChannelsLast refuse images left in an ImageBatch of several sizes (module docstring).
    Before: in a list or tuple whose first item was a str, int or float, the ImageBatch passed through
    untouched (uint8, unnormalised, not even a tensor)."""
    from fastdata import gpu

    ib = gpu.ImageBatch([torch.zeros((3, 4, 5), dtype=torch.uint8), torch.zeros((3, 6, 5), dtype=torch.uint8)],
                        [0, 1], 0)
    for t in (gpu.Normalize(), gpu.ToDtype(torch.float32), gpu.ChannelsLast()):
        with pytest.raises(ValueError, match="holds images of different sizes"):
            gpu.Compose(t)(wrap(ib))


def test_images_packed_in_a_dataclass_or_another_mapping_are_not_passed_on_undecoded():
    """Before: ``DecodeImages`` found packed images in dicts, lists and tuples only, so a dataclass batch
    (a typed collate_fn) or a UserDict went through ``Compose(DecodeImages(), Normalize())`` untouched: the
    model got the encoded PackedImages without a word."""
    import collections
    import dataclasses

    from tests.helpers.images import jpeg, packed

    from fastdata import gpu

    @dataclasses.dataclass
    class Batch:
        jpg: object
        cls: torch.Tensor

    pipe = gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.Normalize())
    with pytest.raises(ValueError, match=r"packed images at 'jpg' sit in a Batch; .* dicts, lists and tuples"):
        pipe(Batch(packed([jpeg(0), jpeg(1)]), torch.arange(2)))
    with pytest.raises(ValueError, match=r"packed images at 'x.jpg' sit in a UserDict"):
        pipe({"x": collections.UserDict(jpg=packed([jpeg(0)]))})
    plain = Batch(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.arange(2))  # nothing packed: as before
    assert pipe(plain).jpg.dtype == torch.float32
