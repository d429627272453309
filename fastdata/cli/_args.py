"""Argument types shared by every ``fastdata`` command (argparse ``type=`` callables).

Each wraps one of the package's validators, so an option is parsed the same way in every
command and a bad value reads ``argument --images: expected an integer >= 1, got 'abc'``
rather than naming an internal function.
"""
from __future__ import annotations

import argparse

from fastdata._util import parse_size


def _int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1)


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _int(text, 0)


def byte_size(text: str) -> int:
    """A byte count: ``256MB``, ``1GiB``, ``1e9`` or plain bytes (see :func:`fastdata._util.parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_float(text: str) -> float:
    """A finite number > 0 (e.g. a duration in milliseconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


positive_int.__name__ = "integer >= 1"  # argparse names the type in "invalid <name> value" messages
nonneg_int.__name__ = "integer >= 0"
byte_size.__name__ = "size"
positive_float.__name__ = "number > 0"
