"""``fastdata.DataLoader``: torch's DataLoader with exact resume and the cached fast path.

Its place among the stages: docs/ARCHITECTURE.md. ``Pool`` (the thread decoder's daemon threads, paused
around ``os.fork``) is shared with the device decode stage's threads.
"""
from fastdata.loader._loader import DataLoader, EpochSampler
from fastdata.loader._pool import Pool

# EpochSampler: a DataLoader's ``sampler`` over a ShardedDataset (its set_epoch reaches the dataset)
__all__ = ["DataLoader", "EpochSampler", "Pool"]
