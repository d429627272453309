"""Session 5 bug hunt in the dataset / loader / cache area: one regression test per defect found."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.dataset import ShardedDataset
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import ResizeCenterCrop


def _image(i: int, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), (i * 29) % 251, np.uint8)).save(out, fmt)
    return out.getvalue()


def _two_image_fields(dest: Path, n: int = 6) -> Path:
    with ShardWriter(dest, max_samples=4) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "jpg": _image(i, "JPEG"), "seg.png": _image(i + 1, "PNG"),
                     "cls": str(i).encode()})
    return dest


def test_cache_store_is_per_selected_image_fields(tmp_path: Path) -> None:
    """A store filled under fields=[one image field] held only that field; a dataset reading every
    field got its hits from that store and silently lost the other image field (and the reverse
    served an unrequested field or failed its fills with a layout mismatch)."""
    src = _two_image_fields(tmp_path / "ds")
    cache, pre = tmp_path / "cache", ResizeCenterCrop(8)
    plain_all = list(ShardedDataset(src, preprocess=pre))
    plain_jpg = list(ShardedDataset(src, fields=["jpg", "cls"], preprocess=pre))
    assert all(set(s) == {"__key__", "jpg", "seg.png", "cls"} for s in plain_all)
    for fields, plain in ((["jpg", "cls"], plain_jpg), (None, plain_all), (["jpg", "cls"], plain_jpg),
                          (["seg.png"], None)):
        for _ in range(2):  # the fill, then the hits
            got = list(ShardedDataset(src, fields=fields, preprocess=pre, cache=cache))
            if plain is None:
                assert all(set(s) == {"__key__", "seg.png"} for s in got)
                continue
            assert [sorted(s) for s in got] == [sorted(s) for s in plain]
            for a, b in zip(got, plain):
                assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _area_8x8(image: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.interpolate(image[None].float(), size=(8, 8), mode="area")[0].to(torch.uint8)


def test_deterministic_target_size_is_part_of_the_cache_key(tmp_path: Path) -> None:
    """Deterministic(target_size=) decodes large JPEGs at a reduced scale, so it changes the output;
    the store was keyed on name and version only and served the full-scale outputs after the change."""
    from fastdata.transforms import Deterministic

    rng = np.random.default_rng(0)
    with ShardWriter(tmp_path / "ds") as w:
        for i in range(3):
            out = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(out, "JPEG")
            w.write({"__key__": f"k{i}", "jpg": out.getvalue()})
    full, small = (Deterministic(_area_8x8, version="1", target_size=t) for t in (None, 8))
    assert full.fingerprint != small.fingerprint
    assert Deterministic(_area_8x8, version="1").fingerprint == "Deterministic(name=_area_8x8,version=1)"  # kept
    list(ShardedDataset(tmp_path / "ds", preprocess=full, cache=tmp_path / "cache"))
    cached = [s["jpg"] for s in ShardedDataset(tmp_path / "ds", preprocess=small, cache=tmp_path / "cache")]
    plain = [s["jpg"] for s in ShardedDataset(tmp_path / "ds", preprocess=small)]
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))


def _keyed(dest: Path, n: int, per_shard: int) -> Path:
    with ShardWriter(dest, max_samples=per_shard) as w:
        for i in range(n):
            w.write({"__key__": f"s{i:04d}", "cls": str(i).encode()})
    return dest


@pytest.mark.parametrize("steps", [2, 99])  # 99: the whole epoch (a checkpoint taken after it)
def test_elastic_resume_with_drop_last_and_less_than_a_round_left(tmp_path: Path, steps: int) -> None:
    """drop_last=True and fewer than new_world x batch_size samples left (none, at the end of an
    epoch): load_state_dict raised ValueError; the README promises floor(R / (W2 B)) = 0 batches."""
    from fastdata.loader import DataLoader

    src = _keyed(tmp_path / "ds", 11, 3)

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


def test_no_torch_length_warning_after_an_epoch_of_another_length(tmp_path: Path) -> None:
    """torch's iterator compares the batches it yields with the sample count of the latest len(loader)
    call; after a len() in a shorter epoch (here an elastic resume with nothing left: 0) it warned at
    every batch of the next epoch ('Length of IterableDataset ... was reported to be 0')."""
    import warnings

    from fastdata.loader import DataLoader

    src = _keyed(tmp_path / "ds", 8, 3)
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


def _inverted(data: bytes) -> Image.Image:
    return Image.eval(Image.open(io.BytesIO(bytes(data))).convert("RGB"), lambda p: 255 - p)


def test_custom_image_decoder_is_part_of_the_cache_key(tmp_path: Path) -> None:
    """decode={"jpg": fn} changes what preprocess= gets; the store was keyed without it and served the
    default decoder's outputs to a dataset with a custom one."""
    src = _two_image_fields(tmp_path / "ds", n=3)
    pre = ResizeCenterCrop(8)
    list(ShardedDataset(src, fields=["jpg"], preprocess=pre, cache=tmp_path / "cache"))  # default decoder
    got = [s["jpg"] for s in ShardedDataset(src, fields=["jpg"], preprocess=pre, cache=tmp_path / "cache",
                                            decode={"jpg": _inverted})]
    plain = [s["jpg"] for s in ShardedDataset(src, fields=["jpg"], preprocess=pre, decode={"jpg": _inverted})]
    assert all(torch.equal(a, b) for a, b in zip(got, plain))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_workers_walk_the_epoch_their_iter_started(tmp_path: Path) -> None:
    """A worker read the epoch from shared memory when it got round to its first walk, after the
    loader's iter() had fixed the epoch (and its resume state): set_epoch right after iter() moved
    late-starting worker processes to the new epoch, unlike every other path."""
    from fastdata.loader import DataLoader

    src = _keyed(tmp_path / "ds", 12, 3)

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

    src = _keyed(tmp_path / "ds", 10, 3)
    dl = DataLoader(ShardedDataset(src, shuffle=True), batch_size=3)
    full = [k for b in dl for k in b["__key__"]]
    it = iter(dl)
    first = list(next(it)["__key__"])
    for state in (dl.state_dict(), [dl.state_dict()]):
        ds = ShardedDataset(src, shuffle=True)
        ds.load_state_dict(state)
        assert first + [s["__key__"] for s in ds] == full


def test_remote_shards_retries_error_names_the_argument() -> None:
    """RemoteShards(retries=RetryPolicy(...)) said 'RetryPolicy.attempts must be an int >= 1'."""
    from fastdata.dataset import RemoteShards
    from fastdata.io import RetryPolicy

    for bad in (RetryPolicy(attempts=3), 0, True):
        with pytest.raises(ValueError, match=r"RemoteShards\.retries must be an int >= 1"):
            RemoteShards("https://example.invalid/ds", retries=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("steps", "drop_last"), [(2, False), (1, True)])
def test_len_of_an_elastic_epoch_is_the_batches_it_yields(tmp_path: Path, steps: int, drop_last: bool) -> None:
    """len(loader) in the rest of an epoch resumed at another world size split len(dataset) evenly
    over the workers, not as the elastic split does: it said 2 batches (or 0) where 1 came."""
    from fastdata.loader import DataLoader

    src = _keyed(tmp_path / "ds", 7, 3)
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


def test_lambda_image_decoders_do_not_share_a_store(tmp_path: Path) -> None:
    """Every lambda is named '<lambda>': keyed by name only, a store filled through one lambda decoder
    was served to a dataset decoding through another (a notebook cell edited and run again)."""
    src = _two_image_fields(tmp_path / "ds", n=3)
    pre = ResizeCenterCrop(8)
    keep = lambda data: Image.open(io.BytesIO(bytes(data))).convert("RGB")  # noqa: E731
    flip = lambda data: _inverted(data)  # noqa: E731
    list(ShardedDataset(src, fields=["jpg"], preprocess=pre, cache=tmp_path / "cache", decode={"jpg": keep}))
    got = [s["jpg"] for s in ShardedDataset(src, fields=["jpg"], preprocess=pre, cache=tmp_path / "cache",
                                            decode={"jpg": flip})]
    plain = [s["jpg"] for s in ShardedDataset(src, fields=["jpg"], preprocess=pre, decode={"jpg": flip})]
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
