"""Session 7, lead: regression tests for defects found outside the helpers' areas."""
from __future__ import annotations

import threading

import torch

from fastdata import CUDAPrefetcher


def test_two_threads_iterating_one_prefetcher_get_no_internal_error() -> None:
    """One thread's iter() ends the other's run (as a second iter() does in one thread); the ended loop
    stops cleanly. Before: 'prefetch thread exited without finishing the epoch' (the stopped consumer
    took the stop for a dead producer) or 'cannot join thread before it is started'."""
    pf = CUDAPrefetcher([torch.full((2,), i) for i in range(40)], device="cpu")
    errors: list[BaseException] = []
    counts: list[int] = []

    def loop() -> None:
        try:
            n = 0
            for batch in pf:
                assert int(batch[0]) == n  # in order, from the start of the epoch, nothing skipped
                n += 1
            counts.append(n)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    for _ in range(12):
        threads = [threading.Thread(target=loop) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    pf.close()
    assert errors == []
    assert len(counts) == 24 and max(counts) == 40  # the run started last always completes
