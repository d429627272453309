"""nvImageCodec without a host wait per call (``decode_device(..., host_wait=False)``,
``DecodeImages(device_decoder="nvimgcodec", host_wait=False)``).

On the CPU a fake nvImageCodec, stream and events show: no call waits on the host; nvImageCodec's images
and the inputs (views of the packed buffer and their code streams) are released only after the event
after their copies has completed, in whatever order events complete; a bound on pending calls; and the
stage's argument checks and ``close()``. On a GPU: the pixels against the CPU decode (the hazard cases are
in test_stream_order_guard.py)."""
from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from fastdata import gpu
from fastdata.gpu import _codec, _decode, _nvimgcodec

from tests.helpers.images import jpeg, many_jpegs, packed, pillow_rgb

CUDA0 = torch.device("cuda", 0)


class Event:
    """torch.cuda.Event: completes when the test says so; a host wait completes it and is logged."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.complete = False

    def record(self, stream) -> None:
        self.log.append(("record", stream))

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.log.append(("host waits", self))
        self.complete = True


class Image:
    """An nvImageCodec image: its buffer is released when the object dies (tracked by weakref)."""


class CodeStream:
    def __init__(self, array) -> None:
        self.array = array


class Fake:
    """A fake nvImageCodec module, stream and event factory; ``created`` holds weakrefs to every image,
    code stream and input view a call got, per call."""

    def __init__(self, monkeypatch) -> None:
        self.log: list = []
        self.events: list[Event] = []
        self.calls: list[dict[str, list[weakref.ref]]] = []
        self.stream = types.SimpleNamespace(cuda_stream=1234)
        fake = self

        class Decoder:
            def __init__(self, **kw) -> None:
                pass

            def decode(self, codes, params=None, cuda_stream=0):
                images = [Image() for _ in codes]
                fake.calls[-1].update(images=[weakref.ref(im) for im in images],
                                      codes=[weakref.ref(c) for c in codes])
                fake.log.append(("decode", cuda_stream))
                return images

        kinds = types.SimpleNamespace(HW_GPU_ONLY=1, GPU_ONLY=2, HYBRID_CPU_GPU=3, CPU_ONLY=4)
        self.nv = types.SimpleNamespace(BackendKind=kinds, Backend=lambda kind: kind, Decoder=Decoder,
                                        DecodeParams=lambda **kw: kw, ColorSpec=types.SimpleNamespace(SRGB=0),
                                        SampleFormat=types.SimpleNamespace(P_RGB=0), CodeStream=CodeStream,
                                        NVIMGCODEC_DEVICE_CPU_ONLY=-1)

        def event() -> Event:
            e = Event(self.log)
            self.events.append(e)
            return e

        monkeypatch.setattr(torch.cuda, "Event", event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.stream)
        monkeypatch.setattr(_nvimgcodec, "_DECODERS", {})
        monkeypatch.setattr(_nvimgcodec, "_to_torch", lambda im, device: torch.zeros((3, 2, 2), dtype=torch.uint8))
        monkeypatch.setattr(_codec, "nvimgcodec_status", lambda: (self.nv, "fake nvImageCodec"))
        monkeypatch.setattr(_codec, "device_backend", lambda name="auto": name)

    def call(self, n: int = 3, host_wait: bool = False) -> None:
        """One decode_device call on ``n`` fresh inputs that nothing else references afterwards."""
        views = packed([jpeg(i) for i in range(n)]).views()
        self.calls.append({"views": [weakref.ref(v) for v in views]})
        out = _codec.decode_device(views, CUDA0, "nvimgcodec", host_wait=host_wait)
        assert len(out) == n and all(o.shape == (3, 2, 2) for o in out)

    def alive(self, call: int) -> bool:
        """Whether call ``call``'s images, code streams and views are all still referenced (None: all released;
        anything between is an error)."""
        gc.collect()
        refs = [r for kind in ("images", "codes", "views") for r in self.calls[call][kind]]
        held = [r() is not None for r in refs]
        assert all(held) or not any(held), f"call {call}: only part of what it holds was released"
        return all(held)

    def host_waits(self) -> list:
        return [e for e in self.log if e[0] == "host waits"]


def test_no_call_waits_on_the_host_and_nothing_is_released_before_its_event(monkeypatch):
    fake = Fake(monkeypatch)
    for _ in range(4):
        fake.call()
    assert fake.host_waits() == []  # neither the guard nor the call waits
    assert [e[0] for e in fake.log] == ["decode", "record"] * 4  # decode, then the event after its copies
    assert all(e[1] is fake.stream for e in fake.log if e[0] == "record")
    assert fake.log[0] == ("decode", 1234)  # on the current stream
    assert all(fake.alive(k) for k in range(4))  # no event completed: everything held
    assert _nvimgcodec.pending_calls(CUDA0) == 4
    fake.events[0].complete = True
    fake.call()  # the next call drops what completed, without waiting
    assert not fake.alive(0) and all(fake.alive(k) for k in (1, 2, 3, 4))
    assert fake.host_waits() == []


def test_events_completing_out_of_order_release_exactly_their_calls(monkeypatch):
    fake = Fake(monkeypatch)
    for _ in range(4):
        fake.call()
    for order in ([2], [3, 0]):  # complete in another order than the calls were made
        for k in order:
            fake.events[k].complete = True
        assert _nvimgcodec.pending_calls(CUDA0) == 4 - sum(e.complete for e in fake.events)
        assert [fake.alive(k) for k in range(4)] == [not e.complete for e in fake.events]
    assert fake.host_waits() == []
    _codec.release_pending(CUDA0)  # what DecodeImages.close() runs: waits for the rest, then releases
    assert fake.host_waits() == [("host waits", fake.events[1])] and not fake.alive(1)
    assert _nvimgcodec.pending_calls(CUDA0) == 0


def test_too_many_pending_calls_wait_for_the_oldest_only(monkeypatch):
    fake = Fake(monkeypatch)
    monkeypatch.setattr(_nvimgcodec, "MAX_PENDING", 2)
    fake.call()
    fake.call()
    assert fake.host_waits() == []
    fake.call()
    assert fake.host_waits() == [("host waits", fake.events[0])]
    assert [fake.alive(k) for k in range(3)] == [False, True, True]


def test_a_failure_after_the_decode_keeps_the_inputs_until_the_event(monkeypatch):
    fake = Fake(monkeypatch)

    def copy(im, device):
        raise torch.OutOfMemoryError("CUDA out of memory (a copy)")

    monkeypatch.setattr(_nvimgcodec, "_to_torch", copy)
    with pytest.raises(torch.OutOfMemoryError):
        fake.call()
    assert fake.alive(0) and fake.host_waits() == []  # the engine may still read the inputs
    fake.events[0].complete = True
    assert _nvimgcodec.pending_calls(CUDA0) == 0 and not fake.alive(0)


def test_with_a_host_wait_the_call_waits_after_its_copies_and_holds_nothing(monkeypatch):
    fake = Fake(monkeypatch)
    fake.call(host_wait=True)
    kinds = [e[0] for e in fake.log]
    assert kinds == ["record", "host waits", "decode", "record", "host waits"]  # the guard, then after the copies
    assert not fake.alive(0) and _nvimgcodec.pending_calls(CUDA0) == 0


def test_stage_argument_checks_and_close(monkeypatch):
    pytest.importorskip("nvidia.nvimgcodec")
    with pytest.raises(ValueError, match=r"DecodeImages: host_wait=False needs a device decoder of \('nvimgcodec',\)"
                                         r".*'torchvision' waits"):
        gpu.DecodeImages(device="cpu", device_decoder="torchvision", host_wait=False)
    with pytest.raises(ValueError, match="DecodeImages: host_wait must be True or False, got 'no'"):
        gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", host_wait="no")
    released = []
    monkeypatch.setattr(_decode, "release_pending", lambda device=None: released.append(device))
    with gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", host_wait=False) as stage:
        assert "host_wait=False" in repr(stage)
    assert released == [None]
    gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec").close()  # waits for nothing
    assert released == [None]


def test_cpu_stage_without_a_host_wait_decodes_at_once_and_holds_nothing():
    """On the CPU nvImageCodec's call returns its images decoded whatever ``host_wait`` says (the CPU path
    never reads it): the CPU decode's pixels, and no call left pending."""
    pytest.importorskip("nvidia.nvimgcodec")
    datas = many_jpegs(12)
    got = gpu.DecodeImages(device="cpu", device_decoder="nvimgcodec", host_wait=False, chunk_size=5)(
        {"jpg": packed(datas)})["jpg"]
    assert len(got.images) == 12
    assert all(int((a.int() - pillow_rgb(d).int()).abs().max()) <= 1 for a, d in zip(got.images, datas))
    assert _nvimgcodec.pending_calls(torch.device("cpu")) == 0


@pytest.mark.cuda
def test_cuda_decode_without_a_host_wait_matches_the_cpu_decode():
    pytest.importorskip("nvidia.nvimgcodec")
    datas = many_jpegs(60)
    views = packed(datas).pin_memory().views()
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        images = _codec.decode_device(views, dev, "nvimgcodec", host_wait=False)
        host = [im.cpu() for im in images]  # ordered after the decode on this stream: no wait needed in between
    means = [float((a.int() - pillow_rgb(d).int()).abs().float().mean()) for a, d in zip(host, datas)]
    assert max(means) < 4.5
    _codec.release_pending(dev)
    assert _nvimgcodec.pending_calls(dev) == 0


@pytest.mark.cuda
def test_cuda_stage_without_a_host_wait_matches_the_waiting_one():
    pytest.importorskip("nvidia.nvimgcodec")
    from fastdata.prefetch import CUDAPrefetcher

    datas = many_jpegs(48)
    batches = [{"jpg": packed(datas[k : k + 12]).pin_memory(), "cls": torch.arange(12)} for k in range(0, 48, 12)]
    out = {}
    for wait in (True, False):
        stage = gpu.DecodeImages(device="cuda", device_decoder="nvimgcodec", host_wait=wait)
        pipe = gpu.Compose(stage, gpu.RandomResizedCrop(48), gpu.RandomHorizontalFlip())
        with stage, CUDAPrefetcher(stage.ahead(batches), device="cuda", transform=pipe, seamless=False) as pf:
            out[wait] = torch.cat([b["jpg"].cpu() for b in pf])
    assert out[False].shape == (48, 3, 48, 48)
    assert int((out[False].int() - out[True].int()).abs().max()) <= 1  # the same crops of the same pixels
