"""Unit tests of the conversion engine: sizes, options, planning, image checks and resizing."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fastdata.shards._images import BadImage, check_image, resize_center_crop
from fastdata.shards._sources import SourceError, list_source
from fastdata.shards.convert import (
    DEFAULT_SHARD_SIZE, ConversionError, ConvertOptions, convert, parse_size, plan_conversion,
)


@pytest.mark.parametrize("text, value", [
    ("256MB", 256_000_000), ("256mb", 256_000_000), ("1GiB", 1 << 30), ("1.5G", 1_500_000_000),
    ("1000000", 1_000_000), ("64KiB", 65536), ("2k", 2000), (" 3 MiB ", 3 << 20), ("10B", 10), (7, 7),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-1MB", "0", "1iB", "1.2.3G", "0.1B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("kwargs, message", [
    ({"format": "zip"}, "format must be 'tar' or 'hdf5', got 'zip'"),
    ({"workers": 0}, "workers must be None or an int >= 1, got 0"),
    ({"samples_per_shard": -3}, "samples_per_shard must be None or an int >= 1, got -3"),
    ({"resize": 2.5}, "resize must be None or an int >= 1, got 2.5"),
    ({"seed": -1}, "seed must be an int >= 0, got -1"),
    ({"check": "deep"}, "check must be one of"),
])
def test_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConvertOptions(**kwargs)


def test_default_shard_size_applies_only_without_samples_per_shard():
    assert ConvertOptions().max_bytes == DEFAULT_SHARD_SIZE
    assert ConvertOptions(samples_per_shard=10).max_bytes is None
    assert ConvertOptions(samples_per_shard=10, shard_size=5000).max_bytes == 5000


def png(i: int, size=(12, 10)) -> bytes:
    arr = (np.arange(size[0] * size[1] * 3).reshape(size[1], size[0], 3) * (i + 1)) % 256
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def make_folder(root, sizes):
    """Class folders a, b with files of the given byte sizes (not images: planning only)."""
    for i, size in enumerate(sizes):
        path = root / ("a" if i % 2 == 0 else "b") / f"f{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(size))
    return root


def test_plan_is_sorted_and_cut_by_samples(tmp_path):
    src = make_folder(tmp_path / "src", [100] * 10)
    plan = plan_conversion(src, ConvertOptions(samples_per_shard=4))
    assert [len(j.items) for j in plan.jobs] == [4, 4, 2]
    assert [j.name for j in plan.jobs] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    keys = [k for j in plan.jobs for k, _ in j.items]
    assert keys == sorted(keys) and keys[0] == "a/f000" and keys[-1] == "b/f009"
    assert plan.fingerprint == plan_conversion(src, ConvertOptions(samples_per_shard=4, workers=3)).fingerprint
    assert plan.fingerprint != plan_conversion(src, ConvertOptions(samples_per_shard=5)).fingerprint
    assert plan_conversion(src, ConvertOptions(samples_per_shard=4, format="hdf5")).jobs[0].name == "shard-000000.h5"


def test_plan_cuts_by_estimated_bytes(tmp_path):
    # each sample: 512 + 1024 (padded data) + 1024 (cls member) = 2560 bytes; archive end 1024
    src = make_folder(tmp_path / "src", [1000] * 6 + [50_000] + [1000] * 3)
    plan = plan_conversion(src, ConvertOptions(shard_size=2560 * 3 + 1024))
    sizes = [len(j.items) for j in plan.jobs]
    assert sum(sizes) == 10 and max(sizes) == 3
    big = [j for j in plan.jobs if any(k == "a/f006" for k, _ in j.items)]
    assert len(big[0].items) == 1  # an oversized sample gets a shard of its own


def test_plan_with_resize_estimates_the_array_size(tmp_path):
    src = make_folder(tmp_path / "src", [50_000] * 8)
    plan = plan_conversion(src, ConvertOptions(resize=8, shard_size=10_000))
    assert len(plan.jobs) == 2  # 8x8x3 arrays are tiny, unlike the 50 kB inputs
    assert {f.name: f.shape for f in plan.fields} == {"cls": None, "img.npy": (3, 8, 8)}


def test_shuffle_permutes_deterministically(tmp_path):
    src = make_folder(tmp_path / "src", [10] * 20)
    keys = [[k for j in plan_conversion(src, ConvertOptions(shuffle=True, seed=s)).jobs for k, _ in j.items]
            for s in (3, 3, 4)]
    assert keys[0] == keys[1] != keys[2] and sorted(keys[0]) == sorted(keys[2])


def test_flat_folder_gives_unlabelled_samples(tmp_path):
    (tmp_path / "flat").mkdir()
    for i in range(3):
        (tmp_path / "flat" / f"x{i}.PNG").write_bytes(png(i))
    listing = list_source(tmp_path / "flat")
    assert listing.keys == ["x0", "x1", "x2"] and [f.name for f in listing.fields] == ["png"]
    manifest = convert(tmp_path / "flat", tmp_path / "out", ConvertOptions(workers=1, progress=False)).manifest
    assert manifest.num_samples == 3 and [f.name for f in manifest.fields] == ["png"]


def test_hdf5_refuses_mixed_image_types(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.png").write_bytes(png(0))
    (tmp_path / "src" / "a" / "y.jpg").write_bytes(png(1))
    with pytest.raises(ConversionError, match=r"--format hdf5 needs the same fields in every sample.*\['jpg', 'png'\]"):
        plan_conversion(tmp_path / "src", ConvertOptions(format="hdf5"))
    with pytest.raises(ConversionError, match="--resize: SRC .* has no image field"):
        np.savez(tmp_path / "a.npz", x=np.zeros(3))
        plan_conversion(tmp_path / "a.npz", ConvertOptions(resize=4))


def test_unsupported_sources(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(SourceError, match=r"x.csv: unsupported file type"):
        list_source(tmp_path / "x.csv")
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "s.tar.gz").write_bytes(b"")
    with pytest.raises(SourceError, match=r"compressed tar shards \(s.tar.gz\) are not supported"):
        list_source(tmp_path / "gz")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.tar").write_bytes(b"")
    (tmp_path / "mixed" / "b.h5").write_bytes(b"")
    with pytest.raises(SourceError, match=r"holds both tar \(a.tar\) and HDF5 \(b.h5\) shards"):
        list_source(tmp_path / "mixed")
    np.savez(tmp_path / "o.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(SourceError, match=r"not a readable .npz|dtype object"):
        list_source(tmp_path / "o.npz")


def test_check_image_levels():
    good = png(1, size=(64, 48))
    check_image(good)
    check_image(good, check="full")
    with pytest.raises(BadImage, match="not a recognised image format"):
        check_image(b"\x89PNG but not really")
    broken = bytearray(good)
    broken[60] ^= 0xFF  # inside the first chunk: the CRC check of verify() catches it
    with pytest.raises(BadImage, match="SyntaxError|OSError|ValueError"):
        check_image(bytes(broken))


def reference_resize(img: Image.Image, size: int) -> np.ndarray:
    """Resize the shorter side to ``size`` and centre-crop (the slow, obvious way)."""
    w, h = img.size
    scale = size / min(w, h)
    big = img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BILINEAR)
    left, top = (big.width - size) // 2, (big.height - size) // 2
    return np.asarray(big.crop((left, top, left + size, top + size))).transpose(2, 0, 1)


@pytest.mark.parametrize("shape", [(120, 80), (80, 120), (64, 64), (500, 300)])
def test_resize_center_crop_matches_the_slow_way(shape):
    yy, xx = np.mgrid[0:shape[1], 0:shape[0]]
    arr = np.stack([xx * 255 // shape[0], yy * 255 // shape[1], (xx + yy) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    out = resize_center_crop(buf.getvalue(), 32)
    assert out.shape == (3, 32, 32) and out.dtype == np.uint8 and out.flags.c_contiguous
    ref = reference_resize(Image.fromarray(arr), 32)
    # the reference crops at whole output pixels (up to half a pixel off centre): gradients differ a little
    assert np.abs(out.astype(int) - ref.astype(int)).mean() < 6


def test_resize_uses_draft_for_large_jpegs_and_handles_modes():
    rng = np.random.default_rng(0)
    big = Image.fromarray(rng.integers(0, 255, (400, 600, 3), dtype=np.uint8).repeat(1, 0))
    buf = io.BytesIO()
    big.save(buf, format="JPEG", quality=90)
    out = resize_center_crop(buf.getvalue(), 64)
    assert out.shape == (3, 64, 64)
    for mode in ("L", "RGBA", "P", "I;16"):
        img = Image.new(mode, (30, 20))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        assert resize_center_crop(buf.getvalue(), 8).shape == (3, 8, 8)
    with pytest.raises(BadImage):
        resize_center_crop(b"nope", 8)


def test_progress_bar_reports_samples_per_second(tmp_path, capsys):
    (tmp_path / "src" / "a").mkdir(parents=True)
    for i in range(5):
        (tmp_path / "src" / "a" / f"{i}.png").write_bytes(png(i))
    convert(tmp_path / "src", tmp_path / "out", ConvertOptions(workers=1, progress=True))
    err = capsys.readouterr().err
    assert "5/5" in err and "samples/s" in err

