"""How fastdata.DataLoader's worker processes leave: through ``os._exit``, whatever the start method.

A fork or forkserver child leaves with ``os._exit(code)`` as soon as its ``Process._bootstrap``
returns. A spawn child instead returns into ``multiprocessing.spawn.spawn_main``, which calls
``sys.exit(code)``: full interpreter finalization, then the C++ static destructors of every loaded
library. In a DataLoader worker that is stopped early (``del it`` after a few batches: torch sets
``cancel_join_thread`` on its result queue) this aborted the worker in 2-6 of 30 rounds here with
"terminate called without an active exception" and a "DataLoader worker (pid N) is killed by
signal: Aborted" error printed from the iterator's ``__del__`` (a static destructor meets a thread
still running). The faulthandler dump of such an abort shows no Python frame: it happens after
Python has finished.

So every worker arms, at its start, a last step: once ``_bootstrap`` has run multiprocessing's exit
functions (a finalizer of the lowest priority, the last thing ``util._exit_function`` runs), and
``sys.exit`` is then called by ``spawn_main``, the worker flushes stdout and stderr and calls
``os._exit`` with the same code, as a fork child would. Nothing the worker runs earlier is
affected (a ``sys.exit`` in user code still raises ``SystemExit``). As with fork, ``atexit``
handlers registered in a spawn worker then do not run.
"""
from __future__ import annotations

import os
import sys
from multiprocessing import util
from typing import Any, NoReturn

__all__ = ["arm"]

_LAST = -(2**31)  # exitpriority: after every other finalizer of the process


def arm() -> None:
    """In a worker process: leave through ``os._exit`` once multiprocessing's exit work is done."""
    util.Finalize(None, _swap_exit, exitpriority=_LAST)


def _swap_exit() -> None:
    sys.exit = _exit_now  # type: ignore[assignment]  # only spawn_main calls it from here on


def _exit_now(code: Any = None) -> NoReturn:
    """``sys.exit(code)`` as the interpreter would end it, without finalization (``os._exit``)."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:  # sys.exit("message"): printed to stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
