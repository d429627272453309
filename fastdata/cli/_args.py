"""Argument types shared by every ``fastdata`` command (argparse ``type=`` callables).

Each wraps one of the package's validators, so an option is parsed the same way in every
command and a bad value reads ``argument --images: expected an integer >= 1, got 'abc'``
rather than naming an internal function.
"""
from __future__ import annotations

import argparse
import os

from fastdata._util import parse_size
from fastdata.io import local_path


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


def two_or_more(text: str) -> int:
    """An integer >= 2 (e.g. steps of a measurement whose first step is left out)."""
    return _int(text, 2)


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


def nonempty_path(text: str) -> str:
    """A path or URL that is not empty: an empty one is an unset shell variable (``$DEST``), never the
    current folder that ``Path("")`` would make of it."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty path, got ''")
    return text


def nonempty_text(text: str) -> str:
    """A string that is not empty (e.g. a fingerprint prefix, where '' would match everything)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty value, got ''")
    return text


def output_file(text: str) -> str:
    """A file to write results to at the end of a run: checked up front, so that minutes of measuring
    are not lost to a missing folder or a typo."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    text = local_path(text)  # ~ and file:// as for every local path argument
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; expected a file path")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} {what}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} is not writable")
    return text


def work_folder(text: str) -> str:
    """A folder the command creates or reuses: anything but an existing file."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder path, got ''")
    text = local_path(text)  # ~ and file:// as for every local path argument
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(parent):  # the folders to create lie under the nearest one that exists
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a folder")
    return text


def device(text: str) -> str:
    """A device ``fastdata.CUDAPrefetcher`` accepts here (``cpu``, ``cuda``, ``cuda:N``), checked up front."""
    from fastdata.prefetch import resolve_device

    try:
        resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


positive_int.__name__ = "integer >= 1"  # argparse names the type in "invalid <name> value" messages
nonneg_int.__name__ = "integer >= 0"
two_or_more.__name__ = "integer >= 2"
byte_size.__name__ = "size"
positive_float.__name__ = "number > 0"
output_file.__name__ = "file path"
device.__name__ = "device"
work_folder.__name__ = "folder"
nonempty_path.__name__ = "path"
nonempty_text.__name__ = "value"
