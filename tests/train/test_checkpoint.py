"""save_checkpoint / load_checkpoint: an interrupted and resumed run gives the same losses as an
uninterrupted one (same batches, same parameters, same dropout masks); the arguments they refuse."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastdata
import fastdata.gpu
import fastdata.train
from fastdata.train import CheckpointError, load_checkpoint, save_checkpoint
from tests.helpers.models import linear_step


SAMPLES, BATCH, EPOCHS = 44, 4, 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "shards"
    rng = np.random.default_rng(0)
    with fastdata.ShardWriter(root, max_samples=10) as w:
        for i in range(SAMPLES):
            w.write({"__key__": f"s{i:03d}", "x.npy": rng.standard_normal(8).astype(np.float32), "cls": i % 3})
    return root


def _setup(shards, workers: int, *, seed: int = 0, grad_accum: int = 2, prefetch: bool = True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 3))
    step = fastdata.TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              torch.nn.functional.cross_entropy, grad_accum=grad_accum,
                              input_key="x.npy", target_key="cls")
    ds = fastdata.ShardedDataset(shards, shuffle=True, seed=7)
    # Own generator for the workers' base seed: CUDAPrefetcher starts the next epoch's iterator ahead in
    # its thread, and a draw from torch's global generator there would race with the step's dropout.
    loader = fastdata.DataLoader(ds, batch_size=BATCH, num_workers=workers,
                                 generator=torch.Generator().manual_seed(0))
    batches = fastdata.CUDAPrefetcher(loader, device="cpu") if prefetch else loader
    return step, loader, batches


def _train(step, loader, batches, epochs, *, start_epoch=0, stop_after=None, on_stop=None):
    """Losses (and keys) of every micro-step; calls on_stop(epoch) after `stop_after` batches and returns."""
    losses, keys, done = [], [], 0
    for epoch in range(start_epoch, epochs):
        batches.set_epoch(epoch)  # the prefetcher's (it starts the next epoch ahead), else the loader's
        for batch in batches:
            losses.append(step(batch).item())
            keys.append(list(batch["__key__"]))
            done += 1
            if done == stop_after:
                on_stop(epoch)
                return losses, keys
    return losses, keys


@pytest.mark.parametrize("workers, stop_after, prefetch", [
    (0, 5, True),    # mid-epoch and mid-accumulation (5 micro-steps, grad_accum=2)
    (2, 12, True),   # exactly at the end of epoch 0 (2 workers x ceil(22 / 4) batches)
    (2, 15, False),  # epoch 1, plain fastdata.DataLoader without prefetcher
])
def test_resumed_run_repeats_the_uninterrupted_losses(shards, tmp_path, workers, stop_after, prefetch):
    step, loader, batches = _setup(shards, workers, prefetch=prefetch)
    ref_losses, ref_keys = _train(step, loader, batches, EPOCHS)
    assert len(ref_losses) == EPOCHS * len(loader) == EPOCHS * (11 if workers == 0 else 12)

    path = tmp_path / "run" / "ckpt.pt"
    step, loader, batches = _setup(shards, workers, prefetch=prefetch)
    first, first_keys = _train(step, loader, batches, EPOCHS, stop_after=stop_after,
                               on_stop=lambda e: fastdata.save_checkpoint(path, step, loader=batches, epoch=e,
                                                                          extra={"note": "x"}))
    torch.manual_seed(123)  # the global RNG moved on: the checkpoint must restore it (dropout masks)

    step, loader, batches = _setup(shards, workers, seed=99, prefetch=prefetch)  # other initial weights
    ckpt = fastdata.load_checkpoint(path, step, loader=batches)
    assert ckpt.extra == {"note": "x"} and ckpt.steps == stop_after // 2
    rest, rest_keys = _train(step, loader, batches, EPOCHS, start_epoch=ckpt.epoch)
    assert first_keys + rest_keys == ref_keys
    assert first + rest == ref_losses  # bit for bit on the CPU
    assert not list(path.parent.glob(".*tmp"))  # no temporary file left by the atomic write


def test_mid_accumulation_gradients_are_restored(shards, tmp_path):
    step, _, batches = _setup(shards, 0, grad_accum=3)
    it = iter(batches)
    step(next(it))
    assert step.micro_step == 1
    grads = [p.grad.clone() for p in step.model.parameters()]
    fastdata.save_checkpoint(tmp_path / "c.pt", step, loader=batches)
    batches.close()
    step2, _, batches2 = _setup(shards, 0, seed=5, grad_accum=3)
    fastdata.load_checkpoint(tmp_path / "c.pt", step2, loader=batches2)
    assert step2.micro_step == 1
    for g, p in zip(grads, step2.model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_checkpoint_of_a_compiled_or_wrapped_model_loads_into_a_plain_one(tmp_path):
    class Wrapper(torch.nn.Module):  # a DDP-like wrapper: .module and no_sync()
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

        def no_sync(self):
            import contextlib
            return contextlib.nullcontext()

    inner = torch.nn.Linear(4, 2)
    step = fastdata.TrainStep(Wrapper(inner), torch.optim.SGD(inner.parameters(), lr=0.1),
                              torch.nn.functional.mse_loss)
    fastdata.save_checkpoint(tmp_path / "w.pt", step)
    plain = torch.nn.Linear(4, 2)
    step2 = fastdata.TrainStep(plain, torch.optim.SGD(plain.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    fastdata.load_checkpoint(tmp_path / "w.pt", step2)
    torch.testing.assert_close(plain.weight, inner.weight)


def _plain_step(out: int = 2):
    model = torch.nn.Linear(4, out)
    return fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)


def test_load_errors_name_the_file_and_the_problem(shards, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        fastdata.load_checkpoint(tmp_path / "missing.pt", _plain_step())
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt: not a readable checkpoint"):
        fastdata.load_checkpoint(junk, _plain_step())
    other = tmp_path / "other.pt"
    torch.save({"model": {}}, other)
    with pytest.raises(CheckpointError, match="not a fastdata checkpoint"):
        fastdata.load_checkpoint(other, _plain_step())

    fastdata.save_checkpoint(tmp_path / "a.pt", _plain_step())
    with pytest.raises(CheckpointError, match="does not fit this TrainStep"):
        fastdata.load_checkpoint(tmp_path / "a.pt", _plain_step(out=3))
    _, _, batches = _setup(shards, 0, prefetch=False)
    with pytest.raises(CheckpointError, match="saved without loader="):
        fastdata.load_checkpoint(tmp_path / "a.pt", _plain_step(), loader=batches)
    fastdata.save_checkpoint(tmp_path / "b.pt", _plain_step(), loader=batches)
    with pytest.raises(CheckpointError, match="pass loader="):
        fastdata.load_checkpoint(tmp_path / "b.pt", _plain_step())
    assert isinstance(CheckpointError("x"), fastdata.FastdataError)


def test_save_rejects_bad_arguments(tmp_path):
    with pytest.raises(CheckpointError, match="step must be a fastdata.TrainStep"):
        fastdata.save_checkpoint(tmp_path / "x.pt", torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="epoch must be an int >= 0 or None, got -1"):
        fastdata.save_checkpoint(tmp_path / "x.pt", _plain_step(), epoch=-1)
    with pytest.raises(CheckpointError, match="loader must have a state_dict"):
        fastdata.save_checkpoint(tmp_path / "x.pt", _plain_step(), loader=[1, 2])
    with fastdata.CUDAPrefetcher([[torch.zeros(1)]], device="cpu") as plain:
        with pytest.raises(CheckpointError, match="cannot save the loader's position: .*no state_dict"):
            fastdata.save_checkpoint(tmp_path / "x.pt", _plain_step(), loader=plain)
    with pytest.raises(CheckpointError, match="pass loader= or loader_state=, not both"):
        fastdata.save_checkpoint(tmp_path / "x.pt", _plain_step(), loader=[1, 2], loader_state=[{}])
    assert not (tmp_path / "x.pt").exists()


def test_loader_state_list_of_every_rank_is_stored_as_given(tmp_path):
    class Recorder:
        def load_state_dict(self, state):
            self.state = state

    states = [{"rank": 0, "pos": [3, 4]}, {"rank": 1, "pos": [3, 3]}]
    fastdata.save_checkpoint(tmp_path / "ddp.pt", _plain_step(), loader_state=states, epoch=2)
    rec = Recorder()
    assert fastdata.load_checkpoint(tmp_path / "ddp.pt", _plain_step(), loader=rec).epoch == 2
    assert rec.state == states


@pytest.mark.parametrize("extra, match", [
    ("", "extra must be a mapping"),       # saved as {}
    ("x", "extra must be a mapping"),      # "dictionary update sequence element #0 has length 1"
    (5, "extra must be a mapping"),
])
def test_save_checkpoint_extra_must_be_a_mapping(extra, match, tmp_path):
    with pytest.raises(fastdata.CheckpointError, match=match):
        save_checkpoint(tmp_path / "ck.pt", linear_step(), extra=extra)
    assert list(tmp_path.iterdir()) == []


def test_save_checkpoint_over_a_folder_names_it(tmp_path):
    (tmp_path / "ck.pt").mkdir()
    with pytest.raises(fastdata.CheckpointError, match=r"ck.pt is a folder"):
        save_checkpoint(tmp_path / "ck.pt", linear_step())
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_load_checkpoint_checks_its_arguments_before_restoring_anything(tmp_path):
    class Loader:
        def state_dict(self):
            return {"pos": 3}

    save_checkpoint(tmp_path / "ck.pt", linear_step(), loader=Loader(), epoch=1)
    fresh = linear_step()
    before = fresh.module.weight.detach().clone()
    with pytest.raises(fastdata.CheckpointError, match="loader must have a load_state_dict"):
        load_checkpoint(tmp_path / "ck.pt", fresh, loader=object())
    assert torch.equal(fresh.module.weight, before)  # the model was restored, then the call failed
    with pytest.raises(fastdata.CheckpointError, match="step must be a fastdata.TrainStep, got Linear"):
        load_checkpoint(tmp_path / "ck.pt", torch.nn.Linear(4, 3), loader=Loader())


@pytest.mark.parametrize("value", [np.float64(0.5), np.zeros(3), __import__("pathlib").Path("x"), object(),
                                   frozenset({1})])
def test_save_checkpoint_refuses_extra_that_load_checkpoint_could_not_read(tmp_path, value):
    # load_checkpoint reads with torch.load(weights_only=True): a NumPy scalar in extra= was saved
    # without a word and made the checkpoint unreadable, found out only when resuming
    model = torch.nn.Linear(2, 2)
    step = fastdata.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)
    path = tmp_path / "ck.pt"
    with pytest.raises(fastdata.CheckpointError, match=r"extra\['best'\]\['v'\]"):
        fastdata.save_checkpoint(path, step, extra={"best": {"v": value}})
    assert not path.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(fastdata.CheckpointError, match=r"loader_state\[1\]"):
        fastdata.save_checkpoint(path, step, loader_state=[{"ok": 1}, value])
    # what it can read back is still saved
    extra = {"best": {"v": 0.5, "t": torch.ones(2), "s": {1, 2}, "n": None}, "steps": [1, 2]}
    fastdata.save_checkpoint(path, step, extra=extra)
    back = fastdata.load_checkpoint(path, step).extra
    assert back["steps"] == [1, 2] and torch.equal(back["best"]["t"], torch.ones(2))
