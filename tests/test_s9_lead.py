"""Session 9, lead: small fixes."""
from __future__ import annotations

from fastdata._util import add_note


class _NoNotes(Exception):
    """An exception as Python 3.10 has them: no add_note method."""

    def __getattribute__(self, name: str):  # noqa: ANN204
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_add_note_works_without_exception_add_note():
    # fastdata declares Python >= 3.10; BaseException.add_note is 3.11+. The thread decoder's error path called
    # e.add_note(...) directly, which on 3.10 replaced the user's error with an AttributeError.
    e = _NoNotes("boom")
    add_note(e, "(in thread t of fastdata.DataLoader)")
    assert e.__notes__ == ["(in thread t of fastdata.DataLoader)"]
    f = ValueError("x")
    add_note(f, "a")
    add_note(f, "b")
    assert f.__notes__ == ["a", "b"]


def test_cache_directory_takes_file_urls_and_refuses_other_urls(tmp_path, monkeypatch):
    import pytest

    from fastdata.cache import Cache

    monkeypatch.chdir(tmp_path)
    # file:///x/c made a folder named 'file:' in the current folder (the README's rule for local paths strips it)
    assert Cache(f"file://{tmp_path}/c").directory == tmp_path / "c"
    with pytest.raises(ValueError, match="local path"):
        Cache("s3://bucket/c")


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
