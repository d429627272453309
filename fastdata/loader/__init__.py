"""``fastdata.DataLoader``: torch's DataLoader with exact resume and the cached fast path.

Its place among the stages: docs/ARCHITECTURE.md.
"""
from fastdata.loader._loader import DataLoader, EpochSampler

# EpochSampler: a DataLoader's ``sampler`` over a ShardedDataset (its set_epoch reaches the dataset)
__all__ = ["DataLoader", "EpochSampler"]
