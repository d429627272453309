"""What keys a preprocessing store: the image fields read, the decoders and the transform's
arguments; a change of any gives another store."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
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
