"""DecodeImages.ahead(iterable, batches=N) on the CPU: how far it reads ahead and submits (with a stand-in
stage), the order and state it keeps, its argument checks, and that reading N batches ahead changes no
batch of the pipeline. On the CPU ``DecodeImages.submit`` returns at once (no decode is started early), so
the last test covers the reading ahead, not a decode running ahead; that runs only on CUDA
(test_decode_priority.py: the decode streams' priority and the batches' shapes with N = 1, 2;
test_decode.py: every sample once through the prefetcher)."""
from __future__ import annotations

import pytest
import torch

from fastdata import gpu
from fastdata.dataset import ShardedDataset
from fastdata.gpu._ahead import DecodeAhead
from fastdata.loader import DataLoader
from fastdata.prefetch import CUDAPrefetcher
from fastdata.shards.writer import ShardWriter

from tests.helpers.images import jpeg

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Loader:
    """Re-iterable of ``n`` batches that logs every read; ``state_dict()`` is the count read so far."""

    def __init__(self, n: int) -> None:
        self.n, self.read, self.log = n, 0, []
        self.extra = "loader attribute"

    def __iter__(self):
        self.read = 0
        for i in range(self.n):
            self.read += 1
            self.log.append(("read", i))
            yield {"i": i}

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"read": self.read}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


class Stage:
    """Stands in for DecodeImages: records the batches submitted, in the loader's log."""

    def __init__(self, log: list) -> None:
        self.log = log

    def submit(self, batch) -> None:
        self.log.append(("submit", batch["i"]))


@pytest.mark.parametrize("batches", [1, 2, 3])
def test_reads_and_submits_n_batches_past_the_one_yielded(batches):
    loader = Loader(6)
    ahead = DecodeAhead(loader, Stage(loader.log), batches)
    for k, b in enumerate(ahead):
        assert b == {"i": k}
        assert loader.read == min(k + 1 + batches, 6)  # the batch in hand and ``batches`` more
        submitted = [i for what, i in loader.log if what == "submit"]
        assert submitted == list(range(min(k + 1 + batches, 6)))  # each read batch submitted at once
    assert [e for e in loader.log if e[0] == "read"] == [("read", i) for i in range(6)]  # each read once


@pytest.mark.parametrize("batches", [1, 2, 5])
def test_state_dict_is_the_loaders_as_of_the_batch_yielded(batches):
    loader = Loader(4)
    ahead = gpu.DecodeImages(device="cpu").ahead(loader, batches=batches)
    assert ahead.state_dict() == {"read": 0}  # before the first batch: the loader's own
    states = [ahead.state_dict() for _ in ahead]
    assert states == [{"read": k} for k in range(1, 5)]  # not counting the batches read ahead
    ahead.load_state_dict({"read": 2})
    assert loader.loaded == {"read": 2} and ahead.state_dict() == {"read": 4}  # the loader's again
    assert len(ahead) == 4 and ahead.extra == "loader attribute" and ahead.batches == batches


def test_short_loader_and_empty_loader():
    for n in (0, 1, 2):
        loader = Loader(n)
        assert [b["i"] for b in DecodeAhead(loader, Stage(loader.log), 3)] == list(range(n))


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", None])
def test_batches_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"batches must be an int >= 1.*" + repr(bad).replace("(", r"\(")):
        gpu.DecodeImages(device="cpu").ahead([], batches=bad)


def test_ahead_depth_changes_no_batch(tmp_path):
    with ShardWriter(tmp_path / "ds", max_samples=6) as w:
        for i in range(20):
            w.write({"__key__": f"s{i:03d}", "jpg": jpeg(i), "cls": i})

    def run(batches: int | None) -> list:
        loader = DataLoader(ShardedDataset(tmp_path / "ds", image_decode="device", shuffle=True, seed=2),
                            batch_size=4, num_workers=0)
        pipe = gpu.Compose(gpu.DecodeImages(device="cpu"), gpu.RandomResizedCrop(16), gpu.RandomHorizontalFlip(),
                           gpu.Normalize(dtype=torch.float32))
        src = loader if batches is None else pipe.transforms[0].ahead(loader, batches=batches)
        return [(b["cls"].tolist(), b["jpg"].clone()) for b in CUDAPrefetcher(src, device="cpu", transform=pipe)]

    plain = run(None)
    assert sorted(c for ids, _ in plain for c in ids) == list(range(20))
    for batches in (1, 2, 3):
        got = run(batches)
        assert [ids for ids, _ in got] == [ids for ids, _ in plain]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, plain))
