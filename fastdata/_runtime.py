"""The inventory of what fastdata runs beside the caller's code: every fork hook, exit hook and thread.

Fork hooks are registered through :func:`at_fork`, exit hooks through :func:`at_exit` and threads are
made by :func:`thread` (or :func:`executor`), nowhere else (``tests/project/test_runtime.py`` checks every module): each says which module owns it and
what it is for, and docs/ARCHITECTURE.md lists them. Order: ``os.register_at_fork`` runs ``before``
hooks in reverse order of registration and the ``after_*`` hooks in order, and :func:`at_fork`
registers each hook with it at once, so the order is the modules' import order, as before
(a hook that pauses threads must be registered after the hooks whose objects those threads use).
Every thread fastdata starts is a daemon named with a prefix from :data:`THREADS`.
"""
from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["THREADS", "ExitHook", "ForkHook", "at_exit", "at_fork", "executor", "exit_hooks", "fork_hooks", "thread"]


@dataclass(frozen=True)
class ForkHook:
    """One registered fork hook: its owner (a module name), what it is for and its callbacks."""

    owner: str
    purpose: str
    before: Callable[[], None] | None = None
    after_in_parent: Callable[[], None] | None = None
    after_in_child: Callable[[], None] | None = None


_HOOKS: list[ForkHook] = []


def at_fork(owner: str, purpose: str, *, before: Callable[[], None] | None = None,
            after_in_parent: Callable[[], None] | None = None,
            after_in_child: Callable[[], None] | None = None) -> None:
    """Register fork callbacks (``os.register_at_fork``) and record them in the inventory."""
    hook = ForkHook(owner, purpose, before, after_in_parent, after_in_child)
    _HOOKS.append(hook)
    if hasattr(os, "register_at_fork"):  # pragma: no branch  (every POSIX system)
        callbacks = {k: v for k, v in (("before", before), ("after_in_parent", after_in_parent),
                                       ("after_in_child", after_in_child)) if v is not None}
        os.register_at_fork(**callbacks)


def fork_hooks() -> tuple[ForkHook, ...]:
    """The hooks registered so far, in order of registration (modules register theirs when imported)."""
    return tuple(_HOOKS)


@dataclass(frozen=True)
class ExitHook:
    """One registered exit hook (``atexit``): its owner (a module name), what it is for and its function."""

    owner: str
    purpose: str
    fn: Callable[[], None]


_EXITS: list[ExitHook] = []


def at_exit(owner: str, purpose: str, fn: Callable[[], None]) -> None:
    """Register ``fn`` with ``atexit`` (run in reverse order of registration) and record it in the inventory."""
    _EXITS.append(ExitHook(owner, purpose, fn))
    atexit.register(fn)


def exit_hooks() -> tuple[ExitHook, ...]:
    """The exit hooks registered so far, in order of registration (modules register theirs when imported)."""
    return tuple(_EXITS)


# Every thread fastdata starts: name prefix -> (owner module, what it does and when it ends).
THREADS: dict[str, tuple[str, str]] = {
    "fastdata-prefetch": ("fastdata.prefetch._producer",
                          "CUDAPrefetcher's producer: reads the loader, stages and copies batches; ends with the "
                          "epoch or close()"),
    "fastdata-pack": ("fastdata.prefetch._stage",
                      "packs large pageable batches into pinned memory in parallel; ends when its stager is "
                      "collected"),
    "fastdata-decode": ("fastdata.loader._pool",
                        "DataLoader(decode_threads=N): decodes samples in the training process; paused at fork, "
                        "ends on close()"),
    "fastdata-gather": ("fastdata.loader._gather",
                        "the cached fast path's batch gather (a thread pool); ends with its loader"),
    "fastdata-nvjpeg": ("fastdata.gpu._threads",
                        "DecodeImages(decode_threads=K): K threads decoding a batch's chunks at once, each on a stream "
                        "of its own; paused at fork, end on close(), with the stage or at exit"),
    "fastdata-stall-watchdog": ("fastdata.loader._watchdog",
                                "names the worker a consumer waits on when it stalls; ends with the epoch"),
    "fastdata-worker-parent-watch": ("fastdata.loader._watchdog",
                                     "in a worker process: exits it when the parent process is gone; lives as long as the worker"),
    "fastdata-next-epoch": ("fastdata.dataset._preload",
                            "in a persistent worker: loads the next epoch's first samples while it waits; ends when they are "
                            "loaded or the epoch starts"),
    "fastdata-nodecache-release": ("fastdata.nodecache._threads",
                                   "closes idle shard readers and frees node-cache space; paused at fork, ends when no reader is open"),
    "fastdata-nodecache": ("fastdata.nodecache._threads",
                           "downloads remote shards ahead of the reader (up to 4); paused at fork, ends when idle"),
    "fastdata-nodecache-sink": ("fastdata.nodecache._download",
                                "writes a downloading shard to disk while the next chunk arrives; ends with it"),
    "fastdata-convert-parent-watch": ("fastdata.shards.convert",
                                      "in a conversion pool worker: exits it when the parent process is gone; lives as long as the worker"),
    "fastdata-verify": ("fastdata.cli._shard_cmd", "`fastdata verify`: hashes shards in parallel; ends when no shard is left"),
    "fastdata-gpu-sampler": ("fastdata.monitor._nvml", "StallMeter's NVML utilisation sampler; ends with it"),
}


def _check_name(name: str) -> None:
    if not any(name == p or name.startswith(p + "-") for p in THREADS):
        raise ValueError(f"thread name {name!r} is not in fastdata._runtime.THREADS")


def thread(target: Callable[..., Any], *, name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon ``threading.Thread`` (not started) whose ``name`` starts with a prefix of :data:`THREADS`."""
    _check_name(name)
    return threading.Thread(target=target, args=args, name=name, daemon=True)


def executor(max_workers: int, *, name: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose threads are named ``name_N``; ``name`` is a :data:`THREADS` prefix."""
    _check_name(name)
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name)
