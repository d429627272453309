"""``fastdata.DataLoader``: torch's DataLoader with exact resume and the cached fast path.

Stage 4 of the pipeline (shards -> dataset -> cache -> **loader** -> prefetch -> GPU -> train).
``Pool`` (the thread decoder's daemon threads, paused around ``os.fork``) is shared with the device
decode stage's threads.
"""
from fastdata.loader._loader import DataLoader
from fastdata.loader._pool import Pool

__all__ = ["DataLoader", "Pool"]
