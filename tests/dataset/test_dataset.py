"""ShardedDataset end to end: sources, splitting through real DataLoaders, epochs, errors, cache."""
from __future__ import annotations

import errno
import io
import os
import re
import tarfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fastdata.cli._synth import jpeg_bytes, synth_image
from fastdata.dataset import ShardedDataset, ShuffleOptions, SkippedSampleWarning
from fastdata.errors import CacheError, DecodeError, ShardError
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import Deterministic, ResizeCenterCrop
from tests.helpers.shards import make_shards


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["cls"]]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("ds") / "ds", 23, 5, key="k/{i:05d}", txt=True)  # 5 shards: 5,5,5,5,3


def test_plain_iteration_and_len(shards):
    ds = ShardedDataset(shards)
    assert len(ds) == 23 and ds.num_samples == 23
    samples = list(ds)
    assert [s["cls"] for s in samples] == list(range(23))
    assert samples[4] == {"__key__": "k/00004", "cls": 4, "txt": "t4"}


@pytest.mark.parametrize(("world", "workers"), [(1, 2), (2, 2), (3, 3), (4, 2)])  # up to 8 slots for 5 shards
def test_exactly_once_and_equal_batches_through_dataloader(shards, world, workers):
    per_rank = -(-23 // world)
    seen: list[int] = []
    batch_counts = []
    for rank in range(world):
        ds = ShardedDataset(shards, shuffle=True, seed=4, rank=rank, world_size=world)
        dl = DataLoader(ds, batch_size=3, num_workers=workers)
        batches = list(dl)
        assert len(ds) == per_rank and sum(len(b["cls"]) for b in batches) == per_rank
        assert len(batches) == len(dl)
        batch_counts.append(len(batches))
        seen += _ids(batches)
    assert len(set(batch_counts)) == 1
    counts = Counter(seen)
    assert set(counts) == set(range(23)) and sum(counts.values()) == per_rank * world


def test_drop_policy_through_dataloader(shards):
    seen = []
    for rank in range(3):
        ds = ShardedDataset(shards, shuffle=True, rank=rank, world_size=3, even="drop")
        seen += _ids(DataLoader(ds, batch_size=4, num_workers=2))
    assert len(seen) == len(set(seen)) == 21


def test_determinism_and_epochs(shards):
    def order(seed: int, epoch: int) -> list[int]:
        ds = ShardedDataset(shards, shuffle=ShuffleOptions(open_shards=2, buffer_size=4), seed=seed)
        ds.set_epoch(epoch)
        return [s["cls"] for s in ds]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)
    assert sorted(order(1, 3)) == list(range(23))


def test_set_epoch_reaches_persistent_workers(shards):
    ds = ShardedDataset(shards, shuffle=True, seed=3)
    dl = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(3):
        dl.set_epoch(epoch)
        epochs.append(_ids(dl))
    fresh = ShardedDataset(shards, shuffle=True, seed=3)
    fresh.set_epoch(2)
    assert epochs[2] == _ids(DataLoader(fresh, batch_size=4, num_workers=2))
    assert epochs[0] != epochs[1] and sorted(epochs[1]) == list(range(23))


def test_samples_per_epoch(shards):
    ds = ShardedDataset(shards, shuffle=True, samples_per_epoch=10)
    seen = []
    for epoch in range(7):  # 70 = 3 passes + 1
        ds.set_epoch(epoch)
        got = [s["cls"] for s in ds]
        assert len(got) == len(ds) == 10
        seen += got
    counts = Counter(seen)  # 3 whole passes (each sample once per pass) and 1 sample of the 4th
    assert set(counts) == set(range(23)) and sorted(counts.values()) == [3] * 22 + [4]


def test_manifest_less_tar_paths_and_brace_patterns(shards):
    names = sorted(p.name for p in shards.glob("*.tar"))
    pattern = str(shards / "shard-{000000..000004}.tar")
    by_list = ShardedDataset([shards / n for n in names])
    by_pattern = ShardedDataset(pattern)
    assert len(by_list) == len(by_pattern) == 23
    assert [s["cls"] for s in by_pattern] == list(range(23))
    assert by_pattern.source.fingerprint.startswith("files:")
    # foreign tar without sidecar index (header scan), written by Python's tarfile
    foreign = shards.parent / "foreign.tar"
    with tarfile.open(foreign, "w") as tf:
        for i in range(3):
            for ext, data in (("cls", str(i).encode()), ("txt", b"x")):
                info = tarfile.TarInfo(f"dir/s{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    assert [(s["__key__"], s["cls"]) for s in ShardedDataset(str(foreign))] == [
        ("dir/s0", 0), ("dir/s1", 1), ("dir/s2", 2)]


def test_hdf5_source(tmp_path):
    pytest.importorskip("h5py")
    with ShardWriter(tmp_path / "h5", format="hdf5", max_samples=5) as w:
        for i in range(12):
            w.write({"__key__": f"k/{i:05d}", "cls": i, "txt": "t" * (i + 1),
                     "img.npy": np.full((3, 2, 2), i, dtype=np.uint8)})
    ds = ShardedDataset(tmp_path / "h5", shuffle=True)
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(s["cls"] for s in got) == list(range(12))
    s = next(x for x in got if x["cls"] == 5)
    assert s["txt"] == "t" * 6 and int(s["img.npy"][0, 0, 0]) == 5


def test_streaming_url_source(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    make_shards(tmp_path / "s", 12, 3, key="k/{i:05d}", txt=True)
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted((tmp_path / "s").glob("*.tar")):
        fs.pipe(f"/fastdata-test/{p.name}", p.read_bytes())
        urls.append(f"memory://fastdata-test/{p.name}")
    ds = ShardedDataset(urls, shuffle=True, seed=1)
    assert sorted(s["cls"] for s in ds) == list(range(12))
    with pytest.raises(TypeError, match="samples_per_epoch"):
        len(ds)
    with pytest.raises(ValueError, match="samples_per_epoch must be an int >= 1 or None, got 0"):
        ShardedDataset(urls, samples_per_epoch=0)
    fixed = ShardedDataset(urls, samples_per_epoch=8, rank=1, world_size=2)
    assert len(fixed) == 4 and len(list(fixed)) == 4


def test_transforms_and_draft(tmp_path):
    with ShardWriter(tmp_path / "img", max_samples=4) as w:
        for i in range(6):
            img = synth_image(np.random.default_rng(i), 560 + i, 530)
            w.write({"__key__": f"i{i}", "jpg": jpeg_bytes(img, 85), "cls": i})
    flips = []
    ds = ShardedDataset(
        tmp_path / "img", preprocess=ResizeCenterCrop(64), transform=lambda x: flips.append(1) or x.flip(-1),
        sample_transform=lambda s: (s["jpg"], s["cls"]),
    )
    assert ds._samples.decoder.image.draft_size == 73 and ds._samples.decoder.images_as_pil
    x, y = next(iter(ds))
    assert x.shape == (3, 64, 64) and x.dtype == torch.uint8 and y == 0 and flips
    xb, yb = next(iter(DataLoader(ds, batch_size=3, num_workers=0)))
    assert xb.shape == (3, 3, 64, 64) and yb.tolist() == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["indexed", "streaming"])
def test_transform_that_accepts_pil_gets_pil_without_preprocess(tmp_path, stream):
    """The first image transform gets PIL images when it declares accepts_pil: without
    preprocess= that is transform= (it got a tensor converted from the PIL image before)."""
    from PIL import Image

    with ShardWriter(tmp_path / "img", max_samples=2) as w:
        for i in range(4):
            w.write({"__key__": f"i{i}", "jpg": jpeg_bytes(synth_image(np.random.default_rng(i), 80, 60), 90), "cls": i})
    source: Any = tmp_path / "img"
    if stream:
        fsspec = pytest.importorskip("fsspec")
        fs = fsspec.filesystem("memory")
        source = []
        for p in sorted((tmp_path / "img").glob("*.tar")):
            fs.pipe(f"/fastdata-pil/{p.name}", p.read_bytes())
            source.append(f"memory://fastdata-pil/{p.name}")
    seen: list[type] = []

    def record(img: Any) -> Any:
        seen.append(type(img))
        return img

    def images(**kw: Any) -> list[torch.Tensor]:
        seen.clear()
        out = [s["jpg"] for s in ShardedDataset(source, **kw)]
        assert all(isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.shape[0] == 3 for x in out)
        return out

    images(transform=Deterministic(record, version="1", accepts_pil=True))  # a PIL result becomes a tensor
    assert seen and all(issubclass(t, Image.Image) for t in seen)
    images(transform=record)
    assert seen and all(t is torch.Tensor for t in seen)
    images(preprocess=ResizeCenterCrop(32), transform=Deterministic(record, version="1", accepts_pil=True))
    assert seen and all(t is torch.Tensor for t in seen)  # transform= gets preprocess='s output
    assert all(torch.equal(a, b) for a, b in zip(images(transform=ResizeCenterCrop(32)),
                                                  images(preprocess=ResizeCenterCrop(32)), strict=True))


def test_cache_hook(tmp_path):
    pytest.importorskip("fastdata.cache")
    with ShardWriter(tmp_path / "img", max_samples=3) as w:
        for i in range(5):
            w.write({"__key__": f"i{i}", "jpg": jpeg_bytes(synth_image(np.random.default_rng(i), 90, 70), 90),
                     "cls": i})
    calls = []

    def prep(img):
        calls.append(1)
        return ResizeCenterCrop(32)(img)

    make = lambda: ShardedDataset(tmp_path / "img", preprocess=Deterministic(prep, version="1"),  # noqa: E731
                                  cache=tmp_path / "cache")
    first = [(s["cls"], s["jpg"].clone()) for s in make()]
    assert len(calls) == 5
    second = [(s["cls"], s["jpg"].clone()) for s in make()]
    assert len(calls) == 5  # all hits
    assert [c for c, _ in second] == list(range(5))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, second))
    with pytest.raises(ValueError, match="cache= needs preprocess= with a fingerprint"):
        ShardedDataset(tmp_path / "img", preprocess=prep, cache=tmp_path / "cache")


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("bad") / "ds", 12, 4, key="k/{i:05d}", txt=True, bad=(2, 9))


def test_on_error_raise_names_shard_key_reason(bad_shards):
    with pytest.raises(DecodeError, match=r"shard-000000\.tar: sample 'k/00002' field 'cls': ValueError: invalid literal"):
        list(ShardedDataset(bad_shards))


def test_on_error_skip_counts_and_reports(bad_shards):
    ds = ShardedDataset(bad_shards, on_error="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "skip" records silently; only "warn" warns
        got = [s["cls"] for s in ds]
    assert got == [i for i in range(12) if i not in (2, 9)]
    assert [(r["key"], Path(r["shard"]).name) for r in ds.skipped] == [
        ("k/00002", "shard-000000.tar"), ("k/00009", "shard-000002.tar")]
    assert "invalid literal" in ds.skipped[0]["reason"]


def test_on_error_warn(bad_shards):
    ds = ShardedDataset(bad_shards, on_error="warn")
    with pytest.warns(SkippedSampleWarning) as record:
        got = [s["cls"] for s in ds]
    assert len(got) == 10 and len(ds.skipped) == 2
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert re.match(r"skipped sample 'k/00002' of shard .*shard-000000\.tar: .*field 'cls': ValueError", messages[0])


def test_skips_in_workers_reach_the_main_process(bad_shards):
    ds = ShardedDataset(bad_shards, on_error="skip")
    dl = DataLoader(ds, batch_size=2, num_workers=2)
    assert sorted(_ids(dl)) == [i for i in range(12) if i not in (2, 9)]
    assert sorted(r["key"] for r in ds.skipped) == ["k/00002", "k/00009"]


class _FailingReader:
    """A shard reader whose sample ``bad`` fails with an OSError (an I/O error, not a decode error)."""

    def __init__(self, reader, bad: int):
        self.reader, self.bad = reader, bad
        self.keys = reader.keys

    def read(self, i, fields=None):
        if i == self.bad:
            raise OSError(errno.EIO, "Input/output error")
        return self.reader.read(i, fields=fields)

    def close(self):
        self.reader.close()


def test_io_errors_name_shard_and_key(shards):
    ds = ShardedDataset(shards)
    real = ds.source._opener
    ds.source._opener = lambda i: _FailingReader(real(i), bad=2 if i == 1 else -1)
    with pytest.raises(ShardError, match=r"shard-000001\.tar: sample 'k/00007' \(#2\): OSError: .*Input/output error"):
        list(ds)
    ds.on_error = "skip"
    assert [s["cls"] for s in ds] == [i for i in range(23) if i != 7]
    assert [(r["key"], r["index"]) for r in ds.skipped] == [("k/00007", 7)]


def test_cache_failure_is_not_skipped_as_a_bad_sample(tmp_path, monkeypatch):
    with ShardWriter(tmp_path / "img", max_samples=3) as w:
        for i in range(4):
            w.write({"__key__": f"i{i}", "jpg": jpeg_bytes(synth_image(np.random.default_rng(i), 40, 40), 90),
                     "cls": i})
    ds = ShardedDataset(tmp_path / "img", preprocess=ResizeCenterCrop(16), cache=tmp_path / "cache", on_error="skip")
    it = iter(ds)
    next(it)  # the store's files exist now; the disk fills up

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(CacheError, match="disk full while writing sample 1"):
        next(it)
    assert ds.skipped == []


def test_streaming_skips_name_the_key(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    make_shards(tmp_path / "s", 6, 3, key="k/{i:05d}", txt=True, bad=(4,))
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted((tmp_path / "s").glob("*.tar")):
        fs.pipe(f"/fastdata-skip/{p.name}", p.read_bytes())
        urls.append(f"memory://fastdata-skip/{p.name}")
    ds = ShardedDataset(urls, on_error="skip")
    assert [s["cls"] for s in ds] == [0, 1, 2, 3, 5]
    assert [(r["key"], r["shard"]) for r in ds.skipped] == [("k/00004", urls[1])]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"on_error": "ignore"}, ValueError, r"on_error must be one of \('raise', 'skip', 'warn'\), got 'ignore'"),
        ({"rank": 0}, ValueError, "pass both rank and world_size or neither"),
        ({"rank": 2, "world_size": 2}, ValueError, r"rank must be in \[0, world_size=2\), got 2"),
        ({"even": "wrap"}, ValueError, "even must be one of"),
        ({"shuffle": "yes"}, TypeError, "shuffle must be a bool or ShuffleOptions"),
        ({"transform": 3}, TypeError, "transform must be callable"),
    ],
)
def test_argument_validation(shards, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ShardedDataset(shards, **kwargs)


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json in this folder"):
        ShardedDataset(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.tar"):
        ShardedDataset([tmp_path / "missing.tar"])
    with pytest.raises(TypeError, match="source must be"):
        ShardedDataset(3)  # type: ignore[arg-type]


def _drop_k2(sample: dict) -> dict | None:
    return None if sample["__key__"] == "k2" else sample


@pytest.mark.parametrize("threads", [0, 2])
def test_a_sample_transform_returning_none_is_an_error_not_a_silent_drop(tmp_path: Path, threads: int) -> None:
    """A sample_transform that returned None dropped the sample on every path, counted nowhere (not in
    skipped, while len() and the per-rank batch counts still included it)."""
    with ShardWriter(tmp_path / "ds", max_samples=4) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "cls": str(i).encode()})
    ds = ShardedDataset(tmp_path / "ds", shuffle=False, sample_transform=_drop_k2)
    loader = DataLoader(ds, batch_size=2, num_workers=2 if threads else 0, decode_threads=threads)
    with pytest.raises(TypeError, match="sample_transform returned None for sample 'k2' of shard .*shard-000000"):
        list(loader)
