"""Encoded image fields that travel undecoded from the workers to the device decode stage.

With ``ShardedDataset(image_decode="device")`` each image field of a sample is an
:class:`EncodedImage`: its bytes plus where they came from (shard, key) and which sample they
belong to (global sample index, epoch). The decode stage needs the first for its error messages,
the random augmentations need the second for their per-sample parameters (a counter-based hash
of seed, epoch and index, so a resumed run draws the same crops).

:func:`collate` (``fastdata.DataLoader`` uses it for such a dataset when no ``collate_fn`` is
given; it is ``torch.utils.data.default_collate`` for everything else) packs one field of a batch
into a :class:`PackedImages`: one uint8 tensor with all the bytes and one int64 tensor with the
offsets and the sample indices. So two tensors per image field and batch cross the worker queue
(two shared-memory file descriptors, not one per image), ``pin_memory`` pins one buffer, and the
batch carries about half the bytes of decoded 224 px images. ``PackedImages`` is deliberately not
a container that :mod:`fastdata.prefetch.tree` walks: ``CUDAPrefetcher`` leaves it on the host,
where ``torchvision.io.decode_jpeg(..., device="cuda")`` wants its input.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate as _torch_collate
from torch.utils.data._utils.collate import default_collate_fn_map

__all__ = ["FORMATS", "EncodedImage", "ImageInfo", "PackedImages", "collate", "key_index", "sniff", "sniff_size"]

# ---------------------------------------------------------------------------------------------
# Header sniffing: which format, and for JPEG the facts a decoder's capabilities depend on. Done
# in the worker (inside collate), so the main process routes images without touching their bytes.

FORMATS = ("unknown", "jpeg", "png", "webp", "gif", "bmp", "tiff", "pnm")
_MAGIC = (
    (b"\xff\xd8", "jpeg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"GIF87a", "gif"), (b"GIF89a", "gif"),
    (b"BM", "bmp"), (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"),
)
_NO_SOF = 255  # JPEG whose header ends (or breaks) before a frame header: not decodable
_NO_ADOBE = 255
# SOFn markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC)
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# A side a header may claim, as packed (``height << 32 | width`` in an int64): PNG's limit. A corrupt header
# claiming more is kept at this, still far over any pixel limit, not an OverflowError that fails the batch.
_MAX_SIDE = (1 << 31) - 1


class ImageInfo(tuple):
    """What :func:`sniff` found: ``(format, sof, components, precision, adobe_transform)``.

    ``sof`` is the JPEG frame type (0 baseline, 1 extended, 2 progressive, 3 lossless, 9+ arithmetic)
    or None when no frame header was found (a corrupt or truncated header); ``adobe_transform`` is the
    APP14 colour transform flag (0: RGB/CMYK stored as is, 1: YCbCr, 2: YCCK) or None without APP14.
    """

    __slots__ = ()

    def __new__(cls, code: int) -> ImageInfo:  # noqa: PYI034 - a tuple subclass without typing.Self (Python 3.10)
        code = int(code)
        fmt = FORMATS[code & 0xFF] if (code & 0xFF) < len(FORMATS) else "unknown"
        sof, adobe = (code >> 8) & 0xFF, (code >> 32) & 0xFF
        return super().__new__(cls, (fmt, None if sof == _NO_SOF else sof, (code >> 16) & 0xFF,
                                     (code >> 24) & 0xFF, None if adobe == _NO_ADOBE else adobe))

    format = property(lambda self: self[0])
    sof = property(lambda self: self[1])
    components = property(lambda self: self[2])
    precision = property(lambda self: self[3])
    adobe_transform = property(lambda self: self[4])


def sniff(data: Any) -> int:
    """A compact int code of the image header (decode it with :class:`ImageInfo`)."""
    return _header(data)[0]


def sniff_size(data: Any) -> tuple[int, int]:
    """``(height, width)`` the image header claims (0, 0 when the format or header does not say; a side over
    2**31 - 1, a corrupt header, as 2**31 - 1)."""
    return _header(data)[1]


def _header(data: Any) -> tuple[int, tuple[int, int]]:
    b = memoryview(data).cast("B")
    head = bytes(b[:26])
    fmt = "unknown"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            fmt = name
            break
    else:
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            fmt = "webp"
        elif len(head) >= 2 and head[0:1] == b"P" and head[1:2] in b"123456":
            fmt = "pnm"
    code = FORMATS.index(fmt)
    if fmt != "jpeg":
        size = (0, 0)
        if fmt == "png" and len(head) >= 24 and head[12:16] == b"IHDR":
            size = (int.from_bytes(head[20:24], "big"), int.from_bytes(head[16:20], "big"))
        elif fmt == "gif" and len(head) >= 10:
            size = (int.from_bytes(head[8:10], "little"), int.from_bytes(head[6:8], "little"))
        elif fmt == "bmp" and len(head) >= 26 and head[14:18] == b"\x0c\0\0\0":  # OS/2 core header: 16-bit sides
            size = (int.from_bytes(head[20:22], "little"), int.from_bytes(head[18:20], "little"))
        elif fmt == "bmp" and len(head) >= 26:
            size = (abs(int.from_bytes(head[22:26], "little", signed=True)), int.from_bytes(head[18:22], "little"))
        return code | (_NO_SOF << 8) | (_NO_ADOBE << 32), (min(size[0], _MAX_SIDE), min(size[1], _MAX_SIDE))
    sof, comps, precision, adobe, h, w = _jpeg_frame(b)
    return code | (sof << 8) | (comps << 16) | (precision << 24) | (adobe << 32), (h, w)


def _jpeg_frame(b: memoryview) -> tuple[int, int, int, int, int, int]:
    """(sof, components, precision, adobe transform, height, width) of a JPEG; sof = 255 when no frame header."""
    n, p, adobe = len(b), 2, _NO_ADOBE
    while p + 4 <= n:
        if b[p] != 0xFF:
            break  # not a marker where one must be: corrupt header
        m = b[p + 1]
        if m == 0xFF:  # fill byte
            p += 1
            continue
        if m == 0x01 or 0xD0 <= m <= 0xD8:  # standalone markers
            p += 2
            continue
        if m in (0xD9, 0xDA):  # end of image or scan data before any frame header
            break
        length = (b[p + 2] << 8) | b[p + 3]
        if length < 2:
            break
        if m in _SOF_MARKERS:
            if p + 10 > n:
                break
            return m - 0xC0, b[p + 9], b[p + 4], adobe, (b[p + 5] << 8) | b[p + 6], (b[p + 7] << 8) | b[p + 8]
        if m == 0xEE and length >= 12 and p + 16 <= n and bytes(b[p + 4 : p + 9]) == b"Adobe":
            adobe = b[p + 15]
        p += 2 + length
    return _NO_SOF, 0, 0, adobe, 0, 0


def key_index(shard: str, key: str) -> int:
    """A stable 63-bit sample identity from (shard, key), for sources without global indices (URLs)."""
    digest = hashlib.blake2b(f"{shard}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class EncodedImage:
    """The encoded bytes of one image field of one sample, and where they came from.

    Attributes:
        data: the encoded bytes (``bytes``, ``memoryview`` or a 1-D uint8 numpy array).
        shard, key: for error messages.
        index: the sample's global index in the dataset (a stable hash of shard and key for
            streaming sources, see :func:`key_index`); seeds per-sample augmentation.
        epoch: the epoch the sample was read in.
    """

    __slots__ = ("data", "epoch", "index", "key", "shard")

    def __init__(self, data: Any, *, shard: str, key: str, index: int, epoch: int) -> None:
        self.data = data
        self.shard = shard
        self.key = key
        self.index = int(index)
        self.epoch = int(epoch)

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.data, self.shard, self.key, self.index, self.epoch)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.data, self.shard, self.key, self.index, self.epoch = state

    def __len__(self) -> int:
        return len(memoryview(self.data).cast("B"))

    def __repr__(self) -> str:
        return f"EncodedImage({len(self)} bytes, shard={self.shard!r}, key={self.key!r}, index={self.index})"


class PackedImages:
    """A batch of encoded images: one uint8 buffer and, per image, its byte range and origin.

    Attributes:
        data: 1-D uint8 tensor holding every image's bytes back to back.
        meta: 1-D int64 tensor ``[offsets (n + 1), indices (n), header codes (n), header sizes (n)]``;
            see :attr:`offsets`, :attr:`indices`, :meth:`info`, :meth:`sizes`.
        shards, keys: per image, for error messages.
        epoch: the epoch of the batch's samples.
    """

    __slots__ = ("data", "epoch", "keys", "meta", "pending", "shards")

    def __init__(self, data: torch.Tensor, meta: torch.Tensor, *, shards: Sequence[str], keys: Sequence[str],
                 epoch: int) -> None:
        n = len(keys)
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(f"PackedImages: data must be a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
        if meta.dtype != torch.int64 or tuple(meta.shape) != (4 * n + 1,):
            raise ValueError(f"PackedImages: meta must be int64 of shape ({4 * n + 1},) for {n} images, "
                             f"got {meta.dtype} {tuple(meta.shape)}")
        if len(shards) != n:
            raise ValueError(f"PackedImages: {len(shards)} shard names for {n} keys")
        self.data = data
        self.meta = meta
        self.shards = tuple(shards)
        self.keys = tuple(keys)
        self.epoch = int(epoch)
        self.pending: Any = None  # a decode already started for this batch (fastdata.gpu.DecodeImages.ahead)

    @classmethod
    def pack(cls, images: Sequence[EncodedImage]) -> PackedImages:
        """Pack encoded images into one buffer (a single allocation)."""
        if not images:
            raise ValueError("PackedImages.pack: no images")
        epochs = {im.epoch for im in images}
        if len(epochs) != 1:
            raise ValueError(f"PackedImages.pack: images of several epochs in one batch: {sorted(epochs)}")
        views = [np.frombuffer(memoryview(im.data).cast("B"), dtype=np.uint8) for im in images]
        n = len(views)
        meta = torch.empty(4 * n + 1, dtype=torch.int64)
        m = meta.numpy()
        m[0] = 0
        np.cumsum([len(v) for v in views], out=m[1 : n + 1])
        m[n + 1 : 2 * n + 1] = [im.index for im in images]
        headers = [_header(v) for v in views]
        m[2 * n + 1 : 3 * n + 1] = [code for code, _ in headers]
        m[3 * n + 1 :] = [(h << 32) | w for _, (h, w) in headers]
        data = torch.empty(int(m[n]), dtype=torch.uint8)
        d = data.numpy()
        for v, lo, hi in zip(views, m[:n].tolist(), m[1 : n + 1].tolist()):
            d[lo:hi] = v
        return cls(data, meta, shards=[im.shard for im in images], keys=[im.key for im in images],
                   epoch=epochs.pop())

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def offsets(self) -> torch.Tensor:
        """int64 ``(n + 1,)``: image ``i`` is ``data[offsets[i]:offsets[i + 1]]``."""
        return self.meta[: len(self) + 1]

    @property
    def indices(self) -> torch.Tensor:
        """int64 ``(n,)``: the global sample index of each image."""
        return self.meta[len(self) + 1 : 2 * len(self) + 1]

    def _at(self, i: int) -> int:
        """``i`` as a position in ``range(len(self))`` (negative: from the end, as for a sequence)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"PackedImages: image {i} of {n}")
        return i % n

    def info(self, i: int) -> ImageInfo:
        """Header facts of image ``i`` (format, JPEG frame type, components, ...), sniffed when packed."""
        return ImageInfo(int(self.meta[2 * len(self) + 1 + self._at(i)]))

    def codes(self) -> list[int]:
        """The header codes of all images (see :class:`ImageInfo`)."""
        return self.meta[2 * len(self) + 1 : 3 * len(self) + 1].tolist()

    def sizes(self) -> np.ndarray:
        """int64 ``(n, 2)``: the ``(height, width)`` each header claims (0 where unknown), sniffed when packed."""
        s = self.meta[3 * len(self) + 1 :].numpy()
        return np.stack([s >> 32, s & 0xFFFFFFFF], axis=1)

    def views(self) -> list[torch.Tensor]:
        """Each image's bytes as a 1-D uint8 view into :attr:`data` (no copy)."""
        bounds = self.offsets.tolist()
        return [self.data[lo:hi] for lo, hi in itertools.pairwise(bounds)]

    def tobytes(self, i: int) -> bytes:
        """The bytes of image ``i``."""
        i = self._at(i)
        lo, hi = self.offsets[i : i + 2].tolist()
        return self.data[lo:hi].numpy().tobytes()

    def where(self, i: int) -> str:
        """``shard: sample 'key'`` of image ``i``, for messages."""
        i = self._at(i)
        return f"{self.shards[i]}: sample {self.keys[i]!r}"

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 8 * self.meta.numel()

    def pin_memory(self) -> PackedImages:
        """A copy with :attr:`data` in pinned memory (one pin per batch; ``meta`` is read on the host only)."""
        data = self.data if self.data.is_pinned() else self.data.pin_memory()
        return PackedImages(data, self.meta, shards=self.shards, keys=self.keys, epoch=self.epoch)

    def is_pinned(self) -> bool:
        return self.data.is_pinned()

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.data, self.meta, self.shards, self.keys, self.epoch)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.data, self.meta, self.shards, self.keys, self.epoch = state
        self.pending = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedImages):
            return NotImplemented
        return (self.shards, self.keys, self.epoch) == (other.shards, other.keys, other.epoch) and bool(
            torch.equal(self.data, other.data) and torch.equal(self.meta, other.meta))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedImages({len(self)} images, {self.data.numel()} bytes, epoch={self.epoch})"


def _collate_encoded(batch: Sequence[EncodedImage], *, collate_fn_map: Any = None) -> PackedImages:
    return PackedImages.pack(batch)


_COLLATE_MAP = {**default_collate_fn_map, EncodedImage: _collate_encoded}


def collate(batch: Sequence[Any]) -> Any:
    """``torch.utils.data.default_collate`` that also packs :class:`EncodedImage` fields into :class:`PackedImages`."""
    return _torch_collate(batch, collate_fn_map=_COLLATE_MAP)
