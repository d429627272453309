"""Device-side batch transforms run by :class:`fastdata.CUDAPrefetcher` (normalise, dtype, layout).

Stage 6 of the pipeline (shards -> dataset -> cache -> loader -> prefetch -> **GPU** -> train).
"""
from fastdata.gpu._transforms import IMAGENET_MEAN, IMAGENET_STD, ChannelsLast, Compose, Normalize, ToDtype

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "ChannelsLast", "Compose", "Normalize", "ToDtype"]
