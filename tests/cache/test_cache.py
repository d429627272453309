"""The Cache and build_cache: datasets served from a store bit for bit, the cache folder, sizes,
builds in workers and in process."""
from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import fastdata
from fastdata.cache import Cache, Store
from fastdata.errors import CacheError
from fastdata.transforms import ResizeCenterCrop
from tests.helpers.images import jpeg
from tests.helpers.shards import make_shards
from tests.helpers.stores import cached_samples, check_store, expected, photo_shards, same_samples


class _StoreDataset(torch.utils.data.Dataset):
    def __init__(self, store: Store) -> None:
        self.store = store

    def __len__(self) -> int:
        return self.store.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        got = self.store.get(i)
        if got is None:
            self.store.put(i, expected(i))
            got = self.store.get(i)
        assert got is not None
        return got


def test_store_in_dataloader_workers(tmp_path: Path) -> None:
    store = Cache(tmp_path).open_store(fingerprint="dl", num_samples=40)
    for epoch in range(2):  # epoch 0 fills from two workers, epoch 1 reads
        loader = torch.utils.data.DataLoader(_StoreDataset(store), batch_size=8, num_workers=2,
                                             multiprocessing_context="fork")
        batches = list(loader)
        imgs = torch.cat([b["img"] for b in batches])
        assert torch.equal(imgs, torch.stack([torch.from_numpy(expected(i)["img"]) for i in range(40)]))
    assert store.num_valid() == 40


def test_dataset_cached_equals_uncached_bit_for_bit(tmp_path: Path) -> None:
    pytest.importorskip("fastdata.dataset")
    src = photo_shards(tmp_path / "shards")
    plain = cached_samples(src)
    filling = cached_samples(src, cache=tmp_path / "cache")  # epoch that fills
    (info,) = Cache(tmp_path / "cache").list()
    assert info.fill_ratio == 1.0 and info.fields[0].shape == (3, 32, 32)  # type: ignore[index]
    cached = cached_samples(src, cache=Cache(tmp_path / "cache"), shuffle=True, seed=3)  # served from the store
    assert same_samples(plain, filling)
    assert same_samples(sorted(cached, key=lambda s: s["__key__"]), plain)


def test_dataset_changed_transform_or_shard_misses(tmp_path: Path) -> None:
    pytest.importorskip("fastdata.dataset")
    cache = Cache(tmp_path / "cache")
    src = photo_shards(tmp_path / "shards")
    cached_samples(src, cache=cache)
    assert same_samples(cached_samples(src, cache=cache, size=24), cached_samples(src, size=24))  # new transform parameter
    assert len(cache.list()) == 2
    photo_shards(tmp_path / "shards", changed=5)  # one image differs: new shard checksum, new manifest fingerprint
    fresh = cached_samples(src, cache=cache)
    assert len(cache.list()) == 3
    assert same_samples(fresh, cached_samples(src))
    assert not torch.equal(fresh[5]["jpg"], cached_samples(photo_shards(tmp_path / "old"))[5]["jpg"])


def test_threads_share_one_store(tmp_path: Path) -> None:
    import threading

    n = 200
    store = Cache(tmp_path).open_store(fingerprint="threads", num_samples=n)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        order = list(range(n))
        random.Random(seed).shuffle(order)
        try:
            for i in order:
                got = store.get(i)
                if got is None:
                    store.put(i, expected(i))
                else:
                    assert torch.equal(got["aux"], torch.from_numpy(expected(i)["aux"]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert check_store(store, require_full=True) == n


def test_read_only_cache_serves_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Cache(tmp_path).open_store(fingerprint="ro", num_samples=4)
    for i in range(3):
        store.put(i, expected(i))
    store.close()
    real_open = os.open

    def deny_writes(path: object, flags: int, *args: object) -> int:
        if flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", deny_writes)
    ro = Cache(tmp_path).open_store(fingerprint="ro", num_samples=4)
    assert check_store(ro) == 3 and ro.get(3) is None
    with pytest.raises(CacheError, match="read-only .*cannot fill sample 3"):
        ro.put(3, expected(3))


def test_build_cache_in_process_keeps_the_datasets_resume_state(tmp_path: Path) -> None:
    """build_cache(num_workers=0) iterated the dataset itself: a resume state loaded into it was consumed by
    the build, and the training loop then read the whole epoch again instead of its rest (samples repeated
    silently). With workers the build reads copies, and the state stayed."""
    src = make_shards(tmp_path / "ds", 8, 4, key="k{i:03d}", image=(20, 24), cls="int")

    def loader() -> fastdata.DataLoader:
        ds = fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(8), cache=tmp_path / "c", shuffle=True)
        return fastdata.DataLoader(ds, batch_size=2, num_workers=0)

    ref = [b["__key__"] for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)["__key__"] for _ in range(2)]
    state = first.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    info = resumed.dataset.build_cache(num_workers=0)
    assert info.fill_ratio == 1.0
    assert head + [b["__key__"] for b in resumed] == ref  # the rest of the epoch, not all of it again

    # a state saved right after the build (before training) held the build's position: the end of the epoch
    fresh = loader()
    fresh.dataset.build_cache(num_workers=0)
    again = loader()
    again.load_state_dict(fresh.state_dict())
    assert [b["__key__"] for b in again] == ref  # the whole epoch, not none of it


def test_a_cache_directory_that_is_a_file_is_a_cache_error(tmp_path: Path) -> None:
    """Cache.list()/remove()/evict() over a --cache path that is a file raised a bare NotADirectoryError."""
    from fastdata.cache import Cache

    (tmp_path / "f").write_text("x")
    cache = Cache(tmp_path / "f", max_bytes=10)
    for call in (cache.list, cache.evict, cache.total_bytes, lambda: cache.remove("abc")):
        with pytest.raises(CacheError, match=r"cache directory .*f.*not a directory"):
            call()


def test_a_failed_cache_build_stops_its_workers_without_a_garbage_collection(tmp_path):
    """build_cache over a too-small cache fails in a worker; torch's iterator then sat in a cycle through
    the traceback and its worker was joined only at the next gc.collect(), after a 5 s timeout."""
    import gc
    import multiprocessing as mp

    import numpy as np
    from PIL import Image

    from fastdata import Cache, CacheError, ResizeCenterCrop, ShardedDataset
    from fastdata.shards.writer import ShardWriter
    from fastdata.cli._synth import jpeg_bytes

    with ShardWriter(tmp_path / "s") as w:
        for i in range(4):
            img = Image.fromarray(np.full((40, 40, 3), 60 * i, np.uint8))
            w.write({"__key__": f"k{i}", "jpg": jpeg_bytes(img, 90), "cls": i})
    ds = ShardedDataset(tmp_path / "s", preprocess=ResizeCenterCrop(8), cache=Cache(tmp_path / "c", max_bytes=10))
    gc.disable()
    try:
        with pytest.raises(CacheError):
            ds.build_cache(num_workers=1)
        workers = mp.active_children()  # those still ending
        for w in workers:
            w.join(30)  # a hang guard: with gc off nothing else would stop them
        # ended on their own: not left running, not terminated after torch's 5 s join timeout (SIGTERM)
        assert [w.exitcode for w in workers] == [0] * len(workers) and not mp.active_children()
    finally:
        gc.enable()


def test_a_store_refused_for_its_size_is_not_left_listed(tmp_path):
    from fastdata.cache import Cache
    from fastdata.errors import CacheError

    cache = Cache(tmp_path / "c", max_bytes=10)
    store = cache.open_store(fingerprint="big", num_samples=4)
    with pytest.raises(CacheError, match="does not fit in max_bytes=10"):
        store.put(0, {"img": np.zeros((3, 4, 4), np.uint8)})
    assert [i.fingerprint for i in cache.list()] == ["big"]  # still open here: it stays
    store.close()
    assert cache.list() == [] and not store.path.exists()
    ok = Cache(tmp_path / "c").open_store(fingerprint="big", num_samples=4)  # with room, it is made anew and fills
    ok.put(0, {"img": np.ones((3, 4, 4), np.uint8)})
    ok.close()
    (info,) = Cache(tmp_path / "c").list()
    assert info.num_valid == 1 and "refused" not in (info.path / "meta.json").read_text()


def test_cache_takes_size_strings_as_remote_shards_does(tmp_path):
    assert Cache(tmp_path, max_bytes="500GB").max_bytes == 500_000_000_000
    assert Cache(tmp_path, max_bytes="1GiB").max_bytes == 1 << 30
    assert Cache(tmp_path, max_bytes=2e9).max_bytes == 2_000_000_000
    for bad in ("lots", 1.5, True, 0, "0", -1):
        with pytest.raises(ValueError, match="max_bytes"):
            Cache(tmp_path, max_bytes=bad)


@pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning")  # torch's own hint (recent torch) before fastdata's error
def test_build_cache_with_spawn_workers_names_an_unpicklable_part(tmp_path, monkeypatch):
    import multiprocessing

    import pytest

    import fastdata
    from fastdata.errors import FastdataError

    with fastdata.ShardWriter(tmp_path / "d") as w:
        for i in range(4):
            w.write({"__key__": f"s{i}", "jpg": jpeg(i, 16, 16), "cls": i})
    ds = fastdata.ShardedDataset(tmp_path / "d", preprocess=fastdata.ResizeCenterCrop(4), cache=tmp_path / "c",
                                 decode={"cls": lambda b: int(b)})
    # multiprocessing's default start method made spawn (pickling fails in this process, before a child starts)
    monkeypatch.setattr(multiprocessing.context._default_context, "_actual_context",
                        multiprocessing.get_context("spawn"))
    with pytest.raises(FastdataError, match=r"dataset\.decode\['cls'\] .*cannot be pickled.*num_workers=0"):
        ds.build_cache(num_workers=2)  # it was pickle's bare "Can't pickle <function <lambda>>"
