"""The ``fastdata`` command (also ``python -m fastdata``).

One module per command behind :func:`main`: ``_main`` (parser and dispatch), ``_args``
(argument types shared by every command), ``_demo``, ``_doctor``, ``_tune``, ``_bench``, ``_cache_cmd``,
``_shard_cmd``.
"""
from fastdata.cli._main import build_parser, main

__all__ = ["build_parser", "main"]
