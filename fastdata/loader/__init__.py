"""``fastdata.DataLoader``: torch's DataLoader with exact resume and the cached fast path.

Stage 4 of the pipeline (shards -> dataset -> cache -> **loader** -> prefetch -> GPU -> train).
"""
from fastdata.loader._loader import DataLoader, EpochSampler

# EpochSampler: a DataLoader's ``sampler`` over a ShardedDataset (its set_epoch reaches the dataset)
__all__ = ["DataLoader", "EpochSampler"]
