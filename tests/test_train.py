import copy
import gc
import time

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


# ----- inputs cast to the compute dtype (any Normalize dtype works on CPU and GPU) -------------------
def _conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_normalize_dtype_trains_on_cpu(precision, dtype):
    from fastdata.gpu import Normalize

    g = torch.Generator().manual_seed(0)
    batch = {"jpg": torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8, generator=g),
             "cls": torch.randint(0, 4, (6,), generator=g)}
    batch = Normalize(keys=["jpg"], dtype=dtype)(batch)
    model = _conv_model()
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


# ----- DDP: no gradient all-reduce on the micro-steps before the last ---------------------------------
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


# ----- tf32, random stream, evaluate ---------------------------------------------------------------------
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


def test_evaluate_means_over_uneven_batches_with_one_transfer(monkeypatch):
    from fastdata.train import evaluate, top_k

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    xs, ys = torch.randn(23, 5), torch.randint(0, 3, (23,))
    batches = [{"x": xs[i:i + 8], "y": ys[i:i + 8]} for i in range(0, 23, 8)]  # 8, 8, 7
    with torch.no_grad():
        logits = model(xs)
    want_loss = torch.nn.functional.cross_entropy(logits, ys).item()
    want_acc = (logits.argmax(1) == ys).float().mean().item()
    want_top2 = (logits.topk(2, dim=1).indices == ys[:, None]).any(1).float().mean().item()

    def no_item(self):
        raise AssertionError("evaluate must not read device values per batch")

    model.train()
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    res = evaluate(model, batches, loss_fn=torch.nn.functional.cross_entropy,
                   metrics={"acc": lambda o, t: (o.argmax(-1) == t).float(), "top2": top_k(2)},
                   input_key="x", target_key="y")
    monkeypatch.undo()
    assert model.training  # mode restored
    assert res["samples"] == 23
    assert res["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert res["acc"] == pytest.approx(want_acc) and res["top2"] == pytest.approx(want_top2)
    unreduced = lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="none")  # noqa: E731
    per_sample = evaluate(model, batches, loss_fn=unreduced, metrics={}, input_key="x", target_key="y")
    assert per_sample["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert evaluate(model, batches, input_key="x", target_key="y", max_batches=1)["samples"] == 8
    assert set(evaluate(model, batches, input_key="x", target_key="y")) == {"accuracy", "samples"}


def test_evaluate_through_a_prefetcher_with_a_normalize_transform():
    import fastdata
    from fastdata.gpu import Normalize
    from fastdata.train import evaluate

    model = _conv_model()
    g = torch.Generator().manual_seed(1)
    batches = [{"jpg": torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g),
                "cls": torch.randint(0, 4, (4,), generator=g)} for _ in range(3)]
    norm = Normalize(keys=["jpg"], dtype=torch.bfloat16)
    direct = evaluate(model, batches, transform=norm, input_key="jpg", target_key="cls")
    with fastdata.CUDAPrefetcher(batches, device="cpu", transform=norm) as pf:
        via = evaluate(model, pf, input_key="jpg", target_key="cls")
    assert direct == via and direct["samples"] == 12


def test_evaluate_starts_one_epoch_of_the_loader():
    from fastdata.train import evaluate

    class Loader:
        iters = 0

        def __iter__(self):
            Loader.iters += 1
            return iter([{"x": torch.randn(4, 5), "y": torch.zeros(4, dtype=torch.long)} for _ in range(3)])

    def slow(o, t):
        time.sleep(0.02)  # the prefetch thread reaches the end of the loader long before the last batch
        return (o.argmax(-1) == t).float()

    evaluate(torch.nn.Linear(5, 3), Loader(), metrics={"acc": slow}, input_key="x", target_key="y")
    assert Loader.iters == 1


def test_evaluate_rejects_bad_metrics():
    from fastdata.train import evaluate

    model = torch.nn.Linear(2, 2)
    batches = [(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))]
    with pytest.raises(ValueError, match=r"'bad' returned shape \(3,\)"):
        evaluate(model, batches, metrics={"bad": lambda o, t: torch.ones(3)})
    with pytest.raises(ValueError, match="metric names must differ"):
        evaluate(model, batches, loss_fn=torch.nn.functional.cross_entropy, metrics={"loss": lambda o, t: o})
    with pytest.raises(ValueError, match="metric names must differ"):
        evaluate(model, batches, metrics={"samples": lambda o, t: o})
    with pytest.raises(ValueError, match="'x' must return a tensor, got float"):
        evaluate(model, batches, metrics={"x": lambda o, t: 1.0})
    with pytest.raises(ValueError, match="the batches were empty"):
        evaluate(model, [])
    with pytest.raises(ValueError, match="max_batches must be an int >= 1 or None, got 0"):
        evaluate(model, batches, max_batches=0)


# ----- CUDA ------------------------------------------------------------------------------------------------
@pytest.fixture
def restore_tf32():
    """tf32=True changes process-wide flags: put them back for the tests that follow."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_train_step_makes_no_host_sync(precision, restore_tf32):
    from fastdata.gpu import Normalize

    model = _conv_model().cuda().to(memory_format=torch.channels_last)
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


@pytest.mark.cuda
def test_evaluate_on_cuda_matches_cpu(restore_tf32):
    from fastdata.train import evaluate

    torch.set_float32_matmul_precision("highest")  # plain fp32 on the GPU too (no TF32 rounding)
    torch.backends.cudnn.allow_tf32 = False
    model = _conv_model()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    cpu = evaluate(model, batches, loss_fn=torch.nn.functional.cross_entropy,
                   metrics={"acc": lambda o, t: (o.argmax(-1) == t).float()})
    gpu = evaluate(model.cuda(), batches, loss_fn=torch.nn.functional.cross_entropy, precision="fp32",
                   metrics={"acc": lambda o, t: (o.argmax(-1) == t).float()})
    assert gpu["samples"] == cpu["samples"] == 12
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-3) and gpu["acc"] == pytest.approx(cpu["acc"])


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

