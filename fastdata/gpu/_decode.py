"""The device decode stage: the :class:`PackedImages` of a batch -> images on the device.

The first step of ``CUDAPrefetcher(transform=...)``: it runs in the producer thread on the side
stream; the packed bytes stay on the host, where the device decoder (``device_decoder``, through
:mod:`fastdata.gpu._codec`) reads them. Per packed field and batch:

1. JPEGs the device decoder takes go to batched device decode calls in ``decode_threads`` threads
   (:mod:`._threads`; chunks, ``chunk_size``); the rest are decoded on the host meanwhile and copied
   (only those samples). Images whose header claims more than ``max_pixels`` are refused before any decode.
2. A failed batched call is retried image by image on the host, which finds the bad ones.
3. A bad image raises :class:`~fastdata.errors.DecodeError` naming shard, key and field, or under
   ``on_error="skip"``/``"warn"`` drops its sample from every per-sample entry (:mod:`._fields`),
   recorded in :attr:`DecodeImages.skipped`, within ``max_skips`` per epoch.

Invariants: no host synchronisation in the stage's own code (decoders wait for their own work in the
decode threads, never the training stream); decode streams per device and priority, one per call in
flight, with the priority of the stream the stage runs on; random parameters depend on sample indices
only, so chunks, threads and :meth:`DecodeImages.ahead` (:mod:`._ahead`) change no crop or flip. On the
CPU every semantic runs with host decoding. Design note: docs/design/gpu-decode.md.
"""
from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastdata.dataset import ON_ERROR, PackedImages, SkippedSampleWarning
from fastdata.decode import check_max_pixels
from fastdata.errors import DecodeError, SkipBudgetError
from fastdata.gpu._ahead import DecodeAhead
from fastdata.gpu._augment import ImageBatch
from fastdata.gpu._codec import (
    DEVICE_BACKENDS,
    HOST_BACKENDS,
    check_host_wait,
    decode_device,
    decode_host,
    default_max_pixels,
    device_backend,
    device_decodable_codes,
    host_backend,
    release_pending,
)
from fastdata.gpu._fields import drop_rows, field_name, find_packed, rebuild
from fastdata.gpu._threads import DecodeStreams, DecodeThreads, check_decode_threads
from fastdata.gpu._transforms import _check_keys

__all__ = ["DecodeImages"]

_log = logging.getLogger(__name__)


class DecodeImages:
    """Decode every :class:`~fastdata.dataset.PackedImages` in a batch into an :class:`ImageBatch`.

    Args:
        keys: decode only packed fields whose path contains one of these keys (default: all).
        device: where images are decoded to: ``None`` (the current CUDA device when CUDA is
            available, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``. Use the prefetcher's device.
        on_error: ``"raise"`` (default), ``"skip"`` or ``"warn"`` for images that cannot be decoded.
        host_decoder: ``"auto"`` (TorchCodec, else torchvision before 0.29, else Pillow), ``"torchcodec"``,
            ``"torchvision"`` (a ``RuntimeError`` here, when built, if the one named does not work) or
            ``"pillow"``: the decoder for host-side images. 16-bit images become 8-bit as
            :mod:`fastdata.decode` says.
        device_decoder: ``"auto"`` (the environment variable ``FASTDATA_DEVICE_DECODER`` where set,
            else as ``host_decoder``), ``"torchcodec"``, ``"torchvision"``, ``"nvimgcodec"`` (nvImageCodec,
            optional: ``pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg``) or ``"pillow"`` (every image
            on the host): the decoder of device-decodable JPEGs (:mod:`fastdata.gpu._codec`).
        chunk_size: images per batched device decode call; chunks are decoded in background
            threads while this one resamples the previous chunk (see :meth:`fuse`). None (default):
            the batch in ``decode_threads`` chunks when it was submitted ahead (:meth:`ahead`: decoding
            already overlaps the previous batch), else in ``max(2, decode_threads)`` (the measurements
            behind it: docs/design/gpu-decode.md).
        decode_threads: threads making device decode calls at once (1 to 32; default 1), each call on
            a stream of its own: a batch's chunks decode concurrently. For TorchCodec, whose per-device
            cache gives each concurrent call its own nvJPEG decoder, and whose call waits on the host for
            its stream. :meth:`close` ends the threads.
        host_wait: False: nvImageCodec's calls return once their decode is queued on the decode stream, its
            buffers and the packed input held until an event after their last use has completed (only
            with ``device_decoder="nvimgcodec"``; TorchCodec and torchvision wait inside their call).
            Default True: each call waits on the host for its decode (docs/design/codec.md).
        max_pixels: refuse images whose header claims more pixels, before decoding them (a failure
            under ``on_error``); default: Pillow's ``Image.MAX_IMAGE_PIXELS``, the host decoder's limit.
        max_skips: the skip budget of ``on_error="skip"``/``"warn"`` per epoch, as the dataset's
            ``max_skips=`` (which does not count this stage's skips): None (default) no limit, or an
            int: at most that many samples of one epoch (the epoch their batch was read in) dropped;
            one more raises :class:`~fastdata.errors.SkipBudgetError` naming its shard and key, with
            the epoch's skip records in ``.skipped``. A sample dropped again (a pass repeated over
            the same epoch) counts once. Not a fraction: the stage does not know the epoch's size.

    Follow it with geometric transforms (``RandomResizedCrop``, ...) in :class:`fastdata.gpu.Compose`.
    """

    def __init__(self, keys: Sequence[str | int] | str | int | None = None, *,
                 device: str | torch.device | None = None, on_error: str = "raise",
                 host_decoder: str = "auto", chunk_size: int | None = None, max_pixels: int | None = None,
                 device_decoder: str = "auto", max_skips: int | None = None, decode_threads: int = 1,
                 host_wait: bool = True) -> None:
        keys = _check_keys("DecodeImages", keys)  # a float, a bool or an object: a ValueError naming keys
        self.keys = None if keys is None else frozenset(keys)
        if on_error not in ON_ERROR:
            raise ValueError(f"DecodeImages: on_error must be one of {ON_ERROR}, got {on_error!r}")
        if host_decoder not in HOST_BACKENDS:
            raise ValueError(f"DecodeImages: host_decoder must be one of {HOST_BACKENDS}, got {host_decoder!r}")
        if device_decoder not in DEVICE_BACKENDS:
            raise ValueError(f"DecodeImages: device_decoder must be one of {DEVICE_BACKENDS}, got {device_decoder!r}")
        resolved = device_backend(device_decoder)  # a missing nvImageCodec (a bad FASTDATA_DEVICE_DECODER) fails here
        try:
            self.host_wait = check_host_wait(resolved, host_wait)
        except ValueError as e:
            raise ValueError(f"DecodeImages: {e}") from None
        self.decode_threads = check_decode_threads(decode_threads)
        if host_decoder != "auto":  # so does a library asked for by name that does not work here
            host_backend(host_decoder)
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"DecodeImages: device must be 'cpu', 'cuda', 'cuda:N', a torch.device or None, "
                                 f"got {device!r}") from e
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"DecodeImages: device must be 'cpu' or CUDA, got {device!r}")
            if device.type == "cuda" and not torch.cuda.is_available():  # as CUDAPrefetcher: not at the first batch
                raise ValueError(f"DecodeImages: device={str(device)!r} requested but CUDA is not available")
        self.device = device
        self.on_error = on_error
        self.host_decoder = host_decoder
        self.device_decoder = device_decoder
        self.skipped: list[dict[str, Any]] = []
        self.host_decoded = 0  # images decoded on the host on a CUDA device (fallbacks), for diagnostics
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):
            raise ValueError(f"DecodeImages: chunk_size must be None or an int >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.max_pixels = check_max_pixels(max_pixels)
        if max_skips is not None and (isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 0):
            raise ValueError(f"DecodeImages: max_skips must be None or an int >= 0 (samples per epoch; not a fraction: "
                             f"the stage does not know the epoch's size), got {max_skips!r}")
        self.max_skips = max_skips
        # max_skips: the skips of the epochs seen last (a train and a validation pipeline may share the stage),
        # per epoch by (shard, key): a sample skipped again in a repeated pass counts once
        self._budget: dict[int, dict[tuple[str, str], dict[str, Any]]] = {}
        self._threads = DecodeThreads(self.decode_threads)
        self._streams: dict[tuple[torch.device, int], DecodeStreams] = {}  # by device and priority
        self._warned_device = False

    def _device(self) -> torch.device:
        if self.device is not None:
            if self.device.type == "cuda" and self.device.index is None:
                return torch.device("cuda", torch.cuda.current_device())
            return self.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __call__(self, batch: Any) -> Any:
        """The batch with each packed field replaced by an :class:`ImageBatch` of its decoded images."""
        return self.fuse(batch, ())

    def fuse(self, batch: Any, geometric: Sequence[Any]) -> Any:
        """Decode, apply the ``geometric`` transforms (``.apply(ImageBatch)``) and render, chunk by chunk.

        :class:`fastdata.gpu.Compose` calls this for ``DecodeImages`` followed by geometric transforms.
        On CUDA the device-decodable images are decoded in chunks (``chunk_size``) by a background
        thread (the decode call blocks its thread until nvJPEG is done) while this thread
        decodes the host-routed images and resamples the chunks already decoded: decoding and
        resampling overlap. Random parameters depend on sample indices only, so the result is the
        same as for the whole batch at once. Fields whose images end in different sizes stay ImageBatches.
        """
        device = self._device()
        found: list[tuple[tuple[Any, ...], PackedImages]] = []
        find_packed(batch, (), found)
        selected = [(p, pk) for p, pk in found if self.keys is None or any(k in self.keys for k in p)]
        if not selected:  # nothing packed: unchanged, unless that would silently skip packed fields or transforms
            if found:
                raise ValueError(f"DecodeImages: keys {list(self.keys or ())} match none of the batch's packed image "
                                 f"fields {[field_name(p) for p, _ in found]}")
            if geometric:  # as the transforms would say on their own ("the batch holds no ImageBatch")
                has = f"keys {list(batch)}" if isinstance(batch, dict) else f"a {type(batch).__name__}"
                raise ValueError(f"DecodeImages: the batch holds no packed images for {list(geometric)} (the batch "
                                 f"has {has}); build the ShardedDataset with image_decode='device'")
            return batch
        found = selected
        sizes = {len(pk) for _, pk in found}
        if len(sizes) != 1:
            raise ValueError(f"DecodeImages: packed fields of one batch hold different image counts: {sorted(sizes)}")
        n = sizes.pop()
        backend = host_backend(self.host_decoder)
        bad: dict[int, str] = {}
        results = {path: self._field(packed, field_name(path), device, backend, bad, geometric) for path, packed in found}
        keep = [i for i in range(n) if i not in bad]
        replace: dict[tuple[Any, ...], Any] = {}
        for path, (value, rows) in results.items():
            if isinstance(value, ImageBatch):  # rows: the batch row of each image
                replace[path] = value.select([k for k, r in enumerate(rows) if r not in bad])
            else:  # a rendered tensor with a row per sample (rows of bad samples unwritten)
                replace[path] = value.index_select(0, _index(keep, value.device)) if bad else value
        out = rebuild(batch, (), replace)
        if bad:
            out = drop_rows(out, n, keep, set(replace))
        return out

    def _field(self, packed: PackedImages, field: str, device: torch.device, backend: str, bad: dict[int, str],
               geometric: Sequence[Any]) -> tuple[Any, list[int] | None]:
        """One packed field: ``(tensor, None)`` rendered (a row per sample), or ``(ImageBatch, rows)``
        with ``geometric`` pending when its images do not end in one size (``rows``: batch row per image)."""
        n = len(packed)
        views = packed.views()
        ids = packed.indices.numpy()
        pending = packed.pending if packed.pending is not None and packed.pending[0] == device else None
        packed.pending = None
        if pending is not None and any(f.cancelled() for _, f in pending[2]):  # close() between submit and now
            pending = None
        if pending is None:
            pending = self._start(packed, views, device, ahead=False)
        _, on_device, pieces = pending
        on_host = sorted(set(range(n)) - set(on_device))  # decoded here while the device chunks decode
        pieces.insert(0, (on_host, self._host(packed, on_host, views, field, device, backend, bad)))
        out: torch.Tensor | None = None
        done: list[tuple[list[int], ImageBatch]] = []
        ragged = 0  # non-empty chunks not rendered into ``out``
        for rows, images in pieces:
            if not isinstance(images, list):  # a future of the background decode
                try:
                    images = _take(self._threads.result(images), device)
                except RuntimeError as e:  # torchvision: one bad image fails the call: find it on the host
                    _log.debug("batched device decode failed (%s); decoding its %d images on the host", e, len(rows))
                    images = self._host(packed, rows, views, field, device, backend, bad)
                    if not any(r in bad for r in rows):  # no bad image explains it: the device decoder fails
                        self._device_failed(e, len(rows))
                except BaseException as e:  # not a decoder's failure: raised here, naming what was decoded
                    e.add_note(f"fastdata: raised by the device decode ({self.resolved_device_decoder}) of {len(rows)} "
                               f"images of field {field!r}, {packed.where(rows[0])} to {packed.where(rows[-1])}")
                    raise
                else:
                    missing = [k for k, im in enumerate(images) if im is None]
                    if missing:  # nvImageCodec: the images it could not decode, on the host
                        _log.debug("device decoder returned %d of %d images undecoded; decoding them on the host",
                                   len(missing), len(rows))
                        redo = self._host(packed, [rows[k] for k in missing], views, field, device, backend, bad)
                        for k, im in zip(missing, redo):
                            images[k] = im
            ok = [k for k, r in enumerate(rows) if r not in bad]
            rows = [rows[k] for k in ok]
            if not rows:
                continue
            ib = ImageBatch([images[k] for k in ok], ids[rows], packed.epoch)
            for t in geometric:
                ib = t.apply(ib)
            done.append((rows, ib))
            size = ib.uniform_size() if geometric else None
            if size is not None and out is None and not ragged:
                out = torch.empty((n, int(ib.images[0].shape[0]), *size), dtype=torch.uint8, device=device)
            if out is not None and size is not None and tuple(out.shape[2:]) == size:
                ib.render(out=out, rows=rows)
            else:
                ragged += 1
        if out is not None and not ragged:
            return out, None
        if not done:  # every image of the field failed (on_error skip/warn): an empty batch
            if geometric:  # of the size the transforms give every image (decoded images are RGB), where fixed
                probe = ImageBatch([torch.zeros((3, 1, 1), dtype=torch.uint8, device=device)], [0], packed.epoch)
                for t in geometric:
                    probe = t.apply(probe)
                size = probe.uniform_size()
                if size is not None:
                    return torch.empty((0, 3, *size), dtype=torch.uint8, device=device), None
            return ImageBatch([], [], packed.epoch), []
        rows = [r for rs, _ in done for r in rs]
        return _concat([ib for _, ib in done], rows), sorted(rows)  # chunk results in different sizes

    def _start(self, packed: PackedImages, views: list[torch.Tensor], device: torch.device,
               ahead: bool) -> tuple[torch.device, list[int], list[tuple[list[int], Any]]]:
        """Submit the device-decodable images of ``packed`` to the background decode thread, in chunks."""
        ok = device_decodable_codes(packed.codes()) & ~self._oversized(packed)
        decoder = device_backend(self.device_decoder)
        # on the CPU only nvImageCodec (its CPU backend) takes device-routed images
        on_device = (np.flatnonzero(ok).tolist() if (device.type == "cuda" and decoder != "pillow")
                     or decoder == "nvimgcodec" else [])
        parts = self.decode_threads if ahead else max(2, self.decode_threads)
        size = self.chunk_size or -(-len(on_device) // parts)
        chunks = [on_device[k : k + size] for k in range(0, len(on_device), max(size, 1))]
        if not chunks:
            return device, on_device, []
        streams = self._decode_streams(device) if device.type == "cuda" else None
        return device, on_device, [(c, self._threads.submit(_decode_chunk, [views[i] for i in c], device, streams,
                                                            decoder, self.host_wait)) for c in chunks]

    def _limit(self) -> int | None:
        return self.max_pixels if self.max_pixels is not None else default_max_pixels()

    def _oversized(self, packed: PackedImages) -> np.ndarray:
        """Which images' headers claim more than the pixel limit (never decoded)."""
        limit = self._limit()
        sizes = packed.sizes()
        if limit is None:
            return np.zeros(len(sizes), dtype=bool)
        return sizes[:, 0] * sizes[:, 1] > limit

    def submit(self, batch: Any) -> None:
        """Start decoding the packed fields of ``batch`` in the background (see :meth:`ahead`)."""
        device = self._device()
        if device.type != "cuda":
            return
        found: list[tuple[tuple[Any, ...], PackedImages]] = []
        find_packed(batch, (), found)
        for path, packed in found:
            if (self.keys is None or any(k in self.keys for k in path)) and packed.pending is None:
                packed.pending = self._start(packed, packed.views(), device, ahead=True)

    def ahead(self, iterable: Any, batches: int = 1) -> DecodeAhead:
        """``iterable`` (e.g. a DataLoader) reading ``batches`` batches ahead and starting their device decode early.

        Give it to ``CUDAPrefetcher`` in place of the loader: the decode of batches ``i + 1`` to
        ``i + batches`` then runs while this stage resamples batch ``i`` (more device memory for
        decoded images in flight). ``state_dict()`` and other attributes are the loader's, as of the
        batch last yielded (batches read ahead are not counted).
        """
        return DecodeAhead(iterable, self, batches)

    def _decode_streams(self, device: torch.device) -> DecodeStreams:
        # per device and priority for the life of the stage (no stream per batch; one per decode call in flight),
        # with the priority of the stream it is called on (CUDAPrefetcher(stream_priority="high") -> high), also
        # when one stage serves prefetchers of both priorities
        priority = torch.cuda.current_stream(device).priority
        streams = self._streams.get((device, priority))
        if streams is None:
            streams = self._streams[(device, priority)] = DecodeStreams(device, priority)
        return streams

    def _host(self, packed: PackedImages, rows: list[int], views: list[torch.Tensor], field: str, device: torch.device, backend: str, bad: dict[int, str]) -> list[torch.Tensor | None]:
        """Decode images ``rows`` on the host (and move them to ``device``); failures go to ``bad``."""
        out: list[torch.Tensor | None] = []
        oversized = self._oversized(packed)
        for i in rows:
            if oversized[i]:
                h, w = packed.sizes()[i].tolist()
                self._failed(packed, i, field, f"its header claims {h}x{w} = {h * w} pixels, over max_pixels="
                             f"{self._limit()}", bad)
                out.append(None)
                continue
            try:
                img = decode_host(views[i], packed.info(i), backend, self.max_pixels)
            except Exception as e:  # noqa: BLE001 - any failure of a codec on shard bytes
                self._failed(packed, i, field, f"{type(e).__name__}: {e}", bad)
                out.append(None)
                continue
            if device.type == "cuda":
                self.host_decoded += 1
                img = img.pin_memory().to(device, non_blocking=True)
            out.append(img)
        return out

    def _device_failed(self, error: BaseException, n: int) -> None:
        """Warn (once per stage) that the device decoder failed on images that all decode on the host: every
        batch then goes to the host, many times slower, which a debug log line alone would hide."""
        if not self._warned_device:
            self._warned_device = True
            warnings.warn(f"DecodeImages: the device decoder ({self.device_decoder}) failed on {n} images that decode "
                          f"fine on the host ({type(error).__name__}: {str(error)[:300]}); they, and any others it "
                          "fails on, are decoded on the host, many times slower (see decode.host_decoded)",
                          RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        """End the decode threads (joined after their current call) and, with ``host_wait=False``, wait for the
        decodes whose buffers and inputs are still held, and release them. The stage stays usable: its next
        batch starts new threads. Also ``with DecodeImages(...) as decode:``."""
        self._threads.close()
        if not self.host_wait:
            release_pending()

    def __enter__(self) -> DecodeImages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_streams"] = {}  # the threads pickle as their count: a new process starts its own
        return state

    def _failed(self, packed: PackedImages, i: int, field: str, reason: str, bad: dict[int, str]) -> None:
        msg = f"{packed.where(i)} field {field!r}: cannot decode image ({packed.info(i).format}): {reason}"
        if self.on_error == "raise":
            raise DecodeError(msg)
        if i not in bad:
            record = {"shard": packed.shards[i], "key": packed.keys[i], "index": int(packed.indices[i]),
                      "epoch": packed.epoch, "reason": msg}
            self.skipped.append(record)
            if self.on_error == "warn":
                warnings.warn(f"skipped sample {packed.keys[i]!r} of shard {packed.shards[i]}: {msg}",
                              SkippedSampleWarning, stacklevel=4)
            self._count_skip(record)
        bad[i] = msg

    def _count_skip(self, record: dict[str, Any]) -> None:
        """Count a skip against ``max_skips`` (per epoch, each sample once): one too many raises SkipBudgetError."""
        if self.max_skips is None:
            return
        epoch = record["epoch"]
        skips = self._budget.pop(epoch, None)
        self._budget[epoch] = skips = {} if skips is None else skips  # the most recent epoch last
        while len(self._budget) > 4:
            del self._budget[next(iter(self._budget))]
        skips.setdefault((record["shard"], record["key"]), record)
        if len(skips) > self.max_skips:
            records = list(skips.values())
            shown = "; ".join(f"{r['shard']}: {r['key']!r}" for r in records[:3])
            more = f" (and {len(records) - 3} more)" if len(records) > 3 else ""
            raise SkipBudgetError(f"DecodeImages: {record['reason']}: {len(records)} samples of epoch {epoch} "
                                  f"skipped, more than max_skips={self.max_skips} allows; skipped: {shown}{more} "
                                  "(all in SkipBudgetError.skipped)", records)

    @property
    def resolved_device_decoder(self) -> str:
        """The device decoder ``device_decoder`` resolves to here (see :func:`fastdata.gpu._codec.device_backend`)."""
        return device_backend(self.device_decoder)

    @property
    def num_skipped(self) -> int:
        """Samples dropped so far under ``on_error="skip"``/``"warn"``."""
        return len(self.skipped)

    def __repr__(self) -> str:
        keys = None if self.keys is None else sorted(self.keys, key=str)
        extra = "".join(f", {k}={v!r}" for k, v, default in (("decode_threads", self.decode_threads, 1),
                                                             ("host_wait", self.host_wait, True)) if v != default)
        return (f"DecodeImages(keys={keys}, device={self.device}, on_error={self.on_error!r}, "
                f"device_decoder={self.device_decoder!r}{extra})")


def _decode_chunk(views: list[torch.Tensor], device: torch.device, streams: DecodeStreams | None, decoder: str,
                  host_wait: bool) -> tuple[list[torch.Tensor | None], torch.cuda.Event | None]:
    """A decode thread: decode on a stream of the stage's of its own for the call (torchvision orders it after
    its own decode stream); the event, recorded there after the call, marks the images ready (``_take`` joins
    it to the consumer's stream). On the CPU (nvImageCodec's CPU backend): no stream, no event. ``None``
    entries: images the decoder could not decode."""
    try:
        if streams is None:
            return decode_device(views, device, decoder, host_wait=host_wait), None
        stream = streams.take()
        try:
            with torch.cuda.stream(stream):
                images = decode_device(views, device, decoder, host_wait=host_wait)
                ready = torch.cuda.Event()
                ready.record(stream)
        finally:
            streams.give(stream)
        return images, ready
    except BaseException as e:  # handed to the consumer with its traceback (DecodeThreads.result)
        e.add_note(f"fastdata: in thread {threading.current_thread().name}, decoding {len(views)} images with "
                   f"{decoder!r}")
        raise


def _take(result: tuple[list[torch.Tensor | None], torch.cuda.Event | None],
          device: torch.device) -> list[torch.Tensor | None]:
    """Decoded images made usable on the current stream: it waits for them, the allocator knows it uses them."""
    images, ready = result
    if ready is None:  # decoded on the CPU
        return images
    stream = torch.cuda.current_stream(device)
    stream.wait_event(ready)
    for im in images:
        if im is not None:
            im.record_stream(stream)
    return images


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    idx = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return idx.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else idx


def _concat(parts: list[ImageBatch], rows: list[int]) -> ImageBatch:
    """One ImageBatch from per-chunk ones whose images came from batch ``rows``, in row order."""
    order = np.argsort(np.asarray(rows, dtype=np.int64), kind="stable")
    images = [im for p in parts for im in p.images]
    geom = np.concatenate([p.geom for p in parts]).reshape(-1, 4)
    clip = np.concatenate([p.clip for p in parts]).reshape(-1, 4)
    frame = np.concatenate([p.frame for p in parts]).reshape(-1, 4)
    window = np.concatenate([p.window for p in parts]).reshape(-1, 4)
    size = np.concatenate([p.size for p in parts]).reshape(-1, 2)
    ids = np.concatenate([p.ids for p in parts]).astype(np.int64)
    return ImageBatch([images[i] for i in order.tolist()], ids[order], parts[0].epoch, geom=geom[order],
                      clip=clip[order], size=size[order], frame=frame[order],
                      window=window[order])
