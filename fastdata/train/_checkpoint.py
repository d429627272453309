"""Checkpoints that resume a run exactly: model, optimizer, scaler, step counters, the loader's
position, the step's random stream (dropout masks) and (mid-accumulation) the gradients accumulated so far, in one file.

The loader state comes from ``loader.state_dict()``: for a :class:`fastdata.CUDAPrefetcher` that
is the wrapped ``fastdata.DataLoader``'s position as of the last batch handed to the training loop
(not of the batches read ahead), so a resumed run continues with exactly the next batch. The file
is written to a temporary name, flushed to disk and renamed over ``path``, so a crash while saving
leaves the previous checkpoint intact. It is loaded with ``torch.load(weights_only=True)``: it holds
only tensors and plain Python values, and loading never runs code from the file.

Under DDP every rank holds the same model and optimizer; the loader positions differ per rank.
Gather every rank's ``batches.state_dict()`` (``torch.distributed.all_gather_object``) and let rank
0 save them with ``loader_state=states``; every rank then loads the same file, and
``fastdata.DataLoader`` resumes from the list at any world size (``examples/train_ddp.py``).
"""
from __future__ import annotations

import io
import os
import pickle
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastdata.errors import FastdataError
from fastdata.train._step import TrainStep, unwrap

FORMAT = "fastdata-checkpoint"
VERSION = 1


class CheckpointError(FastdataError, ValueError):
    """A checkpoint file is missing, not a fastdata checkpoint, or does not fit what it is loaded into."""


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`load_checkpoint` restored besides the objects it was given."""

    path: Path
    steps: int  # optimiser steps taken before the checkpoint
    epoch: int | None  # the ``epoch=`` given to save_checkpoint
    extra: dict[str, Any] = field(default_factory=dict)


# leaves torch.load(weights_only=True) always reads back (exact types: np.float64 is a float, and
# unreadable); any other leaf is tried on its own
_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _check_readable(name: str, value: Any) -> None:
    """Refuse a value :func:`load_checkpoint` could not read back (``torch.load(weights_only=True)``),
    naming where it sits: found at saving, not when resuming. Tensors are not copied."""
    if type(value) in _PLAIN or isinstance(value, torch.Tensor):
        return
    if type(value) in (dict, list, tuple, set, OrderedDict):  # not frozenset: weights_only refuses it
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict):
                _check_readable(f"{name} key {key!r}", key)
            _check_readable(f"{name}[{key!r}]" if isinstance(value, dict) else f"{name}[{key}]", item)
        return
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001  any reason it cannot be read back
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # torch's message is a page; its "WeightsUnpickler error: Unsupported global: ..." line says why
        reason = next((ln.split(". ")[0] for ln in lines if "Unsupported" in ln or "Unpickler" in ln),
                      lines[0] if lines else type(e).__name__)
        raise CheckpointError(
            f"{name} is a {type(value).__module__}.{type(value).__qualname__}, which load_checkpoint could not "
            f"read back (torch.load(weights_only=True): {reason}); store plain values instead "
            "(float(x), int(x), array.tolist(), torch.from_numpy(array), str(path))") from e


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


def save_checkpoint(
    path: str | os.PathLike[str],
    step: TrainStep,
    *,
    loader: Any = None,
    loader_state: Any = None,
    epoch: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write everything a run needs to continue exactly where it is now; returns the path.

    Args:
        path: the file to write (its folder is created; an existing file is replaced atomically).
        step: the :class:`TrainStep`: its model (unwrapped from DDP/``torch.compile``), optimizer,
            ``GradScaler``, counters, random stream and, between two optimiser steps, the
            accumulated gradients.
        loader: anything with ``state_dict()`` (a ``CUDAPrefetcher`` or ``fastdata.DataLoader``), or None.
        loader_state: instead of ``loader``, a loader state to store as it is (e.g. the list of every
            rank's ``state_dict()`` under DDP).
        epoch: the epoch being trained, returned by :func:`load_checkpoint` to restart the epoch loop.
        extra: more plain values or tensors to store (e.g. the learning-rate scheduler's state).

    A value in ``extra`` or ``loader_state`` that :func:`load_checkpoint` could not read back (NumPy
    arrays and scalars, paths, other objects) is a :class:`CheckpointError` naming where it sits,
    raised before anything is written.
    """
    if not isinstance(step, TrainStep):
        raise CheckpointError(f"step must be a fastdata.TrainStep, got {type(step).__name__}")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise CheckpointError(f"epoch must be an int >= 0 or None, got {epoch!r}")
    if loader is not None and loader_state is not None:
        raise CheckpointError("pass loader= or loader_state=, not both")
    if extra is not None and not isinstance(extra, Mapping):  # '' was saved as {}, 'x' failed in dict()
        raise CheckpointError(f"extra must be a mapping of name -> value or None, got {type(extra).__name__}")
    dest = Path(path)
    if dest.is_dir():  # else os.replace's IsADirectoryError, naming the temporary file
        raise CheckpointError(f"{dest} is a folder; path must name the checkpoint file")
    if loader is not None:
        fn = getattr(loader, "state_dict", None)
        if not callable(fn):
            raise CheckpointError(f"loader must have a state_dict() method, got {type(loader).__name__}")
        try:
            loader_state = fn()
        except TypeError as e:  # e.g. a CUDAPrefetcher over an iterable without state_dict()
            raise CheckpointError(f"cannot save the loader's position: {e}") from e
    if extra is not None:
        _check_readable("extra", dict(extra))
    _check_readable("loader_state", loader_state)
    module = unwrap(step.module)
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "model": module.state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "train_step": step.state_dict(),
        "grads": _grads(module) if step.micro_step else None,
        "loader": loader_state,
        "epoch": epoch,
        "extra": dict(extra) if extra is not None else {},
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


_PAYLOAD = ("model", "optimizer", "train_step", "grads", "loader", "epoch", "extra")
# what a loader's load_state_dict raises for a state it refuses, when it has no check_state_dict
_LOADER_REFUSALS = (ValueError, TypeError, KeyError, IndexError, RuntimeError, AttributeError)


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint: {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a fastdata checkpoint (written by save_checkpoint)")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {payload.get('version')!r}, this fastdata reads {VERSION}")
    missing = [k for k in _PAYLOAD if k not in payload]
    if missing:
        raise CheckpointError(f"{path}: a damaged checkpoint: it lacks {missing}")
    return payload


def _check_model(src: Path, module: torch.nn.Module, saved: Any) -> None:
    """The keys and tensor shapes ``module.load_state_dict(saved)`` would refuse."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{src}: the model state is a {type(saved).__name__}, not a state dict")
    mine = module.state_dict()
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise CheckpointError(f"{src}: does not fit this TrainStep: model keys missing from the checkpoint "
                              f"{missing[:5]}, keys this model lacks {unexpected[:5]}")
    for name, value in mine.items():
        if isinstance(value, torch.Tensor):
            theirs = saved[name]
            if not isinstance(theirs, torch.Tensor) or theirs.shape != value.shape:
                got = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
                raise CheckpointError(f"{src}: does not fit this TrainStep: model entry {name!r} is {got} in the "
                                      f"checkpoint, {tuple(value.shape)} here")


def _check_optimizer(src: Path, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """What ``optimizer.load_state_dict(saved)`` would refuse: its groups and their sizes."""
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= saved.keys() \
            or not isinstance(saved["param_groups"], list) or not isinstance(saved["state"], Mapping):
        raise CheckpointError(f"{src}: the optimizer state is not an optimizer's state_dict()")
    groups, theirs = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(theirs):
        raise CheckpointError(f"{src}: does not fit this TrainStep: {len(theirs)} optimizer parameter groups in "
                              f"the checkpoint, {len(groups)} here")
    ids = set()
    for i, (g, t) in enumerate(zip(groups, theirs)):
        params = t.get("params") if isinstance(t, Mapping) else None
        if not isinstance(params, list) or len(params) != len(g["params"]):
            size = len(params) if isinstance(params, list) else params
            raise CheckpointError(f"{src}: does not fit this TrainStep: optimizer parameter group {i} has "
                                  f"{size!r} parameters in the checkpoint, {len(g['params'])} here")
        ids.update(params)
    stray = [k for k in saved["state"] if k not in ids]
    if stray:
        raise CheckpointError(f"{src}: the optimizer state holds parameters of no group: {stray[:5]}")


def _check_grads(src: Path, module: torch.nn.Module, grads: Any) -> None:
    if grads is None:
        return
    params = dict(module.named_parameters())
    if not isinstance(grads, Mapping):
        raise CheckpointError(f"{src}: the accumulated gradients are a {type(grads).__name__}, not a mapping")
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise CheckpointError(f"{src}: gradients for parameters this model lacks: {unknown[:5]}")
    for name, g in grads.items():
        if not isinstance(g, torch.Tensor) or g.shape != params[name].shape:
            got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise CheckpointError(f"{src}: the gradient of {name!r} is {got}, the parameter "
                                  f"{tuple(params[name].shape)}")


def _check_loader(src: Path, loader: Any, state: Any) -> bool:
    """Check the loader state against ``loader`` (True), or, for a loader without ``check_state_dict``,
    load it now, first of all, so that a refusal leaves everything else untouched (False)."""
    check = getattr(loader, "check_state_dict", None)
    try:
        if callable(check):
            check(state)
            return True
        loader.load_state_dict(state)
    except _LOADER_REFUSALS as e:
        raise CheckpointError(f"{src}: the loader state does not fit this loader: {e}") from e
    return False


def load_checkpoint(
    path: str | os.PathLike[str],
    step: TrainStep,
    *,
    loader: Any = None,
) -> Checkpoint:
    """Restore a :func:`save_checkpoint` file into ``step`` (model, optimizer, scaler, counters,
    random stream, accumulated gradients) and ``loader``.

    Build the model, optimizer, ``TrainStep`` and loader as for a fresh run, then call this before
    the training loop; iterate from ``Checkpoint.epoch`` (its ``loader.set_epoch`` keeps the
    loaded position). A checkpoint saved with a loader state needs ``loader=``.

    Atomic: everything is read and checked first (model keys and shapes, optimizer groups, the
    ``TrainStep`` counters, scaler and random stream, gradients, the loader state against the loader),
    and any mismatch is a :class:`CheckpointError` raised before anything is restored.
    A refusal that no check can foresee (a custom module's own ``load_state_dict`` hooks) is a
    :class:`CheckpointError` too, naming what was restored before it: those objects are then partly
    restored and must be built afresh.
    """
    if not isinstance(step, TrainStep):
        raise CheckpointError(f"step must be a fastdata.TrainStep, got {type(step).__name__}")
    if loader is not None and not callable(getattr(loader, "load_state_dict", None)):  # before anything is restored
        raise CheckpointError(f"loader must have a load_state_dict() method, got {type(loader).__name__}")
    src = Path(path)
    payload = _read(src)
    if payload["loader"] is not None and loader is None:
        raise CheckpointError(f"{src}: the checkpoint holds a loader position; pass loader= to resume from it")
    if loader is not None and payload["loader"] is None:
        raise CheckpointError(f"{src}: the checkpoint holds no loader position (it was saved without loader=)")
    epoch, extra = payload["epoch"], payload["extra"]
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise CheckpointError(f"{src}: epoch={epoch!r}; expected an int >= 0 or None")
    if not isinstance(extra, Mapping):
        raise CheckpointError(f"{src}: extra is a {type(extra).__name__}, not a mapping")
    module = unwrap(step.module)
    _check_model(src, module, payload["model"])
    _check_optimizer(src, step.optimizer, payload["optimizer"])
    try:
        step.check_state_dict(payload["train_step"])
    except ValueError as e:
        raise CheckpointError(f"{src}: does not fit this TrainStep: {e}") from e
    _check_grads(src, module, payload["grads"])  # before any default: a damaged [] or 0 is not "no gradients"
    grads = {} if payload["grads"] is None else payload["grads"]
    # everything is checked: the loader first (its load can still refuse: a thread inside its next()),
    # then the rest, which nothing above found a reason to refuse
    if loader is not None and _check_loader(src, loader, payload["loader"]):
        try:
            loader.load_state_dict(payload["loader"])
        except _LOADER_REFUSALS as e:
            raise CheckpointError(f"{src}: the loader refused its state: {e}") from e
    restored = ["the loader"] if loader is not None else []
    for name, restore in (
        ("the model", lambda: module.load_state_dict(payload["model"])),
        ("the optimizer", lambda: step.optimizer.load_state_dict(payload["optimizer"])),
        ("the TrainStep's scaler, counters and random stream", lambda: step.load_state_dict(payload["train_step"])),
    ):
        try:
            restore()
        except Exception as e:  # checked above; a custom module's own hooks may still refuse
            before = f"{', '.join(restored)} had been restored before it, so " if restored else ""
            raise CheckpointError(
                f"{src}: restoring {name} failed ({type(e).__name__}: {e}); {before}the objects given to "
                "load_checkpoint may be partly restored: build them afresh before training or loading again") from e
        restored.append(name)
    for name, p in module.named_parameters():
        p.grad = grads[name].to(p.device, p.dtype) if name in grads else None
    return Checkpoint(path=src, steps=step.steps, epoch=epoch, extra=dict(extra))
