"""Session 7 bug hunt in the preprocessing cache, the cached fast path and the thread decoder: one
regression test per defect."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import fastdata
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
