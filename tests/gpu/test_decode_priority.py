"""The decode stage under CUDAPrefetcher(stream_priority=...): its decode stream takes the side stream's
priority, with and without DecodeImages.ahead (any depth), also when one stage serves both priorities."""
from __future__ import annotations

import pytest
import torch

from fastdata import gpu
from fastdata.prefetch import CUDAPrefetcher

from tests.helpers.images import many_jpegs, packed

pytestmark = pytest.mark.cuda


def batches(n: int = 4, size: int = 6) -> list[dict]:
    datas = many_jpegs(n * size)
    return [{"jpg": packed(datas[k : k + size]).pin_memory(), "cls": torch.arange(size)}
            for k in range(0, n * size, size)]


def priorities(stage: gpu.DecodeImages) -> set[int]:
    return {s.priority for s in stage._streams.values()}


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_decode_stream_has_the_prefetchers_priority(ahead):
    low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): high <= low
    if high == low:
        pytest.skip("this device has a single stream priority")
    for priority, want in (("high", high), ("normal", 0)):
        pipe = gpu.Compose(gpu.DecodeImages(device="cuda"), gpu.RandomResizedCrop(32),
                           gpu.Normalize(dtype=torch.bfloat16))
        src = batches() if not ahead else pipe.transforms[0].ahead(batches(), batches=ahead)
        with CUDAPrefetcher(src, device="cuda", transform=pipe, stream_priority=priority, seamless=False) as pf:
            got = [b["jpg"].shape for b in pf]
        assert got == [(6, 3, 32, 32)] * 4
        assert priorities(pipe.transforms[0]) == {want}


def test_one_stage_under_both_priorities_decodes_on_a_stream_of_each():
    low, high = torch.cuda.Stream.priority_range()
    if high == low:
        pytest.skip("this device has a single stream priority")
    stage = gpu.DecodeImages(device="cuda")
    pipe = gpu.Compose(stage, gpu.RandomResizedCrop(32))
    for priority in ("normal", "high", "normal"):
        with CUDAPrefetcher(stage.ahead(batches(2)), device="cuda", transform=pipe, stream_priority=priority,
                            seamless=False) as pf:
            assert len(list(pf)) == 2
    assert priorities(stage) == {0, high} and len(stage._streams) == 2
