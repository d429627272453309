"""The loader's collate call: errors a collate raises for mismatched samples made to name what differs.

Used by every loader path (the worker path's tagging collate, the thread decoder, the cached path's
custom collate), so a batch of samples with different fields or shapes fails with the same message.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from fastdata.errors import MissingFieldError

__all__ = ["collate"]


def collate(collate_fn: Callable[[Any], Any], data: Any) -> Any:
    """``collate_fn(data)``; StopIteration from it is a RuntimeError: raised in ``__next__`` (or in a
    worker's fetch) it would be taken for the end of the data, the rest of the epoch lost silently."""
    try:
        return collate_fn(data)
    except StopIteration as stop:
        raise RuntimeError("collate_fn raised StopIteration") from stop
    except KeyError as missing:
        text = _differing_fields(data)
        if text is None:
            raise
        raise MissingFieldError(
            f"the samples of one batch hold different fields ({text}), and the collate needs the same ones "
            "in every sample (a KeyError). Image fields sharing a base name are alternatives (a folder of "
            ".jpg and .png files gives samples with `jpg` or `png`): re-encode the images to one format, "
            "give them one field name in a sample_transform, or pass a collate_fn that handles both"
        ) from missing
    except RuntimeError as err:  # torch's "stack expects each tensor to be equal size": which field, which samples
        text = _differing_shapes(data) if "equal size" in str(err) else None
        if text is None:
            raise
        raise RuntimeError(
            f"the samples of one batch hold {text}, and the collate stacks a field's values into one tensor: give "
            "them one size with preprocess= (e.g. fastdata.ResizeCenterCrop(224)) or transform=, or pass a "
            f"collate_fn that keeps them apart ({err})") from err


def _differing_shapes(data: Any) -> str | None:
    """The first field (or tuple position) whose arrays or tensors differ in shape between two samples of ``data``,
    described, or None."""
    if not isinstance(data, list) or not data:
        return None
    if all(isinstance(s, Mapping) for s in data):
        names, label = list(data[0]), lambda j, s: repr(s.get("__key__", f"#{j}"))
        what = "field {!r}"
    elif all(isinstance(s, (tuple, list)) and len(s) == len(data[0]) for s in data):  # (image, label) samples
        names, label = list(range(len(data[0]))), lambda j, s: f"sample {j} of the batch"
        what = "element {} of each sample"
    else:
        return None
    arrays = (torch.Tensor, np.ndarray)
    for name in names:
        first = data[0][name]
        if not isinstance(first, arrays):
            continue
        for j, other in enumerate(data[1:], 1):
            v = other.get(name) if isinstance(other, Mapping) else other[name]
            if isinstance(v, arrays) and tuple(v.shape) != tuple(first.shape):
                return (f"{what.format(name)} in different shapes ({label(0, data[0])}: {tuple(first.shape)}; "
                        f"{label(j, other)}: {tuple(v.shape)})")
    return None


def _differing_fields(data: Any) -> str | None:
    """The first two samples of ``data`` whose field sets differ, described, or None."""
    if not isinstance(data, list) or not all(isinstance(s, Mapping) for s in data):
        return None
    first = data[0] if data else None
    for other in data[1:]:
        if other.keys() != first.keys():
            return "; ".join(f"{s.get('__key__', '?')!s}: {sorted(k for k in s if not str(k).startswith('__'))}"
                             for s in (first, other))
    return None
