"""load_checkpoint is atomic: a checkpoint that does not fit is a CheckpointError and restores nothing."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fastdata
from fastdata import CheckpointError
from tests.helpers.shards import make_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("atomic") / "s", 8, 4, key="k{i:02d}", cls="int")


def _step(width: int = 4, groups: int = 1, grad_accum: int = 2) -> fastdata.TrainStep:
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 3))
    params = list(model.parameters())
    param_groups = [{"params": params}] if groups == 1 else [{"params": params[:2]}, {"params": params[2:]}]
    return fastdata.TrainStep(model, torch.optim.SGD(param_groups, lr=0.1, momentum=0.9),
                              torch.nn.functional.cross_entropy, grad_accum=grad_accum)


def _train(step: fastdata.TrainStep, n: int) -> None:
    torch.manual_seed(1)
    for _ in range(n):
        step((torch.randn(5, 4), torch.randint(0, 3, (5,))))


def _snapshot(step: fastdata.TrainStep, loader: Any) -> Any:
    return (copy.deepcopy(step.module.state_dict()), copy.deepcopy(step.optimizer.state_dict()),
            {k: v for k, v in step.state_dict().items() if k != "rng"}, step.state_dict()["rng"]["cpu"].clone(),
            loader.state_dict() if loader is not None else None)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _loader(shards, seed: int = 0) -> fastdata.DataLoader:
    loader = fastdata.DataLoader(fastdata.ShardedDataset(shards, shuffle=True, seed=seed), batch_size=2)
    it = iter(loader)
    next(it)  # a position of its own: a failed load must keep it
    return loader


@pytest.mark.parametrize(("target", "match"), [
    (dict(width=5), r"model entry '0.weight' is \(4, 4\) in the checkpoint, \(5, 4\) here"),
    (dict(groups=2), "1 optimizer parameter groups in the checkpoint, 2 here"),
    (dict(grad_accum=1), "micro=1, out of range for grad_accum=1"),
    (dict(seed=3), "seed=0 in the state, 3 here"),
])
def test_a_checkpoint_that_does_not_fit_restores_nothing(shards, tmp_path, target, match):
    saved = _step()
    _train(saved, 3)  # mid-accumulation: gradients and micro=1 in the file
    fastdata.save_checkpoint(tmp_path / "c.pt", saved, loader=_loader(shards), epoch=1)
    seed = target.pop("seed", 0)
    step = _step(**target)
    _train(step, 2)  # a state of its own, which a failed load must keep
    loader = _loader(shards, seed=seed)
    before = _snapshot(step, loader)
    grads = [None if p.grad is None else p.grad.clone() for p in step.module.parameters()]
    with pytest.raises(CheckpointError, match=match):
        fastdata.load_checkpoint(tmp_path / "c.pt", step, loader=loader)
    assert _equal(_snapshot(step, loader), before)
    assert _equal([p.grad for p in step.module.parameters()], grads)


def test_a_loader_without_check_state_dict_is_loaded_first(tmp_path):
    """A loader that can only refuse by loading: loaded before anything else, so its refusal (any error
    of its load) is a CheckpointError with the model, optimizer and step untouched."""

    class Strict:
        def state_dict(self) -> dict[str, int]:
            return {"position": 3}

        def load_state_dict(self, state: dict[str, int]) -> None:
            raise KeyError("position")  # e.g. torchdata's StatefulDataLoader given another loader's state

    step = _step()
    fastdata.save_checkpoint(tmp_path / "c.pt", step, loader=Strict())
    fresh = _step()
    before = _snapshot(fresh, None)
    with pytest.raises(CheckpointError, match="the loader state does not fit this loader: 'position'"):
        fastdata.load_checkpoint(tmp_path / "c.pt", fresh, loader=Strict())
    assert _equal(_snapshot(fresh, None), before)


def _damaged(tmp_path, saved: fastdata.TrainStep, damage) -> Any:
    """Save ``saved`` mid-accumulation, then rewrite the file with ``damage(payload)`` applied."""
    path = fastdata.save_checkpoint(tmp_path / "c.pt", saved, epoch=1)
    payload = torch.load(path, weights_only=True)
    damage(payload)
    torch.save(payload, path)
    return path


def _refused_untouched(path, step: fastdata.TrainStep, match: str) -> None:
    before = _snapshot(step, None)
    state = step.state_dict()
    grads = [None if p.grad is None else p.grad.clone() for p in step.module.parameters()]
    with pytest.raises(CheckpointError, match=match):
        fastdata.load_checkpoint(path, step)
    assert _equal(_snapshot(step, None), before)
    assert _equal(step.state_dict(), state)  # the scaler and the whole random stream too
    assert _equal([p.grad for p in step.module.parameters()], grads)


def _cuda_stream(step: fastdata.TrainStep, monkeypatch) -> None:
    """Give a CPU step's random stream a CUDA generator state, as a step on a GPU has (only the state is
    used here: the step is saved and loaded, never run)."""
    monkeypatch.setattr(step._rng, "cuda", torch.device("cuda", 0))
    monkeypatch.setattr(step._rng, "cuda_state", torch.randint(0, 256, (16,), dtype=torch.uint8))


@pytest.mark.parametrize(("bad", "match"), [
    ([1, 2, 3], r"rng\['cuda'\]=\[1, 2, 3\]; expected a CUDA generator state"),
    (torch.zeros(5, dtype=torch.uint8), r"rng\['cuda'\]=.*a uint8 tensor of shape \(16,\)"),
    (torch.zeros(16, dtype=torch.int64), r"rng\['cuda'\]=.*expected a CUDA generator state"),
])
def test_a_damaged_cuda_random_state_restores_nothing(tmp_path, monkeypatch, bad, match):
    saved = _step()
    _train(saved, 3)
    _cuda_stream(saved, monkeypatch)

    def damage(payload):
        assert payload["train_step"]["rng"]["cuda"].shape == (16,)
        payload["train_step"]["rng"]["cuda"] = bad
        payload["model"]["0.weight"] = torch.full((4, 4), 9.0)
        payload["train_step"]["steps"] = 7

    path = _damaged(tmp_path, saved, damage)
    step = _step()
    _train(step, 2)
    _cuda_stream(step, monkeypatch)
    _refused_untouched(path, step, match)


def test_the_cuda_random_state_is_restored(tmp_path, monkeypatch):
    saved = _step()
    _cuda_stream(saved, monkeypatch)
    path = fastdata.save_checkpoint(tmp_path / "c.pt", saved)
    step = _step()
    _cuda_stream(step, monkeypatch)
    fastdata.load_checkpoint(path, step)
    assert torch.equal(step._rng.cuda_state, saved._rng.cuda_state)


def _scaled(step: fastdata.TrainStep) -> fastdata.TrainStep:
    """A CPU stand-in for fp16's GradScaler (enabled, its scale already a tensor, as after a first step)."""
    step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    step.scaler.scale(torch.ones(1))
    return step


@pytest.mark.parametrize(("entry", "bad", "match"), [
    ("scale", "x", r"scaler\['scale'\]='x'; expected a finite float"),
    ("scale", float("nan"), r"scaler\['scale'\]=nan; expected a finite float"),
    ("growth_factor", [2.0], r"scaler\['growth_factor'\]=\[2.0\]; expected a finite float"),
    ("growth_interval", 2.5, r"scaler\['growth_interval'\]=2.5; expected an int >= 0"),
    ("_growth_tracker", True, r"scaler\['_growth_tracker'\]=True; expected an int >= 0"),
    ("_growth_tracker", torch.tensor(3), r"scaler\['_growth_tracker'\]=tensor\(3\); expected an int >= 0"),
])
def test_a_damaged_scaler_state_restores_nothing(tmp_path, entry, bad, match):
    saved = _scaled(_step())
    _train(saved, 3)

    def damage(payload):
        assert entry in payload["train_step"]["scaler"]
        payload["train_step"]["scaler"][entry] = bad
        payload["train_step"]["steps"] = 7

    path = _damaged(tmp_path, saved, damage)
    step = _scaled(_step())
    _train(step, 2)
    _refused_untouched(path, step, match)


@pytest.mark.parametrize("bad", [[], 0, ""])
def test_a_falsy_scaler_state_is_not_taken_for_none(tmp_path, bad):
    saved = _scaled(_step())

    def damage(payload):
        payload["train_step"]["scaler"] = bad

    path = _damaged(tmp_path, saved, damage)
    _refused_untouched(path, _scaled(_step()), "expected a GradScaler state with")


def test_the_scaler_state_is_restored(tmp_path):
    saved = _scaled(_step())
    saved.scaler.update(new_scale=8.0)
    path = fastdata.save_checkpoint(tmp_path / "c.pt", saved)
    step = _scaled(_step())
    fastdata.load_checkpoint(path, step)
    assert step.scaler.state_dict() == saved.scaler.state_dict()
    assert step.scaler.get_scale() == 8.0


@pytest.mark.parametrize("bad", [[], 0, (), ""])
def test_damaged_falsy_gradients_are_not_taken_for_none(tmp_path, bad):
    saved = _step()
    _train(saved, 3)  # mid-accumulation: the file holds gradients

    def damage(payload):
        assert payload["grads"]
        payload["grads"] = bad

    path = _damaged(tmp_path, saved, damage)
    step = _step()
    _train(step, 1)
    _refused_untouched(path, step, "the accumulated gradients are a .*, not a mapping")


def test_a_refusal_no_check_foresees_names_what_was_restored(tmp_path):
    """A module whose own load hook refuses after every check passed: a CheckpointError that says the
    objects may be partly restored, not a bare error nor one that claims nothing was restored."""
    saved = _step()
    path = fastdata.save_checkpoint(tmp_path / "c.pt", saved)
    step = _step()

    def refuse(*args):
        raise TypeError("this module refuses")

    step.module[1]._register_load_state_dict_pre_hook(refuse)
    with pytest.raises(CheckpointError, match=r"restoring the model failed \(TypeError: this module refuses\); "
                                              r"the objects given to load_checkpoint may be partly restored"):
        fastdata.load_checkpoint(path, step)
