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


def _before_fork() -> None:
    if forks is not None:
        forks.append([threading.current_thread().name] + sorted(
            t.name for t in threading.enumerate()
            if t is not threading.current_thread() and t.is_alive() and t.name.startswith(("fastdata", "MainThread"))))


if hasattr(os, "register_at_fork"):  # pragma: no branch
    os.register_at_fork(before=_before_fork)
