"""Session 8 bug hunt in the thread decoder (DataLoader(decode_threads=N)): one regression test per defect."""
from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastdata
from fastdata.shards.writer import ShardWriter
from fastdata.transforms import ResizeCenterCrop

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _tiny_shards(dest: Path, n: int = 8) -> Path:
    from fastdata.cli._synth import jpeg_bytes, synth_image

    with ShardWriter(dest, max_samples=4) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "jpg": jpeg_bytes(synth_image(np.random.default_rng(i), 20 + i, 24), 90),
                     "cls": i})
    return dest


@pytest.fixture(scope="module")
def shards(tmp_path_factory: Any) -> Path:
    return _tiny_shards(tmp_path_factory.mktemp("s8threads") / "ds")


def _receive(q: Any, acks: Any, go: Any, out: Any) -> None:
    t = q.get()  # a batch sent by the loading process: this process maps its memory
    acks.put(True)
    go.wait(20)
    out.put(t.numpy().tobytes())


def test_a_batch_sent_to_another_process_is_not_overwritten_by_later_batches(shards: Path) -> None:
    """A batch put on a torch.multiprocessing queue moves its storage into shared memory, which the receiving
    process maps; the ring's buffer was that storage, so the ring reused it once the sender dropped the
    batch and the receiver's tensor changed under it (worker-path batches are fresh memory each)."""
    ctx = multiprocessing.get_context("fork")
    q, acks, out, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_receive, args=(q, acks, go, out), daemon=True)
    p.start()
    try:
        dl = fastdata.DataLoader(fastdata.ShardedDataset(shards, preprocess=ResizeCenterCrop(32)), batch_size=2,
                                 decode_threads=2)
        it = iter(dl)
        batch = next(it)["jpg"]
        sent = batch.numpy().tobytes()
        q.put(batch)
        assert acks.get(timeout=20)
        del batch
        for _ in range(2):  # more batches over the same ring
            for b in it:
                b["jpg"].fill_(0)
            it = iter(dl)
        go.set()
        assert out.get(timeout=20) == sent
    finally:
        go.set()
        p.join(20)


def test_a_transform_raising_stopiteration_is_an_error_not_the_end_of_the_epoch(shards: Path) -> None:
    """StopIteration raised by a transform (a stray next() on an exhausted iterator) reached the thread
    decoder's __next__ as such, so the epoch ended silently after 2 of 8 samples; the worker path's
    generator turns it into RuntimeError (PEP 479)."""
    def transform(img: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name.startswith("fastdata-decode") and int(img[0, 0, 0]) == first[0]:
            raise StopIteration
        return img

    ds = fastdata.ShardedDataset(shards, preprocess=ResizeCenterCrop(32), shuffle=False)
    first = [int(next(iter(ds))["jpg"][0, 0, 0])]
    ds.transform = transform
    got = []
    with pytest.raises(RuntimeError, match="StopIteration") as info:
        for b in fastdata.DataLoader(ds, batch_size=2, decode_threads=2):
            got.append(b)
    assert got == [] and isinstance(info.value.__cause__, StopIteration)
    assert "fastdata-decode-" in "\n".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize(("threads", "workers"), [(2, 2), (0, 0), (0, 2)])
def test_a_collate_fn_raising_stopiteration_is_an_error_not_the_end_of_the_data(shards: Path, threads: int,
                                                                                 workers: int) -> None:
    """StopIteration raised by a custom collate_fn ended the epoch silently: on the thread path at once (4 of
    8 samples), with worker processes only that worker's part (torch's worker takes it for the end of its
    dataset), and the cached fast path (a generator) raised RuntimeError: three paths, three outcomes."""
    def collate(batch: list[dict[str, Any]]) -> Any:
        if "k002" in [s["__key__"] for s in batch]:
            raise StopIteration
        return torch.utils.data.default_collate(batch)

    ds = fastdata.ShardedDataset(shards, preprocess=ResizeCenterCrop(32), shuffle=False)
    ctx = multiprocessing.get_context("fork") if workers and not threads else None
    dl = fastdata.DataLoader(ds, batch_size=2, num_workers=workers, decode_threads=threads, collate_fn=collate,
                             multiprocessing_context=ctx)
    with pytest.raises(RuntimeError, match="collate_fn raised StopIteration"):
        for _ in dl:
            pass


def _bad_shards(dest: Path, bad: tuple[int, ...], n: int = 11) -> Path:
    from fastdata.cli._synth import jpeg_bytes, synth_image

    with ShardWriter(dest, max_samples=4) as w:
        for i in range(n):
            jpg = b"not a jpeg" if i in bad else jpeg_bytes(synth_image(np.random.default_rng(i), 20, 24), 90)
            w.write({"__key__": f"k{i:03d}", "jpg": jpg, "cls": i})
    return dest


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_walk_ending_in_skipped_samples_moves_the_state_as_a_worker_does(tmp_path: Path, drop_last: bool) -> None:
    """A virtual worker whose last samples were skipped (or, with drop_last, dropped with a skip among them)
    after its last batch kept its position before them in state_dict(), while a worker process reports
    its end: the states differed, and a resume from the thread path's state read those samples again and
    reported their skips a second time."""
    src = _bad_shards(tmp_path / "ds", bad=(9, 10))  # worker 1 of 2 reads samples 6-10: ends with two skips
    make = lambda: fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(8), shuffle=False,  # noqa: E731
                                           on_error="skip")
    kw = dict(batch_size=2 if drop_last else 3, num_workers=2, drop_last=drop_last)
    states = {}
    for threads in (0, 2):
        ctx = None if threads else multiprocessing.get_context("fork")
        dl = fastdata.DataLoader(make(), decode_threads=threads, multiprocessing_context=ctx, **kw)
        states[threads] = [dl.state_dict()["dataset"] for _ in dl]
        states[threads].append(dl.state_dict()["dataset"])
    assert states[2] == states[0]
    resumed = fastdata.DataLoader(make(), decode_threads=2, **kw)
    resumed.load_state_dict(states[2][-1])  # the dataset part alone (a loader state has all its keys)
    assert list(resumed) == [] and resumed.dataset.skipped == []


@pytest.mark.parametrize("threads", [0, 2])
def test_a_state_saved_after_skipbudgeterror_resumes_with_the_batch_that_raised_it(tmp_path: Path,
                                                                                   threads: int) -> None:
    """With worker processes the position of the batch whose skips ran past max_skips was recorded before the
    error was raised, so a state saved after SkipBudgetError counted that batch, never yielded, as read: a
    resume lost its samples (the thread decoder resumed them)."""
    from fastdata.errors import SkipBudgetError

    src = _bad_shards(tmp_path / "ds", bad=(1, 4, 7))
    make = lambda **kw: fastdata.ShardedDataset(src, preprocess=ResizeCenterCrop(8), shuffle=False,  # noqa: E731
                                                on_error="skip", **kw)
    kw = dict(batch_size=2, num_workers=2, decode_threads=threads,
              multiprocessing_context=None if threads else multiprocessing.get_context("fork"))
    dl = fastdata.DataLoader(make(max_skips=1), **kw)
    keys = []
    with pytest.raises(SkipBudgetError):
        for b in dl:
            keys += b["__key__"]
    resumed = fastdata.DataLoader(make(), **kw)
    resumed.load_state_dict(dl.state_dict())
    keys += [k for b in resumed for k in b["__key__"]]
    assert sorted(keys) == [f"k{i:03d}" for i in range(11) if i not in (1, 4, 7)]


def _conj(s: dict[str, Any]) -> dict[str, Any]:
    return {"spec": torch.fft.fft2(s["jpg"].float()).conj(), "k": s["__key__"]}  # conjugate bit set (a lazy view)


def _quantized(s: dict[str, Any]) -> dict[str, Any]:
    return {"q": torch.quantize_per_tensor(s["jpg"].float(), 0.5, 0, torch.quint8), "k": s["__key__"]}


def _sparse(s: dict[str, Any]) -> dict[str, Any]:
    return {"sp": s["jpg"].float().to_sparse(), "k": s["__key__"]}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated, still in use
@pytest.mark.parametrize("sample_transform", [_conj, _quantized, _sparse])
def test_tensors_numpy_cannot_copy_are_collated_as_torch_collates_them(shards: Path, sample_transform: Any) -> None:
    """Sample tensors with the conjugate bit, quantized or sparse ones were written in place through
    Tensor.numpy(), which refuses them: the thread decoder failed ("Can't call numpy() on Tensor that has
    conjugate bit set", an INTERNAL ASSERT, "can't convert Sparse layout tensor to numpy") where
    default_collate in the loading process batches the first two and refuses the third in its own words."""
    make = lambda: fastdata.ShardedDataset(shards, preprocess=ResizeCenterCrop(32),  # noqa: E731
                                           sample_transform=sample_transform)
    outcomes = []
    for threads in (0, 2):
        try:
            outcomes.append([b for b in fastdata.DataLoader(make(), batch_size=3, decode_threads=threads)])
        except RuntimeError as e:
            outcomes.append(str(e))
    if sample_transform is _sparse:
        assert outcomes[1] == outcomes[0] and "sparse tensors are not currently supported" in outcomes[0]
        return
    (ref, got), key = outcomes, next(k for k in outcomes[0][0] if k != "k")
    assert [b["k"] for b in got] == [b["k"] for b in ref]
    for x, y in zip(got, ref):
        assert x[key].dtype == y[key].dtype and torch.equal(x[key].dequantize() if x[key].is_quantized else x[key],
                                                            y[key].dequantize() if y[key].is_quantized else y[key])
