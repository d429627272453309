"""The packed image fields of a batch, for the device decode stage: find them, put the decoded images in
their place, and drop the rows of skipped samples from every per-sample entry.

Batches are dicts, lists, tuples and namedtuples (what a collate makes); packed images inside other
containers (a Mapping, a dataclass) are refused with an error naming their path, since the stage could
not put the decoded images back there. Design note: docs/design/gpu-decode.md.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fastdata.dataset import EncodedImage, PackedImages
from fastdata.errors import DecodeError
from fastdata.gpu._augment import ImageBatch

__all__ = ["drop_rows", "field_name", "find_packed", "rebuild"]


def field_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "<batch>"


def find_packed(obj: Any, path: tuple[Any, ...], found: list) -> None:
    if isinstance(obj, PackedImages):
        found.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            find_packed(v, (*path, k), found)
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            find_packed(v, (*path, k), found)
    elif isinstance(obj, Mapping) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        # the stage rebuilds dicts, lists and tuples only: images packed in another container would pass untouched
        inner: list = []
        items = obj.items() if isinstance(obj, Mapping) else [(f.name, getattr(obj, f.name))
                                                              for f in dataclasses.fields(obj)]
        for k, v in items:
            find_packed(v, (*path, k), inner)
        if inner:
            raise ValueError(f"DecodeImages: the packed images at {field_name(inner[0][0])!r} sit in a "
                             f"{type(obj).__name__}; DecodeImages finds and replaces them in dicts, lists and tuples "
                             "only: make the batch (collate_fn) one of those")


def rebuild(obj: Any, path: tuple[Any, ...], replace: dict[tuple[Any, ...], Any]) -> Any:
    if path in replace:
        return replace[path]
    if isinstance(obj, dict):
        return {k: rebuild(v, (*path, k), replace) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (PackedImages, dict, list, tuple)) for v in obj):
        items = [rebuild(v, (*path, k), replace) for k, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _select_packed(packed: PackedImages, keep: list[int]) -> PackedImages:
    """The images ``keep`` of ``packed``, packed anew (a decode started ahead for it is dropped)."""
    if not keep:
        return PackedImages(torch.empty(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64), shards=[], keys=[],
                            epoch=packed.epoch)
    views, index = packed.views(), packed.indices.tolist()
    return PackedImages.pack([EncodedImage(views[i].numpy(), shard=packed.shards[i], key=packed.keys[i],
                                           index=index[i], epoch=packed.epoch) for i in keep])


_CONTAINERS = (torch.Tensor, np.ndarray, PackedImages, ImageBatch, Mapping, list, tuple)


def _batched(obj: Any, n: int) -> bool:
    """True when every leaf of ``obj`` is ``n`` rows (a tensor's first dim, packed or decoded images, a list of
    ``n`` plain values): what a collate makes of one field of ``n`` samples."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return obj.ndim >= 1 and obj.shape[0] == n
    if isinstance(obj, (ImageBatch, PackedImages)):
        return len(obj) == n
    if isinstance(obj, Mapping):
        return all(_batched(v, n) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        if not any(isinstance(v, _CONTAINERS) for v in obj):
            return len(obj) == n
        return all(_batched(v, n) for v in obj)
    return False


def _per_sample(obj: list | tuple, n: int, path: tuple[Any, ...]) -> bool:
    """Whether a list of ``n`` items holds one item per sample (a custom collate's list of boxes tensors, of
    target dicts, of strings) rather than a collated structure (a sample's list field: ``n`` batched tensors).
    A list of ``n`` plain values or dicts, or of items that are not all ``n`` rows, is per sample. One whose
    other items are all ``n`` rows too could be either: an error naming it rather than a guess, which would
    pair the targets of one sample with the image of another, silently."""
    containers = any(isinstance(v, _CONTAINERS) for v in obj)
    if not containers or not all(_batched(v, n) for v in obj) or all(isinstance(v, Mapping) for v in obj):
        return True  # a list of n dicts: torchvision's detection targets, one per sample
    where = "".join(f"[{k!r}]" for k in path) or "the batch"
    raise DecodeError(
        f"DecodeImages(on_error={'skip'!r}): batch entry {where} is a list of {n} items of {n} rows each, with {n} "
        f"samples in the batch: it cannot tell whether it holds one item per sample (drop the skipped sample's "
        f"item) or a collated field of {n} batched items (drop a row of each). Give per-sample items another "
        f"form, e.g. one dict per sample ({{'boxes': tensor}}) for a detection target, or a batch size other "
        f"than the length of a list field")


def drop_rows(obj: Any, n: int, keep: list[int], done: set, path: tuple[Any, ...] = ()) -> Any:
    """Keep rows ``keep`` of every per-sample entry: tensors with first dim ``n``, lists of ``n`` items one per
    sample (:func:`_per_sample`), and the packed or decoded images of other fields (another stage's ``keys``)."""
    if path in done:
        return obj
    if isinstance(obj, ImageBatch):
        return obj.select(keep) if len(obj) == n else obj
    if isinstance(obj, PackedImages):
        return _select_packed(obj, keep) if len(obj) == n else obj
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 1 and obj.shape[0] == n:
            idx = torch.from_numpy(np.asarray(keep, dtype=np.int64))
            if obj.device.type == "cuda":
                idx = idx.pin_memory().to(obj.device, non_blocking=True)
            return obj.index_select(0, idx)
        return obj
    if isinstance(obj, dict):
        return {k: drop_rows(v, n, keep, done, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if len(obj) == n and _per_sample(obj, n, path):
            items = [obj[i] for i in keep]
        else:
            items = [drop_rows(v, n, keep, done, (*path, k)) for k, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
