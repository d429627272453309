"""The stream-order guard of fastdata.gpu._codec.decode_device: before every device JPEG decode call, on any
backend, the host waits for the work already queued on the decode's stream (nvJPEG's hardware engine writes
its outputs without waiting for it: meta-pytorch/torchcodec#1634, pytorch/vision#9606).

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


def _corrupted_iterations(backend: str, iterations: int, datas: list[bytes], refs: list[torch.Tensor]) -> int:
    """torchcodec#1634's scenario on a side stream, ``iterations`` times: tensors of the decoded images'
    sizes are filled and synchronised; a long kernel, then per tensor a reduction and a fill, are queued;
    the tensors are freed while those still wait (their blocks go back to this stream's pool, where the
    decode's outputs come from); then the decode. An iteration is corrupted when a reduction saw another
    value than the fill's or a decoded image differs from the CPU decode beyond nvJPEG's rounding."""
    views = packed(datas).pin_memory().views()
    stream = torch.cuda.Stream()
    corrupted = 0
    with torch.cuda.stream(stream):
        _codec.decode_device(views, torch.device("cuda"), backend)  # warm-up: decoder handles, first allocations
        torch.cuda.synchronize()
        for _ in range(iterations):
            blocks = [torch.full((ref.numel(),), 3, dtype=torch.uint8, device="cuda") for ref in refs]
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # ~25 ms of queued work before the reductions
            sums = [b.sum(dtype=torch.int64) for b in blocks]
            for b in blocks:
                b.zero_()  # a write queued before the decode: it must not land on decoded pixels
            del blocks  # freed with their reductions still queued
            images = _codec.decode_device(views, torch.device("cuda"), backend)
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
