"""Skipped samples: on_error warnings where the user sees them, the skip budget's cost, no skip list
growing in persistent workers."""
from __future__ import annotations

import numpy as np
import pytest

import fastdata
from fastdata import ShardWriter
from fastdata.dataset import ShardedDataset
from fastdata.errors import SkipBudgetError


pytestmark = pytest.mark.filterwarnings("ignore:Unclosed:ResourceWarning")


class _CountingList(list):
    """A list that counts the slices taken of it (how _count_skips copied every record at each skip)."""

    slices = 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            type(self).slices += 1
        return super().__getitem__(index)


def test_skip_budget_copies_no_records_until_it_runs_out(tmp_path):
    # Each skip copied every record of the pass (2c6df7a's filter of tar members made that copy a Python loop):
    # an epoch of 24k skips spent 78 ms of CPU per batch of 32 instead of 15 (quadratic in the skips).
    with ShardWriter(tmp_path / "ds") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "npy": np.zeros(2, np.uint8)})
    ds = ShardedDataset(str(tmp_path / "ds"), on_error="skip", max_skips=3)
    ds.loader_seam.begin_skip_budget()
    _CountingList.slices = 0
    ds.skipped = _CountingList([{"shard": "s", "key": "m", "member": "m.lnk", "reason": "symlink"}])
    for i in range(3):  # within the budget: counted, not copied
        ds.skipped.append({"shard": "s", "key": f"k{i}", "index": i, "epoch": 0, "reason": "bad"})
        ds._skips.count(ds, 1)
    assert _CountingList.slices == 0
    ds.skipped.append({"shard": "s", "key": "k3", "index": 3, "epoch": 0, "reason": "bad"})
    with pytest.raises(SkipBudgetError, match="4 samples skipped") as info:
        ds._skips.count(ds, 1)
    assert [r["key"] for r in info.value.skipped] == ["k0", "k1", "k2", "k3"]  # samples only, no tar member


def _worker_skips(sample: dict) -> dict:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    sample["held"] = len(info.dataset.skipped)  # the skip records this worker's copy of the dataset holds
    return sample


def test_a_persistent_workers_copy_of_the_dataset_holds_no_growing_skip_list(tmp_path) -> None:
    """Under fastdata.DataLoader a worker's skips reach the main process's ``dataset.skipped`` through the result
    queue; the worker appended each one to its own copy's ``skipped`` too, which nothing reads: with persistent
    workers that list grew by every skip of every epoch for the whole run, in every worker."""
    import numpy as np

    from fastdata.cli._synth import jpeg_bytes, synth_image
    from fastdata.shards.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=6) as w:
        for i in range(12):
            j = jpeg_bytes(synth_image(np.random.default_rng(i), 16, 16), 90)
            w.write({"__key__": f"k{i:03d}", "jpg": j[:40] if i % 4 == 1 else j, "cls": i})
    ds = fastdata.ShardedDataset(tmp_path / "ds", on_error="skip", sample_transform=_worker_skips)
    loader = fastdata.DataLoader(ds, batch_size=3, num_workers=1, persistent_workers=True,
                                 multiprocessing_context="fork")
    held = []
    for epoch in range(5):
        loader.set_epoch(epoch)
        held += [int(h) for b in loader for h in b["held"]]
    assert len(ds.skipped) == 5 * 3  # the main process's report: every skip of every epoch, as documented
    assert max(held) == 0, held  # before: 15 by the last epoch (3 more each epoch)


def test_on_error_warn_warns_in_the_main_process_with_worker_processes(tmp_path):
    # A worker process emitted the SkippedSampleWarning itself: the training process never saw it (no
    # warnings filter, -W error or logging.captureWarnings of the job applies there); the record still came.
    import warnings

    import fastdata
    from fastdata.dataset import SkippedSampleWarning

    with fastdata.ShardWriter(tmp_path / "ds") as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "bin": b"bad" if i == 1 else b"ok", "cls": i})

    def strict(b: bytes) -> bytes:
        if b == b"bad":
            raise ValueError("bad bytes")
        return b

    ds = ShardedDataset(tmp_path / "ds", on_error="warn", decode={"bin": strict})
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        keys = [k for b in fastdata.DataLoader(ds, batch_size=2, num_workers=1) for k in b["__key__"]]
    assert keys == ["k0", "k2", "k3"] and [r["key"] for r in ds.skipped] == ["k1"]
    shown = [str(w.message) for w in got if issubclass(w.category, SkippedSampleWarning)]
    assert len(shown) == 1 and "'k1'" in shown[0] and "bad bytes" in shown[0]
