"""ShardedDataset shows its user's API; what only a loader needs goes through ``loader_seam``."""
from __future__ import annotations

import inspect

from torch.utils.data import IterableDataset

from fastdata import ShardedDataset
from fastdata.dataset import LoaderSeam

MAX_PUBLIC = 12  # Grain's MapDataset has 12 public methods, Mosaic's StreamingDataset 13


def own_public(cls: type) -> list[str]:
    """Public methods and properties ``cls`` defines itself (not inherited, no dunders)."""
    return sorted(name for name, value in vars(cls).items()
                  if not name.startswith("_") and (callable(value) or isinstance(value, (property, classmethod,
                                                                                            staticmethod))))


def test_own_public_surface_is_small():
    names = own_public(ShardedDataset)
    assert len(names) <= MAX_PUBLIC, f"ShardedDataset has {len(names)} public methods/properties: {names}"


def test_the_users_api_is_there_and_the_loaders_is_on_the_seam():
    names = set(own_public(ShardedDataset))
    assert {"set_epoch", "epoch", "state_dict", "load_state_dict", "num_samples", "build_cache",
            "loader_seam"} <= names
    loader_only = {"cursor", "epoch_start", "counts_at", "state_at", "sequences_at", "locate", "consume_resume",
                   "record_skips", "begin_skip_budget", "report_skips_inline", "preload_next_epoch",
                   "stop_skip_reports", "iterate", "load_sample", "load_uncached", "cache_store", "resolve_dist",
                   "worker_counts", "batches_per_epoch", "token", "has_cache"}
    assert not names & loader_only
    assert loader_only <= set(own_public(LoaderSeam))


def test_the_surface_count_sees_methods_and_properties_but_not_inherited_ones():
    class Probe(IterableDataset):
        def __iter__(self):
            return iter(())

        def a(self):
            pass

        @property
        def b(self):
            return 1

        def _c(self):
            pass

    assert own_public(Probe) == ["a", "b"]
    assert "__iter__" in vars(ShardedDataset) and inspect.isfunction(vars(ShardedDataset)["__iter__"])
