"""``TrainStep``: a mixed-precision training step that never synchronises with the GPU on its own.

It does forward, loss, backward and (every ``grad_accum`` calls) the optimiser step under
autocast, and returns the loss as a detached device tensor: reading it (``.item()``, ``print``) is
the only sync, so log every N steps rather than every step. Inputs are cast to the dtype the model
computes in, so any ``Normalize(dtype=...)`` works on the CPU and the GPU; a DDP model skips the
gradient all-reduce on the micro-steps before the last one of an accumulation (``no_sync``).

Random ops inside the step (dropout, stochastic depth) draw from the step's own copy of torch's
generator state (CPU and the model's CUDA device), swapped in for the step and out after it. The
copy starts as the global state at construction (so ``torch.manual_seed`` still decides it) and is
part of ``state_dict()``: a resumed run gets the same dropout masks even though a restarted
DataLoader draws its worker seed from the global generator at a point where the original run did
not. Swapping costs two host-side state copies per step (no device sync).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastdata.train._precision import (
    autocast,
    check_precision,
    enable_tf32,
    input_dtype,
    model_device_dtype,
    prepare,
    resolve_precision,
)


@dataclass(frozen=True)
class _Options:
    precision: str
    grad_accum: int
    clip_norm: float | None
    tf32: bool

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be an int >= 1, got {self.grad_accum!r}")
        clip = self.clip_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"clip_norm must be a number > 0 or None, got {clip!r}")
        if not isinstance(self.tf32, bool):
            raise ValueError(f"tf32 must be a bool, got {self.tf32!r}")


def split_batch(batch: Any, input_key: str, target_key: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a ``(inputs, targets, ...)`` sequence or a mapping with the two keys."""
    if isinstance(batch, Mapping):
        missing = [k for k in (input_key, target_key) if k not in batch]
        if missing:
            raise KeyError(f"batch has no key(s) {missing}; it has {sorted(map(str, batch))} "
                           "(set input_key=/target_key=)")
        return batch[input_key], batch[target_key]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    raise TypeError(f"batch must be (inputs, targets, ...) or a mapping, got {type(batch).__name__}")


def check_keys(input_key: str, target_key: str) -> None:
    """ValueError naming ``input_key``/``target_key`` unless both are strs (a mapping batch's keys)."""
    for name, key in (("input_key", input_key), ("target_key", target_key)):
        if not isinstance(key, str):
            raise ValueError(f"{name} must be a str (the key of a mapping batch), got {key!r}")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside ``torch.compile`` (``_orig_mod``) and DDP/FSDP-style (``module``) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "module", None) if hasattr(model, "no_sync") else None
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _is_empty(inputs: Any) -> bool:
    """True when ``inputs`` holds no samples: a tensor (or every tensor of a mapping) with a leading dim of 0,
    or an empty ``ImageBatch``; shapes only, no sync. False when it cannot tell."""
    if isinstance(inputs, torch.Tensor):
        return inputs.dim() >= 1 and inputs.shape[0] == 0
    if isinstance(inputs, Mapping):
        tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 1]
        return bool(tensors) and all(t.shape[0] == 0 for t in tensors)
    if hasattr(inputs, "__fastdata_tensors__") and hasattr(inputs, "__len__"):  # fastdata.gpu.ImageBatch
        return len(inputs) == 0
    return False


class TrainStep:
    """One AMP training step: ``loss = step(batch)``.

    Args:
        model: the module to train, already on its device (a ``DistributedDataParallel`` model too).
        optimizer: its optimiser.
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar tensor.
        precision: ``"auto"`` (bf16 on GPUs that support it, else fp16 with a ``GradScaler``; fp32
            on the CPU), ``"fp32"``, ``"bf16"`` or ``"fp16"`` (CUDA only).
        grad_accum: optimiser step every this many calls; the loss is divided by it. A model with
            ``no_sync()`` (DDP) skips the gradient all-reduce on all but the last micro-step.
        clip_norm: clip the global gradient norm to this value (computed on the device, no sync).
        compile: wrap the model in ``torch.compile``.
        tf32: allow TF32 tensor cores for fp32 matmuls/convolutions (CUDA; a process-wide setting).
            ``False`` leaves torch's settings as they are.
        input_key, target_key: the entries of a mapping batch that are the model's input and the
            loss target; a sequence batch is ``(inputs, targets, ...)`` (extra items are ignored).

    Floating-point inputs (also nested in dicts/tuples) are cast to the autocast dtype, or to the
    model's parameter dtype without autocast, and inputs/targets on another device are moved to the
    model's (``non_blocking``). fp16 uses a ``GradScaler``, whose overflow check is torch's one sync
    per optimiser step; bf16 and fp32 need none.

    A model in ``eval()`` mode is put in ``train()`` mode; one already in train mode is left as it is, so
    submodules set to ``eval()`` (frozen BatchNorm statistics) stay so. An error in the optimiser step
    (or in clipping) drops the gradients accumulated for it: the next call starts a new accumulation.
    A batch with no samples (every image skipped by ``DecodeImages(on_error="skip")``) returns a NaN loss
    and is counted in ``empty_batches``: no forward, no micro-step, no optimiser step. Under DDP it runs as
    any batch, so that every rank joins the all-reduce, and this rank's gradients are zeros.
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
        tf32: bool = False,
        input_key: str = "input",
        target_key: str = "target",
    ) -> None:
        self.options = _Options(precision, grad_accum, clip_norm, tf32)
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
        if not isinstance(compile, bool):  # compile="no" compiled the model
            raise ValueError(f"compile must be a bool, got {compile!r}")
        check_keys(input_key, target_key)
        try:
            self.device, param_dtype = model_device_dtype(model)
        except ValueError:
            raise ValueError("model has no parameters to train") from None
        self.precision = resolve_precision(precision, self.device)
        self.input_dtype = input_dtype(self.precision, param_dtype)
        if tf32:
            enable_tf32(self.device)
        self.module = model  # as given (DDP included): its no_sync(); checkpoints unwrap it
        self.model = torch.compile(model) if compile else model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.input_key = input_key
        self.target_key = target_key
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self._no_sync = getattr(model, "no_sync", None)
        self._rng = _RngStream(self.device)
        self._micro = 0  # micro-batches accumulated since the last optimiser step
        self.steps = 0  # optimiser steps taken (fp16: skipped_steps of them skipped by the GradScaler)
        self.empty_batches = 0  # batches with no samples, returned NaN without a step (not under DDP)
        self._skipped: torch.Tensor | None = None  # fp16: steps the GradScaler skipped, counted on the device

    @property
    def skipped_steps(self) -> int:
        """Optimiser steps of ``steps`` that fp16's ``GradScaler`` skipped after an overflow (inf/NaN gradients);
        0 without a scaler. Reading it synchronises with the device, as reading the loss does."""
        return 0 if self._skipped is None else int(self._skipped)

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated since the last optimiser step (0 right after one)."""
        return self._micro

    def __call__(self, batch: Any) -> torch.Tensor:
        """Run one micro-batch; step the optimiser every ``grad_accum`` calls. Returns the detached loss."""
        inputs, targets = split_batch(batch, self.input_key, self.target_key)
        if self._no_sync is None and _is_empty(inputs):
            # every sample of the batch was skipped (DecodeImages(on_error="skip") on a batch of bad images): a step
            # on it would move the weights by weight decay and momentum alone and count as a step. Under DDP the
            # step runs (all ranks must join the gradient all-reduce); this rank's gradients are zeros.
            self.empty_batches += 1
            return torch.full((), float("nan"), device=self.device)
        inputs = prepare(inputs, self.device, self.input_dtype)
        targets = prepare(targets, self.device, None)
        if not unwrap(self.model).training:  # after model.eval() (evaluate restores the mode itself); a model in
            self.model.train()  # train mode is left as it is, so submodules the user put in eval() (frozen BN) stay so
        last = self._micro + 1 == self.options.grad_accum
        with self._rng:
            if last or self._no_sync is None:
                loss = self._forward_backward(inputs, targets)
            else:
                with self._no_sync():  # DDP: accumulate locally, all-reduce on the last micro-step only
                    loss = self._forward_backward(inputs, targets)
        self._micro += 1
        if last:
            self._step()
        return loss.detach()

    def _forward_backward(self, inputs: Any, targets: Any) -> torch.Tensor:
        with autocast(self.precision, self.device):
            loss = self.loss_fn(self.model(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # a shape check: no sync
            got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor (e.g. the batch mean), got {got}")
        scaled = loss / self.options.grad_accum if self.options.grad_accum > 1 else loss
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        return loss

    def _step(self) -> None:
        try:
            self._clip_and_step()
        except BaseException:
            # A failed step (an error in the optimiser or in clipping, Ctrl-C) ends the accumulation: without this
            # the micro-batch count stayed at grad_accum, no later call was ever the last one, and the optimiser
            # never stepped again while gradients piled up (and state_dict() could not be loaded back).
            self.optimizer.zero_grad(set_to_none=True)
            self._micro = 0
            if self.scaler is not None:  # a scaler left between unscale_/step and update() refuses the next step
                fresh = torch.amp.GradScaler(self.device.type)
                fresh.load_state_dict(self.scaler.state_dict())
                self.scaler = fresh
            raise
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        self.steps += 1

    def _clip_and_step(self) -> None:
        if self.options.clip_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            # scales by a clamped coefficient computed on the device: no host sync
            torch.nn.utils.clip_grad_norm_(params, self.options.clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            before = self.scaler._scale.clone() if isinstance(self.scaler._scale, torch.Tensor) else None
            self.scaler.update()
            if before is not None:  # update() backs the scale off after an overflow, whose step it skipped
                skipped = (self.scaler._scale < before).to(torch.int64)  # on the device: no sync
                self._skipped = skipped if self._skipped is None else self._skipped + skipped
        else:
            self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        """Scaler state and counters (model and optimizer state are saved by their owners, or
        all together by :func:`fastdata.save_checkpoint`)."""
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "micro": self._micro, "steps": self.steps, "rng": self._rng.state_dict(),
                "skipped_steps": self.skipped_steps}

    def check_state_dict(self, state: Any) -> None:
        """ValueError naming the field if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        if not isinstance(state, Mapping) or not {"scaler", "micro", "steps", "rng"} <= state.keys():
            # another object's state (a loader's, say) was taken as zero counters
            got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"state must be a TrainStep.state_dict() (scaler, micro, steps, rng), got {got}")
        micro, steps, rng = state["micro"], state["steps"], state["rng"]
        skipped = state.get("skipped_steps", 0)  # absent from states saved before it was counted
        for name, value in (("micro", micro), ("steps", steps), ("skipped_steps", skipped)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"state has {name}={value!r}; expected an int >= 0")
        if not micro < self.options.grad_accum:
            raise ValueError(f"state has micro={micro}, out of range for grad_accum={self.options.grad_accum}")
        if rng is not None:
            self._rng.check_state_dict(rng)
        scaler = state["scaler"]
        if self.scaler is not None and scaler is not None:  # loaded when given: a damaged [] or 0 is no "None"
            _check_scaler_state(self.scaler, scaler)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked whole by :meth:`check_state_dict` before anything is restored)."""
        self.check_state_dict(state)
        micro, steps, rng = state["micro"], state["steps"], state["rng"]
        skipped = state.get("skipped_steps", 0)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._micro = micro
        self.steps = steps
        self._skipped = torch.tensor(skipped, device=self.device) if skipped else None
        if rng is not None:
            self._rng.load_state_dict(rng)


# GradScaler.state_dict()'s entries and what each must be for load_state_dict() (which checks none of them)
_SCALER_FLOATS = ("scale", "growth_factor", "backoff_factor")
_SCALER_INTS = ("growth_interval", "_growth_tracker")


def _check_scaler_state(scaler: torch.amp.GradScaler, state: Any) -> None:
    """ValueError if ``scaler.load_state_dict(state)`` would refuse ``state`` or take in values of the wrong type
    (a ``scale`` of ``"x"`` was loaded as it is, or failed in ``fill_`` half way through a restore)."""
    keys = set(scaler.state_dict())
    if not isinstance(state, Mapping) or not keys <= set(state):
        raise ValueError(f"state has scaler={state!r:.80}; expected a GradScaler state with {sorted(keys)}")
    if not keys:  # a disabled scaler: its load_state_dict() loads nothing
        return
    for name in _SCALER_FLOATS:
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"state has scaler[{name!r}]={value!r:.80}; expected a finite float")
    for name in _SCALER_INTS:
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"state has scaler[{name!r}]={value!r:.80}; expected an int >= 0")


class _RngStream:
    """A private copy of torch's CPU (and one CUDA device's) generator state, entered as a context."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        self.cpu_state = torch.get_rng_state()
        self.cuda_state = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None
        self._outer: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __enter__(self) -> None:
        self._outer = (torch.get_rng_state(), torch.cuda.get_rng_state(self.cuda) if self.cuda else None)
        torch.set_rng_state(self.cpu_state)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda_state, self.cuda)

    def __exit__(self, *exc: object) -> None:
        outer, self._outer = self._outer, None
        assert outer is not None  # entered once at a time (not re-entrant)
        self.cpu_state = torch.get_rng_state()
        torch.set_rng_state(outer[0])
        if self.cuda is not None:
            self.cuda_state = torch.cuda.get_rng_state(self.cuda)
            torch.cuda.set_rng_state(outer[1], self.cuda)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": self.cpu_state.clone()}
        if self.cuda_state is not None:
            state["cuda"] = self.cuda_state.clone()
        return state

    def check_state_dict(self, state: Any) -> None:
        """ValueError if :meth:`load_state_dict` would refuse ``state`` (or store a generator state that
        ``torch.set_rng_state`` refuses at the next step); changes nothing."""
        cpu = state.get("cpu") if isinstance(state, Mapping) else None
        if not _is_generator_state(cpu, self.cpu_state):
            raise ValueError(f"state has rng={state!r:.80}; expected the random stream's {{'cpu': tensor, ...}}")
        cuda = state.get("cuda")
        # loaded only on a CUDA device (a CPU run ignores it), but a value that is no generator state is damage
        if cuda is not None and not _is_generator_state(cuda, self.cuda_state):
            raise ValueError(f"state has rng['cuda']={cuda!r:.80}; expected a CUDA generator state (a uint8 tensor"
                             + (f" of shape {tuple(self.cuda_state.shape)})" if self.cuda_state is not None else ")"))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cpu_state = state["cpu"].clone()
        if self.cuda is not None and state.get("cuda") is not None:
            self.cuda_state = state["cuda"].clone()


def _is_generator_state(value: Any, like: torch.Tensor | None) -> bool:
    """``value`` is a generator state: a 1-d uint8 tensor, of the shape of ``like`` when there is one."""
    return (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
            and (like is None or value.shape == like.shape))
