"""DataLoader's arguments: what torch leaves unchecked is refused when the loader is built."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"num_workers": 1.5}, "num_workers"), ({"num_workers": float("inf")}, "num_workers"),
    ({"num_workers": True}, "num_workers"), ({"timeout": float("nan")}, "timeout"), ({"timeout": True}, "timeout"),
    ({"num_workers": 2, "prefetch_factor": 1.5}, "prefetch_factor"), ({"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor"),
    ({"pin_memory": "no"}, "pin_memory"), ({"num_workers": 1, "persistent_workers": "no"}, "persistent_workers"),
])
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_loader_arguments_torch_leaves_unchecked_are_refused_when_built(tmp_path, kwargs: dict, name: str) -> None:
    # each was accepted, then failed at the first iteration (TypeError, AssertionError) or, for the
    # flags, a string such as "no" was taken as true
    from fastdata import DataLoader, ShardedDataset
    from tests.helpers.shards import make_shards

    ds = ShardedDataset(make_shards(tmp_path / "ds", 6, 3, key="k/{i:05d}", txt=True))
    with pytest.raises(ValueError, match=name):
        DataLoader(ds, batch_size=2, **kwargs)


def test_loader_takes_a_numpy_worker_count_as_an_int(tmp_path) -> None:
    import numpy as np

    from fastdata import DataLoader, ShardedDataset
    from tests.helpers.shards import make_shards

    ds = ShardedDataset(make_shards(tmp_path / "ds", 6, 3, key="k/{i:05d}", txt=True))
    loader = DataLoader(ds, batch_size=2, num_workers=np.int64(0), timeout=np.float64(0))
    assert type(loader.num_workers) is int and sum(len(b["cls"]) for b in loader) == 6
