"""The batch tree walk (fastdata.prefetch.tree): every container type rebuilt, tensors found inside
holders and image batches."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from fastdata.prefetch import tree
from fastdata.prefetch._stage import CudaStager
from fastdata.prefetch.tree import format_path, keys_matcher, map_tensors, tensor_leaves
from tests.helpers.prefetch import assert_same_tree, nested_batches


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


def test_a_ragged_image_batch_lists_its_images_for_the_prefetcher() -> None:
    from fastdata.gpu import ImageBatch

    images = [torch.zeros(3, 4, 5, dtype=torch.uint8), torch.zeros(3, 7, 2, dtype=torch.uint8)]
    batch = {"jpg": ImageBatch(images, [0, 1], 0), "cls": torch.tensor([1, 2])}
    assert tree.held_tensors(batch)[:2] == images
    owned = CudaStager._storages(SimpleNamespace(device=torch.device("cpu")), batch)
    assert {t.data_ptr() for t in owned} >= {t.data_ptr() for t in images}


def test_map_tensors_rebuilds_every_container_type() -> None:
    batch = nested_batches(3)[2]
    out = map_tensors(batch, lambda t, p: t.clone())
    assert_same_tree(out, batch)
    assert out["dd"].default_factory is list and out["img"] is not batch["img"]
    assert out["arr"] is batch["arr"] and out["sample"].meta is batch["sample"].meta
    paths = [format_path(p) for p, _ in tensor_leaves(batch)]
    assert "batch['pair'].image" in paths and "batch['sample'].extra" in paths and "batch['list'][2][0]" in paths
    kept = tensor_leaves(batch, skip=keys_matcher(["pair", "image", 0]))
    assert all("pair" not in p and 0 not in p for p, _ in kept)
