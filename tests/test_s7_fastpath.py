"""Session 7 bug hunt in the preprocessing cache, the cached fast path and the thread decoder: one
regression test per defect."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import fastdata
from fastdata.errors import CacheError
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import ResizeCenterCrop


def _tiny_shards(dest: Path, n: int = 8) -> Path:
    from fastdata.cli._synth import jpeg_bytes, synth_image

    with ShardWriter(dest, max_samples=4) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "jpg": jpeg_bytes(synth_image(np.random.default_rng(i), 20, 24), 90),
                     "cls": i})
    return dest


def test_build_cache_in_process_keeps_the_datasets_resume_state(tmp_path: Path) -> None:
    """build_cache(num_workers=0) iterated the dataset itself: a resume state loaded into it was consumed by
    the build, and the training loop then read the whole epoch again instead of its rest (samples repeated
    silently). With workers the build reads copies, and the state stayed."""
    src = _tiny_shards(tmp_path / "ds")

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


def _filled_store(directory: Path, n: int = 4) -> Path:
    from fastdata.cache import Cache

    store = Cache(directory).open_store(fingerprint="fp", num_samples=n)
    for i in range(n):
        store.put(i, {"img": np.full((3, 4, 4), i, np.uint8)})
    store.close()
    return store.path


@pytest.mark.parametrize("damage", ["truncated field file", "missing field file", "missing valid.bin",
                                    "long valid.bin", "garbage in valid.bin"])
def test_cache_list_marks_a_store_whose_files_do_not_match_its_layout(tmp_path: Path, damage: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`cache list` (and Cache.info, which build_cache returns) trusted meta.json alone: a store whose
    field file was truncated showed 100% filled and no problem, while every open of it failed."""
    from fastdata.cache import Cache
    from fastdata.cli import main

    path = _filled_store(tmp_path / "c")
    if damage == "truncated field file":
        os.truncate(path / "field-000.bin", 10)
    elif damage == "missing field file":
        (path / "field-000.bin").unlink()
    elif damage == "missing valid.bin":
        (path / "valid.bin").unlink()
    elif damage == "long valid.bin":
        (path / "valid.bin").write_bytes(b"\x01" * 9)
    else:
        (path / "valid.bin").write_bytes(b"\x01\x07\x01\x01")
    with pytest.raises(CacheError) as opened:  # what every open of the store says
        Cache(tmp_path / "c").open_store(fingerprint="fp", num_samples=4).get(0)
    info = Cache(tmp_path / "c").list()[0]
    assert info.problem is not None and str(path) in info.problem, (info, opened.value)
    assert main(["cache", "list", "--cache", str(tmp_path / "c")]) == 0
    assert "DAMAGED" in capsys.readouterr().out
    Cache(tmp_path / "c").remove(info.key)
    assert Cache(tmp_path / "c").list() == []


def test_a_cache_directory_that_is_a_file_is_a_cache_error(tmp_path: Path) -> None:
    """Cache.list()/remove()/evict() over a --cache path that is a file raised a bare NotADirectoryError."""
    from fastdata.cache import Cache

    (tmp_path / "f").write_text("x")
    cache = Cache(tmp_path / "f", max_bytes=10)
    for call in (cache.list, cache.evict, cache.total_bytes, lambda: cache.remove("abc")):
        with pytest.raises(CacheError, match=r"cache directory .*f.*not a directory"):
            call()


def test_decode_threads_timeout_raises_at_the_timeout(tmp_path: Path, decode_thread_joins: list) -> None:
    """timeout= on the thread path raised only once the stuck transform returned: close() joined the
    thread for up to 10 s after the timeout (the worker path raises at the timeout). The thread is now
    told to stop and left to end on its own; its batch rows are never handed out again."""
    import threading
    import time
    from typing import Any

    src = _tiny_shards(tmp_path / "ds")
    release = threading.Event()

    def stuck(img: Any) -> Any:
        release.wait(20)
        return img

    ds = fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(8), transform=stuck)
    dl = fastdata.DataLoader(ds, batch_size=2, num_workers=1, decode_threads=1, timeout=0.2)
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.2 seconds"):
            next(iter(dl))
        joins = decode_thread_joins
        assert not [w for w in joins if w is None or w > 0], joins  # not after a join of the stuck thread (10 s)
        assert any(t.name.startswith("fastdata-decode") for t in threading.enumerate())  # still stuck, left running
    finally:
        release.set()
    deadline = time.monotonic() + 20
    while any(t.name.startswith("fastdata-decode") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name.startswith("fastdata-decode") for t in threading.enumerate())


def test_decode_threads_break_gives_the_batch_buffers_back(tmp_path: Path) -> None:
    """An early `break` (the iterator dropped, not closed) left the buffers of the batches in flight marked
    busy in the dataset's ring for good: after a few breaks every later epoch allocated fresh batch memory
    (the first-touch cost the ring exists to avoid)."""
    import gc

    src = _tiny_shards(tmp_path / "ds", n=12)
    ds = fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(32))
    dl = fastdata.DataLoader(ds, batch_size=2, num_workers=1, decode_threads=2)
    for _ in dl:  # learns the layout; the ring holds the epoch's buffers
        pass
    for _ in range(4):
        for _ in dl:
            break
        gc.collect()
    from fastdata.loader import _threads

    before = _threads._CARRY[ds][("buffers", None)].allocated
    for _ in dl:
        pass
    assert _threads._CARRY[ds][("buffers", None)].allocated == before  # every batch reused a ring buffer
