"""CUDAPrefetcher: pinned staging, side-stream host-to-device copies, device transforms.

Its place among the stages: docs/ARCHITECTURE.md.
Behind it: ``_prefetcher`` (the iterator: the consumer's side, epochs, resume, shutdown),
``_producer`` (the persistent producer thread), ``_epochs`` (the seamless-epoch policy: where the
next epoch starts, with which number), ``_stage`` (pinned staging ring, parallel pack, copies),
``_queue`` (the pipe, the credits that bound memory, and statistics), ``_options`` (validated
options, device resolution); ``tree`` walks nested batches and is shared with :mod:`fastdata.gpu`.
Design: docs/design/prefetch.md.
"""
from fastdata.prefetch._options import PrefetchOptions, resolve_device
from fastdata.prefetch._prefetcher import CUDAPrefetcher

__all__ = ["CUDAPrefetcher", "PrefetchOptions", "resolve_device"]
