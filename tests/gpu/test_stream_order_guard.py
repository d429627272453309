"""The stream-order guard of fastdata.gpu._codec.decode_device: before every device JPEG decode call, on any
backend, the host waits for the work already queued on the decode's stream (nvJPEG's hardware engine writes
its outputs without waiting for it: meta-pytorch/torchcodec#1634, pytorch/vision#9606); nvImageCodec called
without a host wait needs no wait (its buffers are released only after their reads: test_nvimgcodec_no_wait.py).

On the CPU a fake backend and fake CUDA stream/event show the wait comes first; on a GPU the hazard itself
is reproduced as in torchcodec#1634 and must not corrupt anything."""
from __future__ import annotations

import pytest
import torch

from fastdata.gpu import _codec

from tests.helpers.decoders import DEVICE_DECODERS
from tests.helpers.images import many_jpegs, packed, pillow_rgb


@pytest.mark.parametrize("backend", ["torchcodec", "torchvision", "nvimgcodec"])
def test_the_guard_waits_for_the_decode_stream_before_every_decoder_call(monkeypatch, backend):
    log: list = []
    stream = object()  # the decode's current stream

    class Event:  # torch.cuda.Event, recording what is waited for
        def record(self, s):
            log.append(("record", "current stream" if s is stream else s))

        def synchronize(self):
            log.append("host waits")

    def current_stream(device=None):
        log.append(("current_stream", device))
        return stream

    def decoder(views, device):
        log.append("decode")
        return [None] * len(views)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(_codec, "device_backend", lambda name="auto": name)  # no library needed
    monkeypatch.setitem(_codec._DEVICE_DECODERS, backend, decoder)
    dev = torch.device("cuda", 1)
    views = packed(many_jpegs(3)).views()
    for _ in range(2):
        assert _codec.decode_device(views, dev, backend) == [None] * 3
    once = [("current_stream", dev), ("record", "current stream"), "host waits", "decode"]
    assert log == once * 2
    log.clear()
    _codec.decode_device(views, torch.device("cpu"), backend)  # no stream on the CPU: nothing to wait for
    assert log == ["decode"]


def test_nvimgcodec_without_a_host_wait_is_called_without_one(monkeypatch):
    log: list = []

    class Event:
        def record(self, s):
            log.append("record")

        def synchronize(self):
            log.append("host waits")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: log.append("current_stream"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(_codec, "device_backend", lambda name="auto": name)
    monkeypatch.setitem(_codec._DEVICE_DECODERS, "nvimgcodec",
                        lambda views, device, host_wait=True: log.append(("decode", host_wait)) or [None] * len(views))
    views = packed(many_jpegs(2)).views()
    for _ in range(3):
        assert _codec.decode_device(views, torch.device("cuda", 0), "nvimgcodec", host_wait=False) == [None, None]
    assert log == [("decode", False)] * 3  # neither the guard nor anything else waits on the host
    for backend in ("torchcodec", "torchvision"):  # they wait inside their own call: refused, not ignored
        with pytest.raises(ValueError, match=f"host_wait=False needs a device decoder of .*'{backend}' waits"):
            _codec.decode_device(views, torch.device("cuda", 0), backend, host_wait=False)
    with pytest.raises(ValueError, match="host_wait must be True or False, got 0"):
        _codec.decode_device(views, torch.device("cuda", 0), "nvimgcodec", host_wait=0)


def _corrupted_iterations(backend: str, iterations: int, datas: list[bytes], refs: list[torch.Tensor],
                          host_wait: bool = True) -> int:
    """torchcodec#1634's scenario on a side stream, ``iterations`` times: tensors of the decoded images'
    sizes are filled and synchronised; a long kernel, then per tensor a reduction and a fill, are queued;
    the tensors are freed while those still wait (their blocks go back to this stream's pool, where the
    decode's outputs come from); then the decode. An iteration is corrupted when a reduction saw another
    value than the fill's or a decoded image differs from the CPU decode beyond nvJPEG's rounding."""
    views = packed(datas).pin_memory().views()
    stream = torch.cuda.Stream()
    corrupted = 0
    with torch.cuda.stream(stream):
        _codec.decode_device(views, torch.device("cuda"), backend, host_wait=host_wait)  # warm-up: decoder handles
        torch.cuda.synchronize()
        for _ in range(iterations):
            blocks = [torch.full((ref.numel(),), 3, dtype=torch.uint8, device="cuda") for ref in refs]
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # ~25 ms of queued work before the reductions
            sums = [b.sum(dtype=torch.int64) for b in blocks]
            for b in blocks:
                b.zero_()  # a write queued before the decode: it must not land on decoded pixels
            del blocks  # freed with their reductions still queued
            images = _codec.decode_device(views, torch.device("cuda"), backend, host_wait=host_wait)
            torch.cuda.synchronize()
            bad = any(int(s) != 3 * ref.numel() for s, ref in zip(sums, refs))
            for img, ref in zip(images, refs):
                if img is not None and float((img.cpu().int() - ref.int()).abs().float().mean()) > 8:
                    bad = True
            corrupted += bad
    return corrupted


@pytest.mark.cuda
@pytest.mark.parametrize("backend", DEVICE_DECODERS)
def test_no_corruption_when_earlier_work_reads_blocks_the_decode_gets(monkeypatch, backend, record_property):
    datas = many_jpegs(24)  # baseline (the hardware engine), progressive and greyscale (the hybrid path)
    refs = [pillow_rgb(d) for d in datas]
    corrupted = _corrupted_iterations(backend, 200, datas, refs)
    monkeypatch.setattr(_codec, "_stream_order_guard", lambda device: None)
    unguarded = _corrupted_iterations(backend, 50, datas, refs)  # the control: what the guard prevents here
    record_property("unguarded_corrupted_of_50", unguarded)
    assert corrupted == 0, f"{backend}: {corrupted} of 200 iterations corrupted (without the guard: {unguarded} of 50)"


@pytest.mark.cuda
def test_no_corruption_with_nvimgcodec_without_a_host_wait(record_property):
    pytest.importorskip("nvidia.nvimgcodec")
    datas = many_jpegs(24)
    refs = [pillow_rgb(d) for d in datas]
    assert _corrupted_iterations("nvimgcodec", 200, datas, refs, host_wait=False) == 0


def _queued_copies_corrupted(iterations: int, datas: list[bytes], refs: list[torch.Tensor]) -> int:
    """nvImageCodec without a host wait, ``iterations`` calls on one stream with a long kernel queued before
    each: every call's copies out of nvImageCodec's buffers still wait when the next call decodes. A buffer
    released to nvImageCodec's pool before its copy ran could be given to the next decode, which the engine
    writes at once. Counts the calls whose images differ from the CPU decode."""
    views = packed(datas).pin_memory().views()
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    outs = []
    with torch.cuda.stream(stream):
        _codec.decode_device(views, dev, "nvimgcodec", host_wait=False)
        torch.cuda.synchronize()
        for _ in range(iterations):
            torch.cuda._sleep(20_000_000)
            outs.append(_codec.decode_device(views, dev, "nvimgcodec", host_wait=False))
    torch.cuda.synchronize()
    return sum(any(img is None or float((img.cpu().int() - ref.int()).abs().float().mean()) > 8
                   for img, ref in zip(images, refs)) for images in outs)


@pytest.mark.cuda
def test_nvimgcodec_buffers_outlive_the_copies_queued_behind_other_work(monkeypatch, record_property):
    pytest.importorskip("nvidia.nvimgcodec")
    from fastdata.gpu import _nvimgcodec

    datas = many_jpegs(24)
    refs = [pillow_rgb(d) for d in datas]
    assert _queued_copies_corrupted(40, datas, refs) == 0
    _nvimgcodec.release()
    # the control: buffers and inputs released as the call returns, as a call without the pending list would
    monkeypatch.setattr(_nvimgcodec._Pending, "__init__", lambda self, done, keep: setattr(self, "done", done))
    record_property("released_at_return_corrupted_of_20", _queued_copies_corrupted(20, datas, refs))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", DEVICE_DECODERS)
def test_no_corruption_with_decode_calls_from_several_threads(backend):
    """Four threads, each decoding on a stream of its own behind the hazard's queued work (as
    DecodeImages(decode_threads=4) calls the decoder): every call is guarded, none is corrupted."""
    import threading

    datas = many_jpegs(24)
    refs = [pillow_rgb(d) for d in datas]
    counts: list = []

    def run() -> None:
        try:
            counts.append(_corrupted_iterations(backend, 30, datas, refs))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            counts.append(repr(e))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert counts == [0, 0, 0, 0], f"{backend}: corrupted iterations (or errors) per thread: {counts}"
