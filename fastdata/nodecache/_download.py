"""One shard's download into the node cache: streamed, hashed on the way, checked against the manifest.

The bytes land in a temporary file that the caller renames into place only after this returns, so
a verified name is never a partial or wrong copy. A content mismatch is a RemoteError marked
``checksum`` (the caller retries it: a bad proxy or a torn write); network failures were retried by
:class:`fastdata.io.RemoteStream` already. Design note: ``docs/design/nodecache.md``.
"""
from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path
from typing import Any

from fastdata._runtime import thread
from fastdata.errors import RemoteError
from fastdata.io import RemoteStream, RetryPolicy, redact_url
from fastdata.manifest import ShardInfo
from fastdata.nodecache._errors import Interrupted

__all__ = ["download_verified"]

_CHUNK = 4 << 20


def download_verified(url: str, shard: ShardInfo, tmp: Path, *, retry: RetryPolicy,
                      interrupt: threading.Event | None = None) -> None:
    """Stream ``url`` into ``tmp``; a second thread hashes and writes while this one receives
    (sha256 and the network each take a core: pipelined, a download costs the slower of the two).
    ``interrupt`` (a prefetch's): :class:`Interrupted` at the next chunk once it is set (the process forks)."""
    digest = hashlib.sha256()
    chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=4)
    failed: list[BaseException] = []

    def sink(out: Any) -> None:
        try:
            while (chunk := chunks.get()) is not None:
                digest.update(chunk)  # releases the GIL
                out.write(chunk)
        except BaseException as e:  # noqa: BLE001 - handed to the receiving thread below
            failed.append(e)
            while chunks.get() is not None:  # drain so that the receiver never blocks
                pass

    size = 0
    with open(tmp, "wb") as out:
        writer = thread(sink, args=(out,), name="fastdata-nodecache-sink")
        writer.start()
        try:
            with RemoteStream(url, size=shard.bytes, retry=retry, what="downloading") as src:
                while not failed:
                    if interrupt is not None and interrupt.is_set():
                        raise Interrupted(f"prefetch of {shard.name} stopped: the process forks")
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    size += len(chunk)
                    chunks.put(chunk)
                    if size > shard.bytes:
                        break
        finally:
            chunks.put(None)
            writer.join()
    if failed:
        raise failed[0]
    if size != shard.bytes or digest.hexdigest() != shard.sha256:
        what = (f"size {size} bytes, manifest says {shard.bytes}" if size != shard.bytes
                else f"sha256 {digest.hexdigest()}, manifest says {shard.sha256}")
        shown = redact_url(url)
        err = RemoteError(f"downloading {shown}: content does not match the manifest ({what})")
        err.url, err.status, err.transient, err.checksum = shown, None, False, True  # type: ignore[attr-defined]
        raise err
