"""``fastdata.DataLoader``: torch's DataLoader with exact resume and the cached fast path.

Stage 4 of the pipeline (shards -> dataset -> cache -> **loader** -> prefetch -> GPU -> train).
"""
from fastdata.loader._loader import DataLoader

__all__ = ["DataLoader"]
