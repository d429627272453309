"""Remote-set helpers: a sample as served, an action run in a fork child under a file-size limit (a full disk)."""
from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from fastdata.shards.tar import TarShardReader


def expected_sample(served_6_shards: Path, shard: int, i: int) -> dict:
    """Sample ``i`` of shard ``shard`` of the served set, read locally."""
    with TarShardReader(served_6_shards / "ds" / f"shard-{shard:06d}.tar") as r:
        return {k: bytes(v) if not isinstance(v, str) else v for k, v in r.read(i).items()}


def under_a_size_limit(action, out: Path) -> str:
    """Run ``action()`` in a fork child whose files cannot grow past 4 KB (a full disk); its outcome:
    "done", or the exception's type and message."""

    def child() -> None:
        import resource
        import signal

        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            action()
            out.write_text("done")
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.write_text(f"{type(e).__name__}: {e}")
        finally:
            os._exit(0)

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    return out.read_text()
