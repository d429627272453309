#!/usr/bin/env python3
"""Convert a dataset into fastdata shards, or verify a shard folder, from a source checkout.

    python tools/shard.py SRC DEST [--format tar|hdf5] [--shard-size 256MiB | --samples-per-shard N]
                          [--workers N] [--shuffle --seed S] [--resize N] [--overwrite] [--strict]
    python tools/shard.py --verify DEST [--workers N]

The same command as ``fastdata shard SRC DEST ...`` and ``fastdata verify DEST`` of an installed
fastdata (:mod:`fastdata.cli._shard_cmd`), with the same options, messages (prefixed ``shard.py:``)
and exit status: 0 success, 1 failed conversion or verification, 2 bad arguments, 130 interrupted
(rerun the same command to resume).
"""
from __future__ import annotations

import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]
if (_CHECKOUT / "fastdata" / "__init__.py").is_file():  # run this checkout's fastdata, installed or not
    sys.path.insert(0, str(_CHECKOUT))

from fastdata.cli._shard_cmd import tool_main as main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
