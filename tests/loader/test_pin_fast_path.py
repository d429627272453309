"""``DataLoader.pin_fast_path()``: the explicit request of a CUDA consumer (``CUDAPrefetcher``) for
page-locked fast-path batches; ``fast_path_pinned`` only reports it."""
from __future__ import annotations

import pytest
import torch

from fastdata.loader import DataLoader


def test_pin_fast_path_is_asked_for_and_fast_path_pinned_only_reports_it() -> None:
    loader = DataLoader([torch.zeros(2)] * 4, batch_size=2)
    assert loader.fast_path_pinned is False
    with pytest.raises(AttributeError):
        loader.fast_path_pinned = True  # type: ignore[misc]  # read-only: pin_fast_path() asks for it
    loader.pin_fast_path()
    assert loader.fast_path_pinned is True
    loader.pin_fast_path()  # asking twice is the same as once
    assert loader.fast_path_pinned is True and [b.shape for b in loader] == [(2, 2), (2, 2)]


def test_a_cpu_prefetcher_does_not_ask_for_pinned_batches() -> None:
    from fastdata.prefetch import CUDAPrefetcher

    loader = DataLoader([torch.zeros(2)] * 4, batch_size=2)
    with CUDAPrefetcher(loader, device="cpu") as batches:
        assert len(list(batches)) == 2
    assert loader.fast_path_pinned is False
