"""Seeded CPU random transforms (fastdata.transforms): one hash with the GPU ones, a generator per sample."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdata.gpu import RandomHorizontalFlip as GpuFlip
from fastdata.gpu import RandomResizedCrop as GpuCrop
from fastdata.transforms import (
    Compose,
    RandomHorizontalFlip,
    RandomResizedCrop,
    SampleGenerator,
    accepts_generator,
    sample_generator,
)


def _image(h: int = 30, w: int = 40) -> torch.Tensor:
    return torch.arange(3 * h * w, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(3, h, w)


def test_the_flip_decides_as_the_gpu_flip_for_the_same_sample_and_epoch():
    ids = np.arange(64)
    img = _image()
    for epoch in (0, 3):
        cpu = [not torch.equal(RandomHorizontalFlip(0.3, seed=4)(img, generator=sample_generator(9, epoch, int(i))), img)
               for i in ids]
        assert cpu == GpuFlip(0.3, seed=4).flips(ids, epoch).tolist()
        assert 5 < sum(cpu) < 40


def test_the_crop_window_is_the_gpu_crop_window():
    """The CPU crop of a ramp image is the GPU crop's window: resized with no scaling, it is that slice."""
    h, w = 30, 40
    ramp = (torch.arange(h)[:, None] * 1000 + torch.arange(w)[None, :])
    for i in range(20):
        top, left, ch, cw = (int(v[0]) for v in GpuCrop(8, seed=3).params(np.array([h]), np.array([w]),
                                                                           np.array([i]), 2))
        crop = RandomResizedCrop((ch, cw), seed=3)  # output size = crop size: the crop itself, unscaled
        got = crop(ramp[None].to(torch.int32).float(), generator=sample_generator(0, 2, i))
        expect = ramp[top:top + ch, left:left + cw].float()
        assert torch.equal(got[0], expect), i


def test_a_sample_generator_is_a_torch_generator_that_depends_on_seed_epoch_and_index():
    g = sample_generator(1, 2, 3)
    assert isinstance(g, torch.Generator) and isinstance(g, SampleGenerator) and (g.epoch, g.index) == (2, 3)
    draw = lambda *a: torch.rand(4, generator=sample_generator(*a))  # noqa: E731
    assert torch.equal(draw(1, 2, 3), draw(1, 2, 3))
    assert not torch.equal(draw(1, 2, 3), draw(1, 2, 4))
    assert not torch.equal(draw(1, 2, 3), draw(1, 3, 3))
    assert not torch.equal(draw(1, 2, 3), draw(2, 2, 3))


def test_without_a_sample_generator_the_transforms_draw_from_the_given_one():
    img = _image()
    outs = [RandomResizedCrop(8)(img, generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(*outs) and outs[0].shape == (3, 8, 8) and outs[0].dtype == torch.uint8
    torch.manual_seed(0)
    a = [RandomHorizontalFlip()(img) for _ in range(8)]
    torch.manual_seed(0)
    b = [RandomHorizontalFlip()(img) for _ in range(8)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_compose_passes_the_generator_to_the_transforms_that_take_one():
    seen = []

    def takes(x, generator):
        seen.append(generator)
        return x

    def plain(x):
        return x + 0

    assert accepts_generator(takes) and not accepts_generator(plain) and accepts_generator(RandomHorizontalFlip())
    assert accepts_generator(Compose([plain]))
    g = sample_generator(0, 0, 0)
    Compose([plain, takes, RandomHorizontalFlip(p=0.0)])(_image(), generator=g)
    assert seen == [g]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: RandomHorizontalFlip(p=1.5), "p must be a number in"),
    (lambda: RandomHorizontalFlip(seed="1"), "seed must be an int"),
    (lambda: RandomResizedCrop(0), "size must be >= 1"),
    (lambda: RandomResizedCrop(8, scale=(0.5, 0.1)), "scale must be finite"),
    (lambda: Compose([1]), "every transform must be callable"),
])
def test_bad_options_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()
