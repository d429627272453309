"""Counter-based random numbers: a splitmix64 hash of (key, counter), shared by every stage.

Results are a function of integers only, identical on every machine, process and numpy version:
:func:`rng_key` folds words (seed, epoch, rank, ...) into a stream key, and the arrays are the hash of a
counter. The dataset's split and shuffle draw from it, and so do the random transforms of
``fastdata.transforms`` (CPU) and ``fastdata.gpu`` (device): :func:`uniforms` gives each sample its own
stream from ``(seed, salt, epoch, sample index)``, so a sample's random parameters do not depend on the
batch, worker, loader path or device that handles it (docs/design/split.md, docs/design/gpu-augment.md).
"""
from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "keys_u64", "mix_u64", "permutation", "random_floats", "random_u64", "rng_key", "uniforms"]

_MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def rng_key(*words: int) -> int:
    """Fold integers (seed, epoch, ...) into one 64-bit stream key."""
    key = 0x6A09E667F3BCC908
    for w in words:
        key = _mix64(key ^ _mix64((int(w) + GOLDEN) & _MASK))
    return key


def mix_u64(x: np.ndarray) -> np.ndarray:
    """:func:`_mix64` of every element of a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def random_u64(key: int, n: int) -> np.ndarray:
    """``n`` pseudo-random uint64 values of the stream ``key`` (splitmix64 of a counter)."""
    return mix_u64(np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GOLDEN) + np.uint64(key))


def random_floats(key: int, n: int) -> np.ndarray:
    """``n`` floats uniform in [0, 1)."""
    return (random_u64(key, n) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def permutation(key: int, n: int) -> np.ndarray:
    """A seeded permutation of ``range(n)`` (int64)."""
    return np.argsort(random_u64(key, n), kind="stable").astype(np.int64)


def keys_u64(head: int, idx: np.ndarray) -> np.ndarray:
    """``rng_key(*words, j)`` for every ``j`` of ``idx`` (ints; uint64 keys), vectorised: ``head`` is
    ``rng_key(*words)``, the fold over the common words (the last word varies)."""
    words = np.asarray(idx, dtype=np.int64).astype(np.uint64) + np.uint64(GOLDEN)  # (j + golden) mod 2^64
    return mix_u64(np.uint64(head) ^ mix_u64(words))


def uniforms(seed: int, salt: int, epoch: int, ids: np.ndarray, k: int) -> np.ndarray:
    """``(len(ids), k)`` floats in [0, 1): stream ``k`` of sample ``ids`` for ``(seed, salt, epoch)``,
    the counter stream of the key ``rng_key(seed, salt, epoch, id)``."""
    golden = np.uint64(GOLDEN)
    with np.errstate(over="ignore"):
        x = keys_u64(rng_key(seed, salt, epoch), np.asarray(ids, dtype=np.int64).reshape(-1))
        u = mix_u64(x[:, None] + np.arange(1, k + 1, dtype=np.uint64)[None, :] * golden)
    return (u >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
