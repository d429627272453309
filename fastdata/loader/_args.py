"""torch's DataLoader arguments, taken as torch means them: the drop-in half of ``fastdata.DataLoader``.

torch checks few arguments when a DataLoader is built, and some values it takes fail only at the first
iteration (``prefetch_factor=2.0`` and ``num_workers=2.0``: a TypeError from ``range``;
``timeout=float("inf")``: an OverflowError). Here every value torch takes is accepted with torch's
meaning and normalised before torch sees it: an integral float is an int, a flag (``pin_memory``,
``persistent_workers``, ``drop_last``, ``in_order``) is its truth value (``pin_memory=1``), an
infinite timeout is no timeout (``0``). Refused, with a ValueError naming the argument, the value
and the difference: a string as a flag (torch takes ``"no"`` as true), a fractional count, a NaN or
negative timeout, ``prefetch_factor=0`` (torch then never requests a batch). See docs/guide/trainers.md.
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

import torch.utils.data

__all__ = ["torch_arguments"]

_SIGNATURE = inspect.signature(torch.utils.data.DataLoader.__init__)
_FLAGS = ("pin_memory", "persistent_workers", "drop_last", "in_order")


def _count(name: str, value: Any, lo: int) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= lo:
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer() and value >= lo:
        return int(value)  # 2.0: torch's range() would fail at the first iteration
    raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be True or False (or 1/0), got {value!r}: torch would take any non-empty "
                         "string as True, 'no' and 'false' included")
    return bool(value)


def _timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 (0 or math.inf: no timeout), got {value!r}")
    return 0 if math.isinf(value) else value  # torch's queue.get(timeout=inf) raised OverflowError


def torch_arguments(dataset: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.utils.data.DataLoader(dataset, *args, **kwargs)``'s arguments by name, normalised
    (see the module docstring); a TypeError as torch's for an argument it does not have."""
    bound = _SIGNATURE.bind(None, dataset, *args, **kwargs)
    out = dict(bound.arguments)
    out.pop(next(iter(_SIGNATURE.parameters)))  # self
    if "num_workers" in out:
        out["num_workers"] = _count("num_workers", out["num_workers"], 0)
    if out.get("prefetch_factor") is not None:
        out["prefetch_factor"] = _count("prefetch_factor", out["prefetch_factor"], 1)
    for name in _FLAGS:
        if name in out:
            out[name] = _flag(name, out[name])
    if "timeout" in out:
        out["timeout"] = _timeout(out["timeout"])
    return out
