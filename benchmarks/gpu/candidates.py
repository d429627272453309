"""The ways of running the device decode stage that `check.sh` compares: one table, a row per candidate.

Part (b) (`decode_contention.py`) measures every available decoder in ``DECODERS`` under every row of
``CANDIDATES`` that applies to it, on each stream priority in ``PRIORITIES``; part (c) (`train_e2e.py
--decode-candidate NAME`) trains resnet18 through the best of them. A new way of running the stage is
one more row: a read-ahead depth, more ``DecodeImages`` arguments (``stage``), and the decoders it
applies to (``decoders``; a codec-side candidate, such as nvImageCodec's hardware backend without a
host wait per call (``nowait``) or TorchCodec's per-device decoder cache with several decode threads
(``threads4``), names its decoder there and the ``DecodeImages`` argument that selects it in ``stage``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

DECODERS = ("torchvision", "torchcodec", "nvimgcodec")  # device_decoder names, in the order measured
PRIORITIES = ("normal", "high")  # CUDAPrefetcher(stream_priority=...)


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    about: str
    ahead: int = 1  # DecodeImages.ahead(loader, batches=ahead); 0: no read-ahead
    stage: tuple[tuple[str, Any], ...] = ()  # more DecodeImages(...) arguments, as (name, value) pairs
    decoders: tuple[str, ...] | None = None  # the decoders it applies to (None: every one available)

    def applies_to(self, decoder: str) -> bool:
        return self.decoders is None or decoder in self.decoders

    def decode_stage(self, decoder: str, device: Any, **kwargs: Any) -> Any:
        """``fastdata.gpu.DecodeImages`` for this candidate and ``decoder`` (``kwargs``: e.g. ``keys``)."""
        from fastdata import gpu

        return gpu.DecodeImages(device=device, device_decoder=decoder, **dict(self.stage), **kwargs)

    def source(self, decode: Any, iterable: Any) -> Any:
        """What the prefetcher iterates: ``iterable`` read ahead by ``decode`` (or as is, ``ahead=0``)."""
        return decode.ahead(iterable, batches=self.ahead) if self.ahead else iterable


# The codec-side rows come before ahead2: they apply to one decoder each, so when the budget runs short
# every candidate has been measured on some decoder before ahead2's rows for the others.
CANDIDATES: tuple[Candidate, ...] = (
    Candidate("ahead1", "one batch decoded ahead (DecodeImages.ahead): today's pipeline", ahead=1),
    Candidate("nowait", "nvImageCodec's JPEG engines on the stage's decode stream without a host wait per call "
              "(DecodeImages(host_wait=False))", stage=(("host_wait", False),), decoders=("nvimgcodec",)),
    Candidate("threads4", "TorchCodec's per-device decoder cache with four decode threads, each call on a stream "
              "of its own (DecodeImages(decode_threads=4))", stage=(("decode_threads", 4),), decoders=("torchcodec",)),
    Candidate("ahead2", "two batches decoded ahead (DecodeImages.ahead(batches=2))", ahead=2),
)


def by_name(name: str) -> Candidate:
    for c in CANDIDATES:
        if c.name == name:
            return c
    raise ValueError(f"unknown decode candidate {name!r}; known: {[c.name for c in CANDIDATES]}")


def decoder_status(names: tuple[str, ...] = DECODERS) -> dict[str, str | None]:
    """Per decoder: None when it can run here, else why not (unknown to this checkout, not installed)."""
    from fastdata.gpu import _codec

    out: dict[str, str | None] = {}
    for name in names:
        try:
            _codec.device_backend(name)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - ValueError (unknown name) or DecoderUnavailableError
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return out
