"""The cursor a batch's collate reads its position from: one per loader and thread, not kept alive."""
from __future__ import annotations

import gc
import threading
from pathlib import Path

from fastdata.dataset import ShardedDataset
from fastdata.loader import DataLoader
from fastdata.shards.writer import ShardWriter


def test_two_in_process_loaders_read_in_two_threads_keep_their_own_positions(tmp_path: Path) -> None:
    """The cursor a batch's collate reads its position from was one per process: with two
    num_workers=0 loaders read at once in two threads (a prefetcher's look-ahead and a validation
    loop), one loader's collate could read the other's cursor, record nothing, and its state_dict()
    then replayed that batch on resume (4 of 400 samples twice in 1 of 3 runs of a free-running race)."""
    from torch.utils.data import default_collate

    for name in ("a", "b"):
        with ShardWriter(tmp_path / name, max_samples=4) as w:
            for i in range(8):
                w.write({"__key__": f"{name}{i}", "cls": str(i).encode()})
    a_pulled, b_pulled = threading.Event(), threading.Event()

    def collate_a(samples: list) -> dict:
        a_pulled.set()
        assert b_pulled.wait(10)  # B pulls a batch between A's samples and A's collate
        return default_collate(samples)

    a = DataLoader(ShardedDataset(tmp_path / "a", shuffle=False), batch_size=2, num_workers=0, collate_fn=collate_a)
    b = DataLoader(ShardedDataset(tmp_path / "b", shuffle=False), batch_size=2, num_workers=0)
    first: list[str] = []
    reader = threading.Thread(target=lambda: first.extend(next(iter(a))["__key__"]))
    reader.start()
    assert a_pulled.wait(10)
    next(iter(b))
    b_pulled.set()
    reader.join(10)
    again = DataLoader(ShardedDataset(tmp_path / "a", shuffle=False), batch_size=2, num_workers=0)
    again.load_state_dict(a.state_dict())
    assert first + [k for batch in again for k in batch["__key__"]] == [f"a{i}" for i in range(8)]


def test_a_dataset_read_to_the_end_is_not_kept_alive_by_its_last_cursor(tmp_path: Path) -> None:
    """The cursor of the last sample read stayed in a module global, with its dataset (open shards,
    cache maps) alive until another dataset was read in the process."""
    import weakref

    with ShardWriter(tmp_path / "ds", max_samples=4) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "cls": str(i).encode()})
    ds = ShardedDataset(tmp_path / "ds", shuffle=False)
    assert len([b for b in DataLoader(ds, batch_size=4, num_workers=0)]) == 2
    gone = weakref.ref(ds)
    del ds
    gc.collect()
    assert gone() is None
