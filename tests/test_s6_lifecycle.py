"""Session 6 bug hunt in the lifecycle of the loader's and the prefetcher's threads and processes:
one regression test per defect found."""
from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from fastdata.prefetch import CUDAPrefetcher


class _Epochal:
    """A re-iterable with ``set_epoch``/``epoch`` (like a loader) whose ``iter()`` reads the epoch,
    then, at its ``hold``-th call, waits for ``gate`` (a loader whose iter() takes time: workers starting)."""

    def __init__(self, n: int = 3, hold: int = 0) -> None:
        self.epoch = 0
        self.n = n
        self.hold = hold
        self.calls = 0
        self.in_iter = threading.Event()
        self.gate = threading.Event()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        self.calls += 1
        if self.calls == self.hold:
            self.in_iter.set()
            assert self.gate.wait(10)
        return iter([(epoch, i) for i in range(self.n)])


def _epochs_of(batches: list[Any]) -> set[int]:
    return {int(e) for e, _ in batches}


def test_loader_epoch_set_while_the_lookahead_iter_runs_is_not_mislabelled() -> None:
    """The look-ahead read the loader's epoch after its iter(): a loader.set_epoch(1) landing while
    that iter() ran (it had already fixed epoch 0) labelled epoch 0's iterator as epoch 1, so the
    next epoch silently repeated epoch 0 (same order) with no warning and nothing discarded."""
    src = _Epochal(hold=2)  # the look-ahead's iter() of epoch 1 waits for the gate
    p = CUDAPrefetcher(src, device="cpu")
    try:
        assert _epochs_of(list(p)) == {0}
        assert src.in_iter.wait(10)
        src.set_epoch(1)  # behind the prefetcher's back, while its look-ahead's iter() runs
        src.gate.set()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(p)
        assert _epochs_of(got) == {1}, got
        assert any("discarded" in str(w.message) for w in caught)
        assert p.stats()["lookahead_discarded"] == 1
    finally:
        src.gate.set()
        p.close()


@pytest.mark.parametrize("seamless", [False, True])
def test_loader_epoch_set_behind_a_driven_prefetcher_is_honoured(seamless: bool) -> None:
    """After CUDAPrefetcher.set_epoch, an epoch start set the loader's epoch to the previous + 1 even
    when the user had set the loader's epoch meanwhile: with seamless=False (or a look-ahead that had
    not begun yet) loader.set_epoch(5) was silently overwritten with 1; a later look-ahead discarded
    and ran 5. Both orders now run 5, then 6."""
    src = _Epochal()
    p = CUDAPrefetcher(src, device="cpu", seamless=seamless)
    try:
        p.set_epoch(0)
        assert _epochs_of(list(p)) == {0}
        src.set_epoch(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a look-ahead already started is discarded
            assert _epochs_of(list(p)) == {5}
        assert _epochs_of(list(p)) == {6}
    finally:
        p.close()
