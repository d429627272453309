import copy

import pytest
import torch

from fastdata.train import TrainStep, resolve_precision


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, x @ w


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def test_loss_decreases_and_returns_detached_tensor():
    x, y = _problem()
    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.functional.mse_loss)
    first = step((x, y))
    for _ in range(50):
        last = step((x, y))
    assert isinstance(last, torch.Tensor) and not last.requires_grad
    assert last.item() < 0.5 * first.item()
    assert step.steps == 51


def test_grad_accum_matches_one_big_batch():
    x, y = _problem()
    m1, m2 = _model(), _model()
    s1 = TrainStep(m1, torch.optim.SGD(m1.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    s2 = TrainStep(m2, torch.optim.SGD(m2.parameters(), lr=0.1), torch.nn.functional.mse_loss, grad_accum=2)
    s1((x, y))
    s2((x[:32], y[:32]))
    assert s2.steps == 0  # no optimiser step after the first micro-batch
    s2((x[32:], y[32:]))
    assert s2.steps == 1
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)


def test_clip_norm_bounds_the_update():
    x, y = _problem()
    y = y * 1000  # huge gradients
    m1, m2 = _model(), _model()
    before = copy.deepcopy(list(m2.parameters()))
    TrainStep(m2, torch.optim.SGD(m2.parameters(), lr=1.0), torch.nn.functional.mse_loss, clip_norm=0.5)((x, y))
    delta = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(m2.parameters(), before)))
    assert delta.item() == pytest.approx(0.5, rel=1e-4)  # lr 1 x clipped grad norm 0.5


def test_dict_batches_and_bf16_on_cpu():
    x, y = _problem()
    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.functional.mse_loss,
                     precision="bf16", input_key="img", target_key="cls")
    loss = step({"img": x, "cls": y, "__key__": ["a"] * 64})
    assert torch.isfinite(loss)
    with pytest.raises(KeyError, match="no key"):
        step({"input": x})


@pytest.mark.parametrize("kwargs, match", [
    ({"precision": "fp8"}, "precision must be one of"),
    ({"grad_accum": 0}, "grad_accum must be an int >= 1, got 0"),
    ({"grad_accum": True}, "grad_accum must be an int >= 1, got True"),
    ({"clip_norm": -1.0}, "clip_norm must be a number > 0 or None, got -1.0"),
    ({"clip_norm": "1"}, "clip_norm must be a number > 0 or None, got '1'"),
    ({"clip_norm": float("nan")}, "clip_norm must be a number > 0 or None, got nan"),
    ({"precision": "fp16"}, "needs a CUDA device"),
])
def test_bad_options_name_the_argument(kwargs, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, **kwargs)


def test_auto_precision_is_fp32_on_cpu():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"


@pytest.mark.cuda
def test_fp16_with_scaler_on_cuda():
    x, y = _problem()
    model = _model().cuda()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.functional.mse_loss,
                     precision="fp16", clip_norm=1.0)
    losses = [step((x.cuda(), y.cuda())) for _ in range(30)]
    assert losses[-1].item() < losses[0].item()
