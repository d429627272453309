"""Precision choices shared by :class:`TrainStep` and :func:`evaluate`: the autocast context and the
dtype (and device) the model's inputs are cast to before the forward pass.

Casting inputs is what lets any ``Normalize(dtype=...)`` feed any model: a bf16 batch into an fp32
model on the CPU fails inside the first convolution ("Input type (c10::BFloat16) and bias type
(float) should be the same"), and an fp32 batch under bf16 autocast is cast by autocast anyway.
Only floating-point tensors are cast (integer token ids, masks and labels keep their dtype); a
tensor on another device is moved with ``non_blocking=True`` (asynchronous from pinned memory).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from fastdata.prefetch.tree import map_tensors

PRECISIONS = ("auto", "fp32", "bf16", "fp16")

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: Any) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def resolve_precision(precision: str, device: torch.device) -> str:
    """Map ``"auto"`` to what the device does well: bf16 on GPUs that support it, else fp16; fp32 on CPU."""
    check_precision(precision)
    if precision != "auto":
        if precision == "fp16" and device.type == "cpu":
            raise ValueError("precision='fp16' needs a CUDA device; use 'bf16' or 'fp32' on the CPU")
        return precision
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device of the model's first parameter and the dtype of its first floating-point parameter."""
    params = list(model.parameters())
    if not params:
        raise ValueError("model has no parameters")
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    return params[0].device, dtype


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``bf16``/``fp16``; nothing for ``fp32``."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def input_dtype(precision: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype floating-point inputs are cast to: the autocast dtype, else the parameters' dtype."""
    return _AUTOCAST_DTYPES.get(precision, param_dtype)


def prepare(obj: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``obj`` (a tensor or nested batch) on ``device``, floating tensors cast to ``dtype`` (None: keep).

    Tensors already right are returned as they are (no copy, no kernel).
    """
    def leaf(x: torch.Tensor, _path: Any) -> torch.Tensor:
        if x.device != device:
            x = x.to(device, non_blocking=True)
        if dtype is not None and x.is_floating_point() and x.dtype != dtype:
            x = x.to(dtype)  # keeps the memory format (channels_last stays channels_last)
        return x

    return map_tensors(obj, leaf)


def enable_tf32(device: torch.device) -> None:
    """Allow TF32 tensor cores for fp32 matmuls and convolutions (CUDA only; process-wide).

    ``set_float32_matmul_precision`` is used rather than the newer per-backend ``fp32_precision``
    flags because torch refuses to *read* the legacy ``allow_tf32`` flags once the new ones were
    set, which would break code elsewhere in the process that reads them; with this call both the
    old and the new flags read back consistently. On the CPU nothing is changed (the same call
    would switch oneDNN matmuls to reduced precision there).
    """
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
