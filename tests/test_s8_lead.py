"""Session 8, lead: defects found and fixed by the lead (each test failed before its fix)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from fastdata.prefetch import tree
from fastdata.prefetch._stage import CudaStager


class _Holder:
    """A leaf object with tensors the tree walk cannot see, like a ragged ImageBatch."""

    def __init__(self, images: list[torch.Tensor]) -> None:
        self.images = images

    def __fastdata_tensors__(self) -> list[torch.Tensor]:
        return self.images


def test_tensors_inside_a_holder_are_protected_at_hand_over() -> None:
    # A device transform can leave images of several sizes in an ImageBatch: the stager must
    # record_stream them for the consumer's stream like any tensor leaf, or the caching allocator
    # may reuse their memory while the consumer's kernels still read it.
    a, b, c = torch.zeros(3, 4, 5, dtype=torch.uint8), torch.zeros(3, 6, 2, dtype=torch.uint8), torch.ones(2)
    out = {"img": _Holder([a, b, a]), "y": c, "key": ["k0", "k1"]}
    assert [t for _, t in tree.tensor_leaves(out)] == [c]  # map order unchanged: holders stay leaves
    assert tree.held_tensors(out) == [a, b, a, c]
    fake = SimpleNamespace(device=torch.device("cpu"))
    owned = CudaStager._storages(fake, out)
    assert {t.data_ptr() for t in owned} == {a.data_ptr(), b.data_ptr(), c.data_ptr()}
