"""``evaluate``: inference over a validation set with one device-to-host transfer at the end.

Batches come through a :class:`fastdata.CUDAPrefetcher` (the one given, or one wrapped around the
loader given), the forward pass runs under autocast in ``torch.inference_mode``, and every metric is
accumulated as a running sum on the device; sample counts come from tensor shapes, which the host
knows without asking the GPU. The only sync is the final ``.tolist()`` of the stacked sums (after
an all-reduce over ranks when ``torch.distributed`` is initialised).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fastdata.prefetch import CUDAPrefetcher
from fastdata.train._precision import (
    autocast,
    check_precision,
    input_dtype,
    model_device_dtype,
    prepare,
    resolve_precision,
)
from fastdata.train._step import check_keys, split_batch

Metric = Callable[[Any, Any], torch.Tensor]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample top-1 hit (1.0 or 0.0) of ``(N, classes)`` logits against ``(N,)`` class indices."""
    return (outputs.argmax(dim=-1) == targets).float()


def top_k(k: int) -> Metric:
    """A metric: per-sample hit when the target is among the ``k`` highest logits."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")

    def metric(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        top = outputs.topk(min(k, outputs.shape[-1]), dim=-1).indices
        return (top == targets.unsqueeze(-1)).any(dim=-1).float()

    metric.__name__ = f"top{k}"
    return metric


def _batch_size(targets: Any, inputs: Any) -> int:
    for value in (targets, inputs):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, (list, tuple)):
            return len(value)
    raise ValueError("cannot tell the batch size: targets and inputs are neither tensors nor sequences")


def _batch_sum(name: str, value: Any, n: int) -> torch.Tensor:
    """A metric's per-sample values (shape ``(n,)``) or batch mean (a scalar) as a batch sum."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name!r} must return a tensor, got {type(value).__name__}")
    if value.dim() == 0:
        return value.float() * n
    if value.shape[0] != n or value.numel() != n:  # (N, C) or (N, H, W) summed would scale the mean by C or H*W
        raise ValueError(f"{name!r} returned shape {tuple(value.shape)}; expected a scalar (the batch "
                         f"mean) or one value per sample, shape ({n},)")
    return value.float().sum()


def _distributed_world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    metrics: Mapping[str, Metric] | None = None,
    precision: str = "auto",
    transform: Callable[[Any], Any] | None = None,
    input_key: str = "input",
    target_key: str = "target",
    max_batches: int | None = None,
) -> dict[str, float]:
    """Mean loss and metrics of ``model`` over ``batches``, e.g. ``{"loss": 0.93, "accuracy": 0.71}``.

    Args:
        model: evaluated in ``eval()`` mode (every submodule's previous mode is restored afterwards).
        batches: a ``CUDAPrefetcher``, or any loader, which is then wrapped in one on the model's
            device with ``transform`` (e.g. ``Normalize``).
        loss_fn: a loss returning the batch mean (``cross_entropy``) or per-sample values
            (``reduction="none"``); reported as ``"loss"``, the mean over all samples.
        metrics: name -> ``fn(outputs, targets)`` returning per-sample values (shape ``(N,)``) or a
            batch mean; reported as means over all samples. Default: ``{"accuracy": accuracy}``
            when ``loss_fn`` is None, else none.
        precision: as in ``TrainStep`` (``"auto"``: bf16/fp16 autocast on CUDA, fp32 on the CPU).
        transform: device transform for a loader that is not already a ``CUDAPrefetcher``.
        input_key, target_key: as in ``TrainStep``.
        max_batches: stop after this many batches (None: the whole iterable).

    Returns the means and ``"samples"``. Under ``torch.distributed`` the sums are all-reduced, so
    every rank gets the global means (padded duplicates of ``even="pad"`` count twice).
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (hasattr(batches, "__iter__") or hasattr(batches, "__getitem__")):  # iter() would start a loader
        raise ValueError(f"batches must be iterable, got {type(batches).__name__}")
    check_precision(precision)
    check_keys(input_key, target_key)
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ValueError(f"max_batches must be an int >= 1 or None, got {max_batches!r}")
    if metrics is None:
        metrics = {"accuracy": accuracy} if loss_fn is None else {}
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a mapping of name -> fn(outputs, targets), got {type(metrics).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable or None, got {loss_fn!r}")
    names = (["loss"] if loss_fn is not None else []) + list(metrics)
    if len(set(names)) != len(names) or "samples" in names:
        raise ValueError(f"metric names must differ from each other, from 'loss' and from 'samples', "
                         f"got {list(metrics)}")
    device, param_dtype = model_device_dtype(model)
    mode = resolve_precision(precision, device)
    dtype = input_dtype(mode, param_dtype)
    owned = not isinstance(batches, CUDAPrefetcher)
    if not owned and transform is not None:
        raise ValueError("transform= applies to a loader that evaluate wraps in a CUDAPrefetcher; this batches= is a "
                         "CUDAPrefetcher already: give it the transform (CUDAPrefetcher(loader, transform=...))")
    # seamless=False: one pass, so no second epoch of the loader is started behind the last batches
    source = CUDAPrefetcher(batches, device=device, transform=transform, seamless=False) if owned else batches
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    samples = 0
    modes = [(m, m.training) for m in model.modules()]  # each module's: a frozen BatchNorm stays in eval()
    model.eval()
    try:
        for batch in source if max_batches is None else itertools.islice(source, max_batches):
            inputs, targets = split_batch(batch, input_key, target_key)
            inputs = prepare(inputs, device, dtype)
            targets = prepare(targets, device, None)
            n = _batch_size(targets, inputs)
            if n == 0:  # an empty batch adds nothing; its batch-mean loss (nan) times 0 samples would be nan
                continue
            with autocast(mode, device):
                outputs = model(inputs)
                values = [_batch_sum("loss", loss_fn(outputs, targets), n)] if loss_fn is not None else []
                values += [_batch_sum(name, fn(outputs, targets), n) for name, fn in metrics.items()]
            if values:
                sums += torch.stack(values).to(torch.float64)
            samples += n
    finally:
        for module, training in modes:
            module.training = training
        if owned:
            source.close()  # type: ignore[union-attr]
    totals = torch.cat([sums, torch.tensor([float(samples)], dtype=torch.float64, device=device)])
    if _distributed_world() > 1:
        torch.distributed.all_reduce(totals)
    values = totals.tolist()  # the one device-to-host transfer
    count = values[-1]
    if count == 0:
        raise ValueError("evaluate: the batches were empty")
    result = {name: v / count for name, v in zip(names, values)}
    result["samples"] = int(count)
    return result
