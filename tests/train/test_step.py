"""TrainStep: one AMP step per batch, accumulation, clipping, precision and casts, DDP's no_sync, the
step's random stream, failed steps and empty batches."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata.train import TrainStep, resolve_precision
from tests.helpers.models import conv_model, linear_and_batches, linear_step


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
    m2 = _model()
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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_normalize_dtype_trains_on_cpu(precision, dtype):
    from fastdata.gpu import Normalize

    g = torch.Generator().manual_seed(0)
    batch = {"jpg": torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8, generator=g),
             "cls": torch.randint(0, 4, (6,), generator=g)}
    batch = Normalize(keys=["jpg"], dtype=dtype)(batch)
    model = conv_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                     precision=precision, input_key="jpg", target_key="cls")
    assert step.input_dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    losses = [step(batch) for _ in range(3)]
    assert all(torch.isfinite(x) for x in losses)
    assert losses[-1].dtype == torch.float32 or precision == "bf16"


def test_half_precision_model_gets_half_inputs_and_ints_stay_ints():
    torch.manual_seed(0)
    emb = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(12, 1)).to(torch.bfloat16)
    seen = []
    emb.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    step = TrainStep(emb, torch.optim.SGD(emb.parameters(), lr=0.1),
                     lambda out, y: torch.nn.functional.mse_loss(out.float(), y))
    step((torch.randint(0, 10, (5, 3)), torch.randn(5, 1)))
    assert seen == [torch.int64]  # token ids are not cast
    lin = torch.nn.Linear(3, 1).to(torch.bfloat16)
    step = TrainStep(lin, torch.optim.SGD(lin.parameters(), lr=0.1),
                     lambda out, y: torch.nn.functional.mse_loss(out.float(), y))
    assert step.input_dtype == torch.bfloat16
    assert torch.isfinite(step((torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1))))


def test_nested_inputs_are_cast():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.a(x["a"]) + self.b(x["b"])

    model = Two()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    loss = step(({"a": torch.randn(4, 2, dtype=torch.bfloat16), "b": torch.randn(4, 3, dtype=torch.float16)},
                 torch.randn(4, 1)))
    assert torch.isfinite(loss)


class _FakeDDP(torch.nn.Module):
    """Exposes ``module`` and ``no_sync()`` like DistributedDataParallel and records its use."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.syncing = True
        self.log = []

    def forward(self, x):
        self.log.append(self.syncing)
        return self.module(x)

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True
        return ctx()


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_no_sync_on_all_but_the_last_micro_step(grad_accum):
    x, y = _problem()
    ddp = _FakeDDP(_model())
    step = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                     grad_accum=grad_accum)
    for _ in range(2 * grad_accum):
        step((x, y))
    assert ddp.log == ([False] * (grad_accum - 1) + [True]) * 2
    assert step.steps == 2


def test_real_ddp_gloo_skips_allreduce_until_the_last_micro_step(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x, y = _problem()
        ddp = DistributedDataParallel(_model())
        flags = []
        ddp.module.register_forward_pre_hook(lambda m, a: flags.append(ddp.require_backward_grad_sync))
        step = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), torch.nn.functional.mse_loss, grad_accum=2)
        ref_model = _model()
        ref = TrainStep(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
        for _ in range(2):
            step((x[:32], y[:32]))
            step((x[32:], y[32:]))
            ref((x, y))
        assert flags == [False, True, False, True]
        for p1, p2 in zip(ddp.module.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)
    finally:
        ddp = step = None  # the hook's closure holds ddp in a cycle: collect it here, with gloo alive,
        gc.collect()  # not in a later test's forked process (where its teardown hangs)
        dist.destroy_process_group()


def test_tf32_is_a_cuda_setting_and_leaves_the_cpu_alone(restore_tf32):
    from fastdata.train._precision import enable_tf32

    before = torch.get_float32_matmul_precision()
    model = _model()
    TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, tf32=True)
    assert torch.get_float32_matmul_precision() == before  # CPU model: oneDNN precision untouched
    try:
        enable_tf32(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)
    with pytest.raises(ValueError, match="tf32 must be a bool, got 1"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, tf32=1)


def test_dropout_draws_from_the_step_stream_not_the_global_one():
    x, y = _problem()

    def run(disturb: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.functional.mse_loss)
        out = []
        for _ in range(4):
            if disturb:
                torch.rand(7)  # e.g. a DataLoader drawing its worker seed
            out.append(step((x, y)).item())
        return out

    assert run(False) == run(True)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_train_step_makes_no_host_sync(precision, restore_tf32):
    from fastdata.gpu import Normalize

    model = conv_model().cuda().to(memory_format=torch.channels_last)
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.nn.functional.cross_entropy,
                     precision=precision, grad_accum=2, clip_norm=1.0, tf32=True, input_key="jpg", target_key="cls")
    g = torch.Generator().manual_seed(0)
    host = {"jpg": torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=g),
            "cls": torch.randint(0, 4, (16,), generator=g)}
    batch = Normalize(keys=["jpg"], dtype=torch.bfloat16, channels_last=True)(
        {k: v.cuda() for k, v in host.items()})
    for _ in range(4):  # warm-up: lazy optimizer state, cuDNN plans
        step(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(batch) for _ in range(6)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.steps == 5
    assert torch.isfinite(torch.stack(losses)).all().item()


def _ddp_worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fastdata.train import evaluate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        x, y = _problem(seed=rank)  # each rank its own data
        ddp = DistributedDataParallel(_model())
        step = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), torch.nn.functional.mse_loss, grad_accum=2)
        step((x[:32], y[:32]))
        local = torch.cat([p.grad.flatten() for p in ddp.module.parameters()])  # after a no_sync micro-step
        step((x[32:], y[32:]))
        params = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
        n = 4 + 2 * rank  # uneven batches: 4 and 6 samples
        res = evaluate(ddp.module, [(x[:n], y[:n])], loss_fn=torch.nn.functional.mse_loss, metrics={})
        torch.save({"local": local, "params": params, "eval": res, "x": x, "y": y}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_ddp_no_sync_and_evaluate_allreduce(tmp_path):
    import multiprocessing as mp

    # not fork: the test process has threads of earlier tests (a forked child can inherit a held lock)
    ctx = mp.get_context("forkserver")
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, str(tmp_path / "store"), str(tmp_path / f"r{r}.pt")))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in range(2))
    assert not torch.allclose(r0["local"], r1["local"])  # no all-reduce on the first micro-step
    torch.testing.assert_close(r0["params"], r1["params"])  # ... but on the last one
    model = _model()  # the global mean of the evaluation, from the same parameters on one process
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(r0["params"], model.parameters())
        sq = torch.cat([(model(r["x"][:n]) - r["y"][:n]).pow(2).mean(1) for r, n in ((r0, 4), (r1, 6))])
    assert r0["eval"]["samples"] == r1["eval"]["samples"] == 10
    assert r0["eval"]["loss"] == pytest.approx(r1["eval"]["loss"])
    # evaluate weights each rank's mean loss by its batch size: sum of squares over 10 samples
    assert r0["eval"]["loss"] == pytest.approx(sq.sum().item() / 10, rel=1e-5)


class _FailOnce(Exception):
    pass


def _flaky_sgd(model, fail_on=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    step = opt.step

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == fail_on:
            raise _FailOnce("optimizer step failed")
        return step(*a, **k)

    opt.step = flaky
    return opt, calls


def test_trainstep_recovers_from_a_failed_optimizer_step():
    # The micro-batch count stayed at grad_accum after the optimiser raised: no later call was ever the
    # last of an accumulation, so the optimiser never stepped again and gradients piled up for good.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt, calls = _flaky_sgd(model)
    step = fastdata.TrainStep(model, opt, torch.nn.functional.cross_entropy, grad_accum=2)
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    step(batch)
    with pytest.raises(_FailOnce):
        step(batch)
    assert step.micro_step == 0 and step.steps == 0
    assert all(p.grad is None for p in model.parameters())  # the failed accumulation's gradients are dropped
    for _ in range(4):
        step(batch)
    assert step.steps == 2 and len(calls) == 3 and step.micro_step == 0
    step.load_state_dict(step.state_dict())  # it refused micro=6 for grad_accum=2


def test_trainstep_failed_step_leaves_the_grad_scaler_usable():
    # with clipping the scaler unscales before the optimiser step; a failure there left it "already unscaled"
    model = torch.nn.Linear(4, 3)
    opt, calls = _flaky_sgd(model)
    step = fastdata.TrainStep(model, opt, torch.nn.functional.cross_entropy, clip_norm=1.0)
    step.scaler = torch.amp.GradScaler("cpu")  # fp16 needs CUDA: the same code path with a CPU scaler
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    with pytest.raises(_FailOnce):
        step(batch)
    assert torch.isfinite(step(batch)) and step.steps == 1 and len(calls) == 2


def test_trainstep_and_evaluate_keep_a_frozen_batchnorm_in_eval_mode():
    # fine-tuning with frozen BatchNorm statistics (model.train(); bn.eval()): every step called model.train(),
    # which put the BatchNorm back in train mode and updated its running statistics; evaluate restored only
    # the top-level mode, which did the same
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    model.train()
    model[1].eval()
    frozen = model[1].running_mean.clone()
    step = fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)
    batch = (torch.randn(8, 4) + 5, torch.randint(0, 3, (8,)))
    step(batch)
    assert model.training and not model[1].training and torch.equal(model[1].running_mean, frozen)
    fastdata.evaluate(model, [batch])
    assert model.training and not model[1].training and model[0].training
    model.eval()  # a model left in eval() mode as a whole is still trained in train() mode
    step(batch)
    assert model.training and model[1].training


@pytest.mark.parametrize("kwargs, match", [
    (dict(compile="no"), "compile must be a bool"),  # 'no' compiled the model
    (dict(input_key=None), "input_key must be a str"),
    (dict(target_key=["cls"]), "target_key must be a str"),
])
def test_trainstep_checks_compile_and_keys(kwargs, match):
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=match):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy, **kwargs)


@pytest.mark.parametrize("state, match", [
    ({}, r"state must be a TrainStep.state_dict\(\) \(scaler, micro, steps, rng\), got \[\]"),  # zeroed the counters
    ({"epoch": 1, "positions": [3]}, "state must be a TrainStep.state_dict"),  # a loader's state, taken silently
    (None, "state must be a TrainStep.state_dict.*got NoneType"),  # an AttributeError
    ({"scaler": None, "micro": 0, "steps": "x", "rng": None}, "state has steps='x'"),  # int('x')
    ({"scaler": None, "micro": 0, "steps": "5", "rng": None}, "state has steps='5'"),  # taken as 5
    ({"scaler": None, "micro": 0, "steps": 1, "rng": {"gpu": 1}}, "state has rng="),
])
def test_trainstep_load_state_dict_refuses_another_objects_state(state, match):
    step = linear_step()
    step.steps = 7
    with pytest.raises(ValueError, match=match):
        step.load_state_dict(state)
    assert step.steps == 7  # nothing restored


def test_trainstep_does_not_step_on_an_empty_batch():
    import math

    import torch

    from fastdata import TrainStep

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    step = TrainStep(model, opt, torch.nn.functional.cross_entropy, precision="fp32")
    before = [p.detach().clone() for p in model.parameters()]
    # every image of the batch skipped by DecodeImages(on_error="skip"): weight decay moved the weights, and it
    # counted as a step
    loss = step({"input": torch.zeros(0, 4), "target": torch.zeros(0, dtype=torch.long)})
    assert math.isnan(float(loss))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (step.steps, step.micro_step, step.empty_batches) == (0, 0, 1)
    assert not opt.state  # no Adam moments started either
    step({"input": torch.randn(2, 4), "target": torch.tensor([0, 1])})
    assert (step.steps, step.empty_batches) == (1, 1)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_trainstep_counts_the_steps_a_grad_scaler_skipped():
    import torch

    from fastdata import TrainStep

    model = torch.nn.Linear(2, 2)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                     precision="fp32")
    step.scaler = torch.amp.GradScaler("cpu")  # fp16 is CUDA only; the scaler's bookkeeping is the same on the CPU
    good = {"input": torch.ones(2, 2), "target": torch.tensor([0, 1])}
    step(good)
    step({"input": torch.full((2, 2), float("inf")), "target": torch.tensor([0, 1])})  # overflow: step skipped
    step(good)
    assert (step.steps, step.skipped_steps) == (3, 1)
    state = step.state_dict()
    assert state["skipped_steps"] == 1
    again = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                      precision="fp32")
    again.load_state_dict(state)
    assert (again.steps, again.skipped_steps) == (3, 1)
    del state["skipped_steps"]  # a state saved before the count existed
    again.load_state_dict(state)
    assert again.skipped_steps == 0


def test_trainstep_loss_fn_returning_per_sample_values_is_named():
    model, batches = linear_and_batches()
    per_sample = lambda out, target: torch.nn.functional.cross_entropy(out, target, reduction="none")  # noqa: E731
    step = fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor.*shape \(8,\)"):
        step(batches[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was stepped
    assert step.micro_step == 0 and model.weight.grad is None
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor.*got float"):
        fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda o, t: 1.0)(batches[0])
