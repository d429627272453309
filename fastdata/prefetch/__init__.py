"""CUDAPrefetcher: pinned staging, side-stream host-to-device copies, device transforms.

Stage 5 of the pipeline (shards -> dataset -> cache -> loader -> **prefetch** -> GPU -> train).
Behind it: ``_prefetcher`` (the iterator, seamless epochs and the persistent producer thread),
``_stage`` (pinned staging ring, parallel pack, copies, the memory bound), ``_queue`` (the pipe, the
credits that bound memory, and statistics); ``tree`` walks nested batches and is shared with
:mod:`fastdata.gpu`.
"""
from fastdata.prefetch._options import PrefetchOptions, resolve_device
from fastdata.prefetch._prefetcher import CUDAPrefetcher

__all__ = ["CUDAPrefetcher", "PrefetchOptions", "resolve_device"]
