"""evaluate: metrics averaged over uneven batches with one transfer, through a prefetcher, one epoch
of the loader; the metrics and arguments it refuses."""
from __future__ import annotations

import time

import pytest
import torch

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata.train import evaluate
from tests.helpers.models import conv_model, linear_and_batches


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

    model = conv_model()
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


@pytest.mark.cuda
def test_evaluate_on_cuda_matches_cpu(restore_tf32):
    from fastdata.train import evaluate

    torch.set_float32_matmul_precision("highest")  # plain fp32 on the GPU too (no TF32 rounding)
    torch.backends.cudnn.allow_tf32 = False
    model = conv_model()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    cpu = evaluate(model, batches, loss_fn=torch.nn.functional.cross_entropy,
                   metrics={"acc": lambda o, t: (o.argmax(-1) == t).float()})
    gpu = evaluate(model.cuda(), batches, loss_fn=torch.nn.functional.cross_entropy, precision="fp32",
                   metrics={"acc": lambda o, t: (o.argmax(-1) == t).float()})
    assert gpu["samples"] == cpu["samples"] == 12
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-3) and gpu["acc"] == pytest.approx(cpu["acc"])


def test_evaluate_refuses_a_metric_with_more_than_one_value_per_sample():
    # per-pixel losses (N, H, W) or logits (N, C) summed as if per-sample gave a result C times too big
    model, batches = linear_and_batches()
    with pytest.raises(ValueError, match=r"'logits' returned shape \(8, 3\)"):
        fastdata.evaluate(model, batches, metrics={"logits": lambda out, target: out})
    # one value per sample in an (N, 1) column is still per-sample
    res = fastdata.evaluate(model, batches, metrics={"col": lambda out, target: torch.ones(out.shape[0], 1)})
    assert res["col"] == pytest.approx(1.0)


def test_evaluate_metrics_must_be_a_mapping():
    model, batches = linear_and_batches()
    with pytest.raises(ValueError, match="metrics must be a mapping"):
        fastdata.evaluate(model, batches, metrics=[fastdata.train.accuracy])  # type: ignore[arg-type]


def test_evaluate_refuses_a_transform_it_would_not_apply():
    # transform= is for a loader evaluate wraps itself; beside a CUDAPrefetcher it was silently ignored
    model, batches = linear_and_batches()
    with fastdata.CUDAPrefetcher(batches, device="cpu") as prefetched:
        with pytest.raises(ValueError, match="transform= .*CUDAPrefetcher"):
            fastdata.evaluate(model, prefetched, transform=lambda b: b)


def test_evaluate_ignores_an_empty_batch():
    # an empty batch's mean loss is nan, and nan * 0 samples made the whole result nan
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    full = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    empty = (torch.randn(0, 4), torch.randint(0, 3, (0,)))
    kw = {"loss_fn": torch.nn.functional.cross_entropy,
          "metrics": {"acc": lambda o, t: fastdata.train.accuracy(o, t).mean()}}
    assert fastdata.evaluate(model, [full, empty], **kw) == fastdata.evaluate(model, [full], **kw)


def test_evaluate_names_its_model_and_batches_arguments():
    model = torch.nn.Linear(4, 3)
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    with pytest.raises(ValueError, match="model must be a torch.nn.Module, got str"):
        evaluate("resnet18", [batch])  # an AttributeError: 'str' object has no attribute 'parameters'
    with pytest.raises(ValueError, match="batches must be iterable, got int"):
        evaluate(model, 5)  # "iterable must be iterable", the prefetcher's argument
