"""The largest batch that fits: grow until out-of-memory, back off, leave headroom.

``search_batch_size(fits)`` calls ``fits(b)`` (one training step at batch ``b``), doubling ``b``
from ``start`` until it runs out of memory or reaches ``limit``, then bisects between the largest
batch that ran and the smallest that did not, to a granularity of ``multiple``. The answer keeps
``headroom`` (default 10%) below the largest batch that ran: activation memory grows about
linearly with the batch, so 10% fewer samples leave at least 10% of the activation memory for
fragmentation, longer sequences or a later layer change. Any error other than out-of-memory is
raised unchanged: a step that fails for another reason must not look like "too big".
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastdata.errors import FastdataError


@dataclass(frozen=True)
class BatchSearch:
    """Outcome of :func:`search_batch_size`."""

    batch_size: int  # the recommendation: largest_fit less headroom, a multiple of ``multiple``
    largest_fit: int  # the largest batch that ran
    first_oom: int | None  # the smallest batch that ran out of memory (None: ``limit`` was reached)
    tried: tuple[tuple[int, bool], ...]  # (batch, fitted) in the order tried
    headroom: float


def is_out_of_memory(error: BaseException) -> bool:
    """True for torch's CUDA out-of-memory error, the allocators' "out of memory" RuntimeErrors, the CPU
    allocator's "can't allocate memory" and cuBLAS/cuDNN failing to allocate their workspace near the limit."""
    import torch

    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(error, oom):
        return True
    return isinstance(error, (RuntimeError, MemoryError)) and (
        isinstance(error, MemoryError)
        or any(m in str(error).lower() for m in _OOM_MESSAGES))


_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def _round_down(n: int, multiple: int) -> int:
    return n - n % multiple if n >= multiple else n


def search_batch_size(
    fits: Callable[[int], object],
    *,
    start: int = 32,
    limit: int = 4096,
    headroom: float = 0.1,
    multiple: int = 8,
    after_oom: Callable[[], object] | None = None,
) -> BatchSearch:
    """Largest batch for which ``fits(batch)`` runs without out-of-memory, less ``headroom``.

    ``after_oom`` runs after each out-of-memory (e.g. ``torch.cuda.empty_cache``).
    """
    for name, value in (("start", start), ("limit", limit), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    if not callable(fits):
        raise ValueError(f"fits must be callable, got {fits!r}")
    if after_oom is not None and not callable(after_oom):  # else found at the first out-of-memory, mid-search
        raise ValueError(f"after_oom must be callable or None, got {after_oom!r}")
    if start > limit:
        raise ValueError(f"start must be <= limit, got start={start} and limit={limit}")
    tried: list[tuple[int, bool]] = []

    def attempt(b: int) -> bool:
        try:
            fits(b)
        except BaseException as e:
            if not is_out_of_memory(e):
                raise
            tried.append((b, False))
            if after_oom is not None:
                after_oom()
            return False
        tried.append((b, True))
        return True

    lo, hi = 0, None  # largest that ran, smallest that did not
    b = start
    while True:  # grow (or, if start does not fit, shrink) by factors of two
        if attempt(b):
            lo = b
            if hi is not None or b >= limit:
                break
            b = min(2 * b, limit)
        else:
            hi = b
            if lo:
                break
            if b == 1:
                raise FastdataError("a batch of 1 does not fit in memory: the model alone is too large")
            b //= 2
    if hi is not None:  # bisect (lo, hi)
        step = multiple if lo >= multiple else 1
        while hi - lo > step:
            mid = _round_down((lo + hi) // 2, step)
            if mid <= lo:
                break
            if attempt(mid):
                lo = mid
            else:
                hi = mid
    chosen = max(1, _round_down(int(lo * (1.0 - headroom)), multiple))
    return BatchSearch(batch_size=chosen, largest_fit=lo, first_oom=hi, tried=tuple(tried), headroom=headroom)
