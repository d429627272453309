"""fastdata.DataLoader as a drop-in: generic like torch's, torch's argument values taken with torch's meaning."""
from __future__ import annotations

import contextlib
import math
import typing

import pytest
import torch
from torch import Tensor

import fastdata
from fastdata import DataLoader
from tests.helpers.shards import make_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("args") / "s", 8, 4, key="k{i:02d}", cls="int")


def test_the_loader_is_generic_like_torchs():
    alias = DataLoader[list[Tensor]]  # torch's test_typing: "is not a generic class" before
    assert typing.get_origin(alias) is DataLoader and typing.get_args(alias) == (list[Tensor],)

    def takes(loader: DataLoader[dict]) -> DataLoader[dict]:
        return loader

    assert typing.get_type_hints(takes)["loader"] == DataLoader[dict]


@pytest.mark.parametrize(("kwargs", "attrs"), [
    (dict(pin_memory=1, persistent_workers=0, num_workers=2), dict(pin_memory=True, persistent_workers=False)),
    (dict(num_workers=2, prefetch_factor=2.0), dict(prefetch_factor=2)),
    (dict(num_workers=2.0), dict(num_workers=2)),
    (dict(timeout=math.inf, num_workers=1), dict(timeout=0)),
    (dict(drop_last=1), dict(drop_last=True)),
])
def test_torch_argument_values_are_taken_with_torchs_meaning(shards, kwargs, attrs):
    """torch builds these loaders and then fails at the first batch (range() of a float, a queue wait
    of inf seconds); fastdata takes them as meant, and its loader iterates."""
    pin = bool(kwargs.get("pin_memory"))
    accelerator = torch.accelerator.is_available()
    # torch warns that pin_memory has nothing to pin for without an accelerator
    with pytest.warns(UserWarning, match="no accelerator") if pin and not accelerator else contextlib.nullcontext():
        loader = DataLoader(fastdata.ShardedDataset(shards), batch_size=2, **kwargs)
        batches = list(loader)
    for name, value in attrs.items():
        got = getattr(loader, name)
        assert got == value and type(got) is type(value), name
    assert sorted(int(c) for b in batches for c in b["cls"]) == list(range(8))
    if pin and accelerator:  # pin_memory=1 pins as True does
        assert all(b["cls"].is_pinned() for b in batches)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(pin_memory="no"), "pin_memory must be True or False .* torch would take any non-empty string as True"),
    (dict(num_workers=2, persistent_workers="false"), "persistent_workers must be True or False"),
    (dict(num_workers=1.5), "num_workers must be an int >= 0, got 1.5"),
    (dict(num_workers=-1), "num_workers must be an int >= 0"),
    (dict(num_workers=2, prefetch_factor=0), "prefetch_factor must be an int >= 1, got 0"),
    (dict(num_workers=2, prefetch_factor=2.5), "prefetch_factor must be an int >= 1, got 2.5"),
    (dict(timeout=float("nan")), "timeout must be a number of seconds >= 0"),
    (dict(timeout=-1), "timeout must be a number of seconds >= 0"),
    (dict(timeout=True), "timeout must be a number of seconds >= 0"),
])
def test_values_torch_would_misread_are_refused_with_the_difference(shards, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataLoader(fastdata.ShardedDataset(shards), batch_size=2, **kwargs)


def test_positional_arguments_and_unknown_names_are_torchs(shards):
    ds = fastdata.ShardedDataset(shards)
    loader = DataLoader(ds, 4, None, None, None, 1.0)  # batch_size, shuffle, sampler, batch_sampler, num_workers
    assert (loader.batch_size, loader.num_workers) == (4, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'workers'"):
        DataLoader(ds, workers=2)
    with pytest.raises(TypeError):
        torch.utils.data.DataLoader(ds, workers=2)  # the same error as torch's
