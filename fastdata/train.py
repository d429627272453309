"""A minimal mixed-precision training step that never synchronises with the GPU on its own.

``TrainStep`` does forward, loss, backward and (every ``grad_accum`` calls) the optimiser step
under autocast, and returns the loss as a detached device tensor: reading it (``.item()``,
``print``) is the only sync, so log every N steps rather than every step.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class _Options:
    precision: str
    grad_accum: int
    clip_norm: float | None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be an int >= 1, got {self.grad_accum!r}")
        clip = self.clip_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"clip_norm must be a number > 0 or None, got {clip!r}")


def resolve_precision(precision: str, device: torch.device) -> str:
    """Map ``"auto"`` to what the device does well: bf16 on GPUs that support it, else fp16; fp32 on CPU."""
    if precision != "auto":
        if precision == "fp16" and device.type == "cpu":
            raise ValueError("precision='fp16' needs a CUDA device; use 'bf16' or 'fp32' on the CPU")
        return precision
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


class TrainStep:
    """One AMP training step: ``loss = step(batch)``.

    ``batch`` is ``(inputs, targets)`` (extra items are ignored) or a mapping with
    ``input_key``/``target_key``. ``loss_fn(outputs, targets)`` returns a scalar tensor.
    fp16 uses a ``GradScaler`` (its overflow check is torch's one sync per optimiser step);
    bf16 and fp32 need none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        precision: str = "auto",
        grad_accum: int = 1,
        clip_norm: float | None = None,
        compile: bool = False,
        input_key: str = "input",
        target_key: str = "target",
    ) -> None:
        self.options = _Options(precision, grad_accum, clip_norm)
        try:
            param = next(model.parameters())
        except StopIteration:
            raise ValueError("model has no parameters to train") from None
        self.device = param.device
        self.precision = resolve_precision(precision, self.device)
        self.model = torch.compile(model) if compile else model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.input_key = input_key
        self.target_key = target_key
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self._micro = 0  # micro-batches accumulated since the last optimiser step
        self.steps = 0  # optimiser steps taken

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _split(self, batch: Any) -> tuple[Any, Any]:
        if isinstance(batch, Mapping):
            missing = [k for k in (self.input_key, self.target_key) if k not in batch]
            if missing:
                raise KeyError(f"batch has no key(s) {missing}; it has {sorted(batch)} "
                               "(set input_key=/target_key=)")
            return batch[self.input_key], batch[self.target_key]
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[0], batch[1]
        raise TypeError(f"batch must be (inputs, targets, ...) or a mapping, got {type(batch).__name__}")

    def __call__(self, batch: Any) -> torch.Tensor:
        """Run one micro-batch; step the optimiser every ``grad_accum`` calls. Returns the detached loss."""
        inputs, targets = self._split(batch)
        self.model.train()
        with self._autocast():
            loss = self.loss_fn(self.model(inputs), targets)
        scaled = loss / self.options.grad_accum if self.options.grad_accum > 1 else loss
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        self._micro += 1
        if self._micro == self.options.grad_accum:
            self._step()
        return loss.detach()

    def _step(self) -> None:
        if self.options.clip_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            # scales by a clamped coefficient computed on the device: no host sync
            torch.nn.utils.clip_grad_norm_(params, self.options.clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Scaler state and counters (model and optimizer state are saved by their owners)."""
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "micro": self._micro, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self._micro = int(state.get("micro", 0))
        self.steps = int(state.get("steps", 0))
