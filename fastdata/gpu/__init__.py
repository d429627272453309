"""Device-side batch stages run by :class:`fastdata.CUDAPrefetcher`: decode, augment, normalise.

Its place among the stages: docs/ARCHITECTURE.md.
Behind it: ``_transforms`` (Normalize, ToDtype, ChannelsLast, Compose), ``_decode`` (DecodeImages:
packed encoded images -> images on the device; ``_ahead``: its read-ahead, ``_fields``: the batch's
packed fields and skipped rows, ``_threads``: its decode threads and streams), ``_augment`` (batched
RandomResizedCrop, RandomHorizontalFlip, Resize, CenterCrop over an ImageBatch), ``_codec`` (the entry
point of the image codec libraries; ``_nvimgcodec``: nvImageCodec's device backend behind it).
"""
from fastdata.gpu._augment import (
    CenterCrop,
    ImageBatch,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)
from fastdata.gpu._codec import DecoderUnavailableError, HostImageDecoder, host_backend
from fastdata.gpu._decode import DecodeImages
from fastdata.gpu._transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ChannelsLast,
    Compose,
    Normalize,
    ToDtype,
)

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "CenterCrop", "ChannelsLast", "Compose", "DecodeImages", "DecoderUnavailableError",
    "HostImageDecoder", "ImageBatch", "Normalize", "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "ToDtype",
]
# Package-internal, for fastdata.monitor: the host decoder library a name ("auto") resolves to here.
__all__ += ["host_backend"]
