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
