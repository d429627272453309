"""Where this process runs: a DataLoader worker or not, and whether torch.distributed is initialised."""
from __future__ import annotations

import torch
from torch.utils.data import get_worker_info

__all__ = ["dist_ready", "in_worker"]


def dist_ready() -> bool:
    """True when torch.distributed is initialised (it then gives rank and world size)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def in_worker() -> bool:
    """True in a torch DataLoader worker process."""
    return get_worker_info() is not None
