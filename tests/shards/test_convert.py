"""The conversion engine: sizes and their estimates, options, planning, image checks and resizing,
its worker pool."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

import fastdata.shards.convert as _convert_mod
from fastdata.shards._images import BadImage, check_image, resize_center_crop
from fastdata.shards._sources import SourceError, list_source
from fastdata.shards.convert import (ConversionError, ConvertOptions, DEFAULT_SHARD_SIZE, convert, parse_size,
                                     plan_conversion)
from tests.helpers.images import jpeg
from tests.helpers.sources import image_folder, opts, pattern_png, small_tar


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


def test_shard_size_counts_the_pax_headers_of_non_ascii_names(tmp_path):
    """Non-ASCII names get a PAX header (1 KiB more per member): the estimate left it out, so
    ``--shard-size 32KiB`` gave 60 KiB shards for a folder with umlauts in its file names."""
    src = tmp_path / "src"
    for i in range(40):
        path = src / "klasse_ä" / f"bild_{i:03d}_ü.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pattern_png(i))
    limit = 32 << 10
    manifest = convert(src, tmp_path / "out", opts(shard_size=limit)).manifest
    assert manifest.num_samples == 40 and len(manifest.shards) > 1
    # each shard's content (before the end-of-archive record padding) fits the target
    assert all(s.bytes - 10240 <= limit for s in manifest.shards), [s.bytes for s in manifest.shards]


@pytest.mark.parametrize("name", ["a.jpg", "ünï/a.jpg", "a" * 100, "a" * 101, "a" * 495, "ü" * 300,
                                  "a\udcff.jpg", "x/" * 300 + "é.png"], ids=lambda n: f"{len(n)}chars")
def test_member_bytes_is_what_the_writer_writes(name):
    from fastdata.shards import _tarfmt
    from fastdata.shards._tarfmt import member_bytes

    for size in (0, 1, 512, 513):
        assert member_bytes(name, size) == len(_tarfmt.member_header(name, size)) + size + _tarfmt.pad(size)


_REAL_POOL_JOB = _convert_mod._pool_job  # captured at import: in a spawned worker too, which re-imports this module
_REAL_WRITE_JOB = _convert_mod._write_job


def _die_on_shard_one(task, tick):
    if task.job.number == 1:
        os._exit(9)  # as the OOM killer would
    return _REAL_WRITE_JOB(task, tick)


def _pool_job_that_dies_on_shard_one(task):
    """Runs in the conversion worker (reached by name, so under fork and spawn alike): that process's
    ``_write_job`` dies on shard 1 after the job announced its start."""
    _convert_mod._write_job = _die_on_shard_one
    return _REAL_POOL_JOB(task)


@pytest.mark.parametrize("start", ["chosen", "spawn"])
def test_a_worker_that_dies_is_a_conversion_error_naming_its_shard(tmp_path, monkeypatch, start):
    """Before: "BrokenProcessPool: A process in the process pool was terminated abruptly while the
    future was running or pending", naming no shard and no DEST."""
    import multiprocessing

    monkeypatch.setattr(_convert_mod, "_pool_job", _pool_job_that_dies_on_shard_one)
    if start == "spawn":  # "chosen": fork when the test process has no other thread, else spawn
        monkeypatch.setattr(_convert_mod, "_mp_context", lambda: multiprocessing.get_context("spawn"))
    with pytest.raises(ConversionError, match=r"worker process died .*shard-000001\.tar.* into DEST .*out.*rerun"):
        convert(image_folder(tmp_path / "src"), tmp_path / "out",
                ConvertOptions(samples_per_shard=2, workers=2, progress=False))


def test_hdf5_shard_size_is_estimated_without_tar_headers(tmp_path):
    """--format hdf5 --shard-size counted every value as a tar member (512-byte header, padding to
    512 bytes): rows of 256 bytes gave shards 6x smaller than asked, and 6x as many of them."""
    from fastdata import Manifest

    src = tmp_path / "v.npz"
    np.savez(src, x=np.ones((2000, 64), np.float32), y=np.arange(2000))  # 264 data bytes per row
    target = 128 << 10
    convert(src, tmp_path / "h5", opts(format="hdf5", shard_size=target))
    shards = Manifest.load(tmp_path / "h5").shards
    assert all(s.bytes <= target for s in shards)
    assert len(shards) <= 6  # 2000 rows * ~330 bytes stored = 660 KB: 6 shards at most, 32 before
    assert min(s.bytes for s in shards[:-1]) >= target // 2


def test_hdf5_shard_size_of_a_tar_source(tmp_path):
    from fastdata import Manifest

    src = small_tar(tmp_path / "s.tar", [f"k{i:04d}" for i in range(400)])
    target = 16 << 10
    convert(src, tmp_path / "h5", opts(format="hdf5", shard_size=target))
    shards = Manifest.load(tmp_path / "h5").shards
    assert all(s.bytes <= target for s in shards) and len(shards) <= 12  # 58 before


def test_shard_resize_reads_wide_greyscale_as_the_decoder_does():
    # `fastdata shard --resize` converted a 16-bit greyscale PNG with Pillow's convert("RGB"), which clips at
    # 255: a nearly white image, where the decoder (and torchvision's to_dtype) keep the high byte
    from fastdata.decode import ImageDecoder
    from fastdata.shards._images import BadImage, resize_center_crop

    def encoded(a: np.ndarray, fmt: str) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format=fmt)
        return buf.getvalue()

    photo = encoded(np.full((8, 8), 40000, np.uint16), "PNG")
    assert (resize_center_crop(photo, 4, field="png") == 40000 >> 8).all()
    assert (ImageDecoder()(photo) == 40000 >> 8).all()
    mask = encoded(np.full((8, 8), 7, np.uint16), "PNG")  # 16-bit labels up to 255 keep their values
    assert (resize_center_crop(mask, 4, field="png") == 7).all()
    assert (resize_center_crop(encoded(np.full((8, 8), 9.0, np.float32), "TIFF"), 4, field="tif") == 9).all()
    with pytest.raises(BadImage, match="mode F.*not integers in 0..255"):  # a depth map in [0, 1]: no uint8 holds it
        resize_center_crop(encoded(np.full((8, 8), 0.5, np.float32), "TIFF"), 4, field="tif")


class _FakeRay:
    """Just enough of ``ray`` for ``fastdata.shards._ray.execute``: tasks run at ``.remote()``."""

    class exceptions:
        class RayTaskError(Exception):
            pass

    def __init__(self, initialized: bool):
        self.initialized, self.calls = initialized, []

    def is_initialized(self):
        return self.initialized

    def init(self, **kw):
        self.calls.append("init")
        self.initialized = True

    def shutdown(self):
        self.calls.append("shutdown")
        self.initialized = False

    def cluster_resources(self):
        return {"CPU": 1}

    def remote(self, **kw):
        class Remote:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                return ("ref", self.fn(*args))
        return Remote

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref[1]

    def cancel(self, ref, force=False):
        pass


@pytest.mark.parametrize("initialized", [False, True])
def test_ray_started_by_a_conversion_is_shut_down_by_it(monkeypatch, initialized):
    """A Ray instance `--engine ray` started was left to Ray's atexit hook: a Ctrl-C landing there
    printed a traceback after the summary line and left Ray's agents orphaned. One the caller
    initialised is left running."""
    from fastdata.shards import _ray

    fake = _FakeRay(initialized)
    monkeypatch.setattr(_ray, "_ray", lambda: fake)
    out = list(_ray.execute([1, 2, 3], lambda task, tick: task * 10, workers=2, tick=lambda n: None, size=lambda t: 1))
    assert sorted(out) == [10, 20, 30]
    assert fake.calls == ([] if initialized else ["init", "shutdown"])
    fake.initialized = initialized

    def fail(task, tick):
        raise ValueError("bad shard")

    with pytest.raises(ValueError, match="bad shard"):  # an error ends it too
        list(_ray.execute([1], fail, workers=1, tick=lambda n: None, size=lambda t: 1))
    assert fake.initialized == initialized


def test_convert_from_a_script_without_a_main_guard_says_why_its_spawned_workers_died(tmp_path):
    """convert() spawns its workers when the calling process runs another thread (a forked copy of such a
    process can deadlock); spawned workers import the calling script again, and an unguarded script
    calls convert() in each of them. That was reported as "a worker process died (killed, out of
    memory?) while writing a shard" though no shard was started and nothing was killed."""
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.png").write_bytes(jpeg(i, 4, 4, format="PNG"))
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import threading, time\n"
        "from fastdata.shards.convert import ConvertOptions, convert\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # tqdm's monitor, a logger...\n"
        f"convert({str(src)!r}, {str(tmp_path / 'out')!r}, ConvertOptions(samples_per_shard=1, workers=2, "
        "progress=False))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert "ConversionError" in last and "if __name__ ==" in last and "spawn" in last, run.stderr[-2000:]
    assert "out of memory" not in last
