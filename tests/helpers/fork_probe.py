"""Which threads are alive when a process forks, seen after every fork hook of fastdata has run.

``os.register_at_fork(before=...)`` hooks run in reverse order of registration, so this one, which
``conftest.py`` registers before anything imports fastdata, runs last: after fastdata's hooks have
paused their threads (decode pools, node-cache releasers). A test sets ``probe.forks = []`` and reads
the thread names recorded at each fork: the forking thread first, then fastdata's other threads.
"""
from __future__ import annotations

import os
import threading

forks: list[list[str]] | None = None


def _nothing() -> None:
    pass


def fork_child() -> tuple[int | None, list[list[str]]]:
    """Fork a child process that does nothing; its exit code and the thread names recorded at the fork."""
    import multiprocessing as mp

    global forks
    forks = []
    try:
        p = mp.get_context("fork").Process(target=_nothing)
        p.start()
        p.join(10)
    finally:
        recorded, forks = forks, None
    return p.exitcode, recorded


def _before_fork() -> None:
    if forks is not None:
        forks.append([threading.current_thread().name] + sorted(
            t.name for t in threading.enumerate()
            if t is not threading.current_thread() and t.is_alive() and t.name.startswith(("fastdata", "MainThread"))))


if hasattr(os, "register_at_fork"):  # pragma: no branch
    os.register_at_fork(before=_before_fork)
