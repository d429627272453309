"""Session 9, lead: small fixes."""
from __future__ import annotations

import pytest

from tests.helpers.images import jpeg
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


def _write_detection_set(dest, boxes_rows):
    import numpy as np

    import fastdata

    with fastdata.ShardWriter(dest) as w:
        for i in range(3):
            data = jpeg(i, 16, 16) if i != 1 else jpeg(i, 16, 16)[:200] + b"\0" * 50  # sample 1 corrupt
            w.write({"__key__": f"s{i}", "jpg": data, "boxes.npy": np.full((boxes_rows(i), 4), i, np.float32),
                     "cls": i})
    return fastdata.ShardedDataset(dest, image_decode="device")


def test_decode_skip_drops_the_skipped_samples_item_of_a_per_sample_list(tmp_path):
    import pytest
    import torch

    import fastdata
    from fastdata import gpu
    from fastdata.dataset import collate
    from fastdata.errors import DecodeError

    ds = _write_detection_set(tmp_path / "a", lambda i: i + 2)

    def detection(samples):  # images packed, boxes as a per-sample list (a custom collate)
        out = collate([{k: v for k, v in s.items() if k != "boxes.npy"} for s in samples])
        out["boxes"] = [torch.as_tensor(s["boxes.npy"]) for s in samples]
        out["targets"] = [{"labels": torch.as_tensor(s["boxes.npy"])[:, 0]} for s in samples]
        return out

    stage = gpu.Compose(gpu.DecodeImages(device="cpu", on_error="skip"), gpu.CenterCrop(8))
    (b,) = [stage(b) for b in fastdata.DataLoader(ds, batch_size=3, num_workers=0, collate_fn=detection)]
    # the skipped sample s1's boxes stayed, paired with s2's image, and s1's boxes (3 rows = n) lost a row
    assert b["__key__"] == ["s0", "s2"] and b["jpg"].shape[0] == 2
    assert [t.shape[0] for t in b["boxes"]] == [2, 4] and [int(t[0, 0]) for t in b["boxes"]] == [0, 2]
    assert [len(t["labels"]) for t in b["targets"]] == [2, 4]
    # every sample with 3 boxes in a batch of 3: a list field of 3 batched tensors looks the same: refused
    stage = gpu.Compose(gpu.DecodeImages(device="cpu", on_error="skip"))
    ds = _write_detection_set(tmp_path / "b", lambda i: 3)
    loader = fastdata.DataLoader(ds, batch_size=3, num_workers=0,
                                 collate_fn=lambda s: {k: v for k, v in detection(s).items() if k != "targets"})
    with pytest.raises(DecodeError, match=r"\['boxes'\] is a list of 3 items of 3 rows"):
        for b in loader:
            stage(b)


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


@pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning")  # torch's own hint (recent torch) before fastdata's error
def test_build_cache_with_spawn_workers_names_an_unpicklable_part(tmp_path, monkeypatch):
    import multiprocessing

    import pytest

    import fastdata
    from fastdata.errors import FastdataError

    with fastdata.ShardWriter(tmp_path / "d") as w:
        for i in range(4):
            w.write({"__key__": f"s{i}", "jpg": jpeg(i, 16, 16), "cls": i})
    ds = fastdata.ShardedDataset(tmp_path / "d", preprocess=fastdata.ResizeCenterCrop(4), cache=tmp_path / "c",
                                 decode={"cls": lambda b: int(b)})
    # multiprocessing's default start method made spawn (pickling fails in this process, before a child starts)
    monkeypatch.setattr(multiprocessing.context._default_context, "_actual_context",
                        multiprocessing.get_context("spawn"))
    with pytest.raises(FastdataError, match=r"dataset\.decode\['cls'\] .*cannot be pickled.*num_workers=0"):
        ds.build_cache(num_workers=2)  # it was pickle's bare "Can't pickle <function <lambda>>"
