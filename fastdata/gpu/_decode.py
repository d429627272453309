"""The device decode stage: :class:`PackedImages` in a batch -> :class:`ImageBatch` on the device.

Meant as the first step of ``CUDAPrefetcher(transform=...)``, which runs it in its producer thread
on its side stream after copying the batch's tensors; the prefetcher leaves ``PackedImages`` on
the host (it is not a container it walks), which is where nvJPEG (through torchvision) reads its
input. Per packed field and batch:

1. Route each image by the header facts sniffed in the worker: JPEGs the device decoder takes
   (:func:`fastdata.gpu._codec.device_decodable`) go to one batched device decode call; the rest
   (PNG, CMYK, 12-bit, arithmetic-coded, unknown) are decoded on the host, pinned and copied
   with ``non_blocking`` (only those samples).
2. If the batched call fails (a corrupt JPEG fails the whole call), each of its images is decoded
   on the host instead, which finds the bad ones.
3. A bad image raises :class:`~fastdata.errors.DecodeError` naming shard, key and field; with
   ``on_error="skip"``/``"warn"`` its sample is dropped from every per-sample entry of the batch
   (tensors and lists whose length is the batch size), so shapes stay consistent, and recorded in
   :attr:`DecodeImages.skipped`.

No host synchronisation happens in this stage's own code: sizes come from tensor metadata and the
headers, parameters go to the device from pinned memory with ``non_blocking``. (torchvision's CUDA
decode waits on the host for its private decode stream; that blocks this producer thread, not
the training stream.) On the CPU (``device="cpu"``) every image is decoded on the host with the
same routing and error handling, so every semantic is testable without a GPU.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastdata.dataset import ON_ERROR, ImageInfo, PackedImages, SkippedSampleWarning
from fastdata.errors import DecodeError
from fastdata.gpu._augment import ImageBatch
from fastdata.gpu._codec import HOST_BACKENDS, decode_device, decode_host, device_decodable, host_backend

__all__ = ["DecodeImages"]

_log = logging.getLogger(__name__)


class DecodeImages:
    """Decode every :class:`~fastdata.dataset.PackedImages` in a batch into an :class:`ImageBatch`.

    Args:
        keys: decode only packed fields whose path contains one of these keys (default: all).
        device: where images are decoded to: ``None`` (the current CUDA device when CUDA is
            available, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``. Use the prefetcher's device.
        on_error: ``"raise"`` (default), ``"skip"`` or ``"warn"`` for images that cannot be decoded.
        host_decoder: ``"auto"`` (torchvision when it works here, else Pillow), ``"torchvision"``
            or ``"pillow"``: the decoder for host-side images.

    Follow it with geometric transforms (``RandomResizedCrop``, ...) in :class:`fastdata.gpu.Compose`.
    """

    def __init__(self, keys: Sequence[str | int] | str | int | None = None, *,
                 device: str | torch.device | None = None, on_error: str = "raise",
                 host_decoder: str = "auto") -> None:
        if isinstance(keys, (str, int)):
            keys = (keys,)
        self.keys = None if keys is None else frozenset(keys)
        if on_error not in ON_ERROR:
            raise ValueError(f"DecodeImages: on_error must be one of {ON_ERROR}, got {on_error!r}")
        if host_decoder not in HOST_BACKENDS:
            raise ValueError(f"DecodeImages: host_decoder must be one of {HOST_BACKENDS}, got {host_decoder!r}")
        if device is not None:
            device = torch.device(device)
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"DecodeImages: device must be 'cpu' or CUDA, got {device!r}")
        self.device = device
        self.on_error = on_error
        self.host_decoder = host_decoder
        self.skipped: list[dict[str, Any]] = []
        self.host_decoded = 0  # images decoded on the host on a CUDA device (fallbacks), for diagnostics

    def _device(self) -> torch.device:
        if self.device is not None:
            if self.device.type == "cuda" and self.device.index is None:
                return torch.device("cuda", torch.cuda.current_device())
            return self.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __call__(self, batch: Any) -> Any:
        device = self._device()
        backend = host_backend(self.host_decoder)
        found: list[tuple[tuple[Any, ...], PackedImages]] = []
        _find(batch, (), found)
        found = [(p, pk) for p, pk in found if self.keys is None or any(k in self.keys for k in p)]
        if not found:
            return batch
        sizes = {len(pk) for _, pk in found}
        if len(sizes) != 1:
            raise ValueError(f"DecodeImages: packed fields of one batch hold different image counts: {sorted(sizes)}")
        n = sizes.pop()
        decoded: dict[tuple[Any, ...], list[torch.Tensor | None]] = {}
        bad: dict[int, str] = {}
        for path, packed in found:
            decoded[path] = self._decode(packed, _field(path), device, backend, bad)
        keep = [i for i in range(n) if i not in bad]
        replace = {path: ImageBatch([imgs[i] for i in keep], packed.indices.numpy()[keep], packed.epoch)
                   for (path, packed), imgs in zip(found, decoded.values())}
        out = _rebuild(batch, (), replace)
        if bad:
            out = _drop_rows(out, n, keep, set(replace))
        return out

    def _decode(self, packed: PackedImages, field: str, device: torch.device, backend: str,
                bad: dict[int, str]) -> list[torch.Tensor | None]:
        n = len(packed)
        infos = [ImageInfo(c) for c in packed.codes()]
        views = packed.views()
        out: list[torch.Tensor | None] = [None] * n
        on_device = [i for i in range(n) if device.type == "cuda" and device_decodable(infos[i])]
        if on_device:
            try:
                for i, img in zip(on_device, decode_device([views[i] for i in on_device], device)):
                    out[i] = img
                on_device_set = set(on_device)
            except RuntimeError as e:  # one bad image fails the call: find it on the host
                _log.debug("batched device decode failed (%s); decoding its %d images on the host", e, len(on_device))
                on_device_set = set()
        else:
            on_device_set = set()
        for i in range(n):
            if i in on_device_set:
                continue
            try:
                img = decode_host(views[i], infos[i], backend)
            except Exception as e:  # noqa: BLE001 - any failure of a codec on shard bytes
                self._failed(packed, i, field, f"{type(e).__name__}: {e}", bad)
                continue
            if device.type == "cuda":
                self.host_decoded += 1
                img = img.pin_memory().to(device, non_blocking=True)
            out[i] = img
        return out

    def _failed(self, packed: PackedImages, i: int, field: str, reason: str, bad: dict[int, str]) -> None:
        msg = f"{packed.where(i)} field {field!r}: cannot decode image ({packed.info(i).format}): {reason}"
        if self.on_error == "raise":
            raise DecodeError(msg)
        if i not in bad:
            record = {"shard": packed.shards[i], "key": packed.keys[i], "index": int(packed.indices[i]),
                      "reason": msg}
            self.skipped.append(record)
            if self.on_error == "warn":
                warnings.warn(f"skipped sample {packed.keys[i]!r} of shard {packed.shards[i]}: {msg}",
                              SkippedSampleWarning, stacklevel=4)
        bad[i] = msg

    @property
    def num_skipped(self) -> int:
        """Samples dropped so far under ``on_error="skip"``/``"warn"``."""
        return len(self.skipped)

    def __repr__(self) -> str:
        keys = None if self.keys is None else sorted(self.keys, key=str)
        return f"DecodeImages(keys={keys}, device={self.device}, on_error={self.on_error!r})"


def _field(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "<batch>"


def _find(obj: Any, path: tuple[Any, ...], found: list) -> None:
    if isinstance(obj, PackedImages):
        found.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _find(v, (*path, k), found)
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            _find(v, (*path, k), found)


def _rebuild(obj: Any, path: tuple[Any, ...], replace: dict[tuple[Any, ...], Any]) -> Any:
    if path in replace:
        return replace[path]
    if isinstance(obj, dict):
        return {k: _rebuild(v, (*path, k), replace) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (PackedImages, dict, list, tuple)) for v in obj):
        items = [_rebuild(v, (*path, k), replace) for k, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _drop_rows(obj: Any, n: int, keep: list[int], done: set, path: tuple[Any, ...] = ()) -> Any:
    """Keep rows ``keep`` of every per-sample entry: tensors with first dim ``n``, lists of ``n`` leaves."""
    if path in done:
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 1 and obj.shape[0] == n:
            idx = torch.from_numpy(np.asarray(keep, dtype=np.int64))
            if obj.device.type == "cuda":
                idx = idx.pin_memory().to(obj.device, non_blocking=True)
            return obj.index_select(0, idx)
        return obj
    if isinstance(obj, dict):
        return {k: _drop_rows(v, n, keep, done, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        containers = any(isinstance(v, (torch.Tensor, PackedImages, ImageBatch, dict, list, tuple)) for v in obj)
        if not containers and len(obj) == n:
            items = [obj[i] for i in keep]
        else:
            items = [_drop_rows(v, n, keep, done, (*path, k)) for k, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
