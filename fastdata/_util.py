"""Small helpers every stage shares: one byte-size grammar, one integer check, one image-suffix set.

This module sits below every stage (it imports nothing from fastdata), so any stage may use it.
"""
from __future__ import annotations

import math
import operator
import os
import re
import threading
import traceback
from typing import Any

from fastdata._runtime import at_fork

__all__ = ["IMAGE_SUFFIXES", "INT_SUFFIXES", "check_int", "parse_size", "quantile", "start_method", "usable_cores"]

# Lower-case field suffixes / file extensions treated as images, everywhere in fastdata.
IMAGE_SUFFIXES = frozenset(
    {"jpg", "jpeg", "png", "webp", "gif", "bmp", "ppm", "pgm", "pbm", "pnm", "tif", "tiff"}
)
# Field suffixes decoded as ints (a class index); ShardWriter refuses values they cannot be read back as.
INT_SUFFIXES = frozenset({"cls", "cls2", "index", "inx"})

# NumPy parses every .npy header with ast.literal_eval, which CPython 3.11 does not make thread-safe: ast's
# recursion counter belongs to the interpreter, so a garbage collection that runs Python code during one
# thread's parse lets another's move it ("SystemError: AST constructor recursion depth mismatch", about 1
# sample in 4,000 with decode_threads). Every .npy/.npz parse of the loading paths takes this lock; a fork
# child gets a fresh one (a thread of the parent may have held it).
_npy_lock = threading.Lock()


def _renew_npy_lock() -> None:
    global _npy_lock
    _npy_lock = threading.Lock()


at_fork(__name__, "a fresh .npy parse lock in the child (a parent thread may hold it)", after_in_child=_renew_npy_lock)


def byte_limit(value: str | int | float, *, name: str) -> int:
    """A byte limit from an int, a whole float (``2e9``) or a size string (:func:`parse_size`); ValueError naming
    ``name`` otherwise (``1.5``, meant as 1.5 GB, would be a limit of 1 byte)."""
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name} must be a whole number of bytes or a size string such as '1.5GB', got {value!r}")
    return parse_size(value, name=name)


def npy_lock() -> threading.Lock:
    """The lock every parse of a .npy header takes (``with npy_lock(): np.load(...)``)."""
    return _npy_lock


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?|\.\d+(?:e\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int, *, name: str | None = None) -> int:
    """Bytes from ``"256MB"``, ``"1GiB"``, ``"1.5G"``, ``"1e9"``, ``"1000000"`` or an int.

    ``K/M/G/T/P`` (with or without ``B``) are powers of 1000; ``KiB/MiB/GiB/...`` powers of 1024.
    The one grammar for every option that takes a size (``--shard-size``, ``--max-bytes``, ...).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if match is None or (match.group(3) and not match.group(2)):
            where = f"{name}: " if name else ""
            raise ValueError(f"{where}cannot parse size {text!r} (use e.g. 256MB, 1GiB, 1e9 or 1000000)")
        number, prefix, binary = float(match.group(1)), match.group(2).lower(), bool(match.group(3))
        power = " kmgtp".index(prefix) if prefix else 0
        scaled = number * (1024 if binary else 1000) ** power
        if not math.isfinite(scaled):
            raise ValueError(f"{name + ': ' if name else ''}size {text!r} is too large")
        value = int(scaled)
    if value < 1:
        raise ValueError(f"{name or 'size'} must be at least 1 byte, got {text!r}")
    return value


def check_index(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an int if it is one (NumPy and 0-d tensor ints too, not bools) >= ``minimum``, else a
    ValueError naming it (``int()`` would pass 1.5 or "1" on silently)."""
    try:
        number = operator.index(value)  # no floats, strings or None
    except TypeError:
        number = None
    if isinstance(value, bool) or number is None or number < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(number)


def check_int(name: str, value: Any, minimum: int = 0, *, none_ok: bool = False) -> Any:
    """``value`` if it is an int (not a bool) >= ``minimum`` (or None with ``none_ok``), else ValueError naming it."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if none_ok else ''}, got {value!r}")
    return value


def quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile (no interpolation), 0.0 for no values."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[rank]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def add_note(error: BaseException, text: str) -> None:
    """``error.add_note(text)`` on Python >= 3.11; on 3.10 (no notes) the note goes to ``error.__notes__``."""
    if hasattr(error, "add_note"):
        error.add_note(text)
        return
    try:
        notes = error.__dict__.setdefault("__notes__", [])
        notes.append(text)
    except AttributeError:  # an exception type without a __dict__: the note is lost, the error is not
        pass


def release_frames(error: BaseException) -> None:
    """Drop the locals of the frames ``error`` was raised through below the frame that caught it.

    torch re-raises a DataLoader worker's exception from a frame whose local holds that exception
    (``ExceptionWrapper.reraise``), and its traceback holds the iterator's frames: a cycle, so the
    iterator outlives the ``except`` that caught the error until a garbage collection. There the
    multiprocessing queues are closed (weakref callbacks) before the iterator's ``__del__`` asks its
    workers to stop, so each worker is joined only after a 5 s timeout: 10 s with 2 workers, 75 s
    with 15, at some later allocation. With the locals dropped, the iterator goes as soon as it is
    no longer used and stops its workers at once. The traceback's text (files, lines) is unchanged.
    """
    tb = error.__traceback__
    if tb is not None and tb.tb_next is not None:
        traceback.clear_frames(tb.tb_next)


def start_method(context: Any = None) -> str:
    """The start method of a multiprocessing ``context`` (a DataLoader's ``multiprocessing_context``), or of
    multiprocessing's default for None, read without fixing the default (``get_start_method()`` would, and
    a later ``set_start_method`` would then be refused)."""
    import multiprocessing

    if context is not None:
        return str(context.get_start_method())
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
