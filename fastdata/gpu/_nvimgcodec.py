"""nvImageCodec, a device backend behind :func:`fastdata.gpu._codec.decode_device` (called only from there).

One ``nvimgcodec.Decoder`` per device and process, its calls serialised. On CUDA each image is copied out of
nvImageCodec's buffer into torch memory on the current stream, then either the call waits on the host for an
event after the copies (``host_wait=True``), or it records that event and returns (``host_wait=False``).

Invariants of the call without a host wait:
- nvImageCodec's images (their buffers come from its stream-ordered pool) and the input bytes nvJPEG reads
  (views of the pinned packed buffer, and their code streams) stay referenced in the decoder's pending list
  until the event after the copies has completed; only then are they dropped, so a buffer goes back to the
  pool, and a pinned block to torch's host allocator, only after every read of it has run;
- completed entries are dropped without blocking (``Event.query``), at every call and in whatever order
  their events complete; :func:`release` drops them all, waiting for their events (close, exit);
- at most :data:`MAX_PENDING` calls wait in the list: beyond, the call waits for the oldest (a memory bound
  the stage's read-ahead keeps it under).
Design note: docs/design/codec.md ("nvImageCodec without a host wait").
"""
from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastdata._runtime import at_exit

__all__ = ["MAX_PENDING", "decode", "pending_calls", "release"]

MAX_PENDING = 16  # calls whose copies may still run, per decoder; the stage keeps a few batches ahead at most


class _Pending:
    """One call's event after its copies and what must outlive them."""

    __slots__ = ("done", "keep")

    def __init__(self, done: Any, keep: tuple[Any, ...]) -> None:
        self.done = done
        self.keep = keep


class NvDecoder:
    """One nvImageCodec decoder (and its decode parameters) for a device; calls are serialised."""

    def __init__(self, nv: Any, device: torch.device) -> None:
        kind = nv.BackendKind
        if device.type == "cpu":  # nvImageCodec's libjpeg-turbo backend: tests the glue without a GPU
            self.decoder = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[nv.Backend(kind.CPU_ONLY)])
        else:
            self.decoder = nv.Decoder(device_id=device.index if device.index is not None else
                                      torch.cuda.current_device(),
                                      backends=[nv.Backend(kind.HW_GPU_ONLY), nv.Backend(kind.GPU_ONLY),
                                                nv.Backend(kind.HYBRID_CPU_GPU)])
        self.params = nv.DecodeParams(color_spec=nv.ColorSpec.SRGB, sample_format=nv.SampleFormat.P_RGB,
                                      allow_any_depth=False, apply_exif_orientation=False)
        self.code_stream = nv.CodeStream
        self.lock = threading.Lock()
        self.pending: list[_Pending] = []  # calls without a host wait whose event has not been seen complete

    def release_done(self) -> None:
        """Drop the pending calls whose event has completed, in any order, without waiting (hold ``lock``)."""
        if self.pending:
            self.pending = [p for p in self.pending if not p.done.query()]

    def release_all(self) -> None:
        """Wait for every pending call's event, then drop them all (hold ``lock``)."""
        while self.pending:
            self.pending[0].done.synchronize()
            del self.pending[0]


_DECODERS: dict[tuple[int, str, int | None], NvDecoder] = {}
_LOCK = threading.Lock()


def decoder(nv: Any, device: torch.device) -> NvDecoder:
    key = (os.getpid(), device.type, device.index)  # a decoder's threads and CUDA state do not survive fork
    with _LOCK:
        dec = _DECODERS.get(key)
        if dec is None:
            dec = _DECODERS[key] = NvDecoder(nv, device)
        return dec


def _to_torch(image: Any, device: torch.device) -> torch.Tensor:
    """A decoded nvImageCodec image (planar RGB, so already ``(3, H, W)``) copied into torch memory on the
    current stream (the copy does not wait on the host)."""
    return torch.as_tensor(image, device=device).clone(memory_format=torch.contiguous_format)


def decode(nv: Any, views: Sequence[torch.Tensor], device: torch.device,
           host_wait: bool = True) -> list[torch.Tensor | None]:
    """Decode host uint8 tensors with nvImageCodec on ``device``'s current stream; ``None`` where it could not.

    ``host_wait=False`` (CUDA): return once the decode and the copies are queued (see the module docstring);
    the images are ready for work queued on the current stream after this call."""
    dec = decoder(nv, device)
    srcs = [v.numpy() for v in views]  # views of the (pinned) packed buffer; code streams reference them
    if device.type == "cpu":
        with dec.lock:
            images = dec.decoder.decode(srcs, params=dec.params)
        # planar RGB: already (3, H, W); the tensor is a view of the Image's host buffer and keeps it alive
        return [None if im is None else torch.from_numpy(np.asarray(im)) for im in images]
    stream = torch.cuda.current_stream(device)
    codes = srcs if host_wait else [dec.code_stream(s) for s in srcs]  # kept with the pending call
    images: Any = None
    out: list[torch.Tensor | None] = []
    try:
        with dec.lock:
            if not host_wait:
                dec.release_done()
            images = dec.decoder.decode(codes, params=dec.params, cuda_stream=stream.cuda_stream)
        out = [None if im is None else _to_torch(im, device) for im in images]
    finally:  # also after an error: whatever was queued may still read the inputs and write the images
        done = torch.cuda.Event()
        done.record(stream)
        if host_wait:
            done.synchronize()  # this thread waits for its decode and copies, as the other decoders' calls do
        else:
            with dec.lock:
                dec.pending.append(_Pending(done, (images, codes, srcs, tuple(views))))
                while len(dec.pending) > MAX_PENDING:  # far behind: wait for the oldest call (a memory bound)
                    dec.pending[0].done.synchronize()
                    del dec.pending[0]
    return out  # waited: nvImageCodec's images are released after the copies ran


def pending_calls(device: torch.device) -> int:
    """How many calls without a host wait on ``device`` still hold their images and inputs (diagnostics)."""
    dec = _DECODERS.get((os.getpid(), device.type, device.index))
    if dec is None:
        return 0
    with dec.lock:
        dec.release_done()
        return len(dec.pending)


def release(device: torch.device | None = None) -> None:
    """Wait for the pending calls (of ``device``, or of every device) and drop what they hold."""
    pid = os.getpid()
    with _LOCK:
        decs = [d for (p, kind, index), d in _DECODERS.items()
                if p == pid and (device is None or (kind, index) == (device.type, device.index))]
    for dec in decs:
        with dec.lock:
            dec.release_all()


def _release_at_exit() -> None:
    """atexit: nvImageCodec's images still held are released while CUDA still runs (after their decodes)."""
    try:
        release()
    except Exception as e:  # noqa: BLE001 - e.g. the device failed earlier: nothing left to protect
        warnings.warn(f"fastdata: releasing nvImageCodec's pending decodes at exit failed: {e!r}", RuntimeWarning,
                      stacklevel=1)


at_exit(__name__, "release nvImageCodec's pending decodes while CUDA still runs", _release_at_exit)
