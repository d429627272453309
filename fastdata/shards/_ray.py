"""``--engine ray``: a conversion's shard jobs as Ray tasks (``pip install 'fastdata[ray]'``).

The plan (which inputs go into which shard, in which order) is made on the driver exactly as for
the local engine; each planned shard is one task that reads its inputs, re-encodes them and writes
the shard, so the output is byte-identical to a local run whatever the cluster. Resumability is the
local engine's: the driver records each finished shard in ``DEST/.fastdata-progress`` and writes
``manifest.json`` last, so a rerun (on Ray or locally) redoes only the missing shards.

Where the tasks run: ``ray.init()`` connects to the cluster named by ``RAY_ADDRESS`` or a running
local one, else starts a local instance, and ``ray.shutdown()`` follows when the conversion ends;
an already initialised Ray is used as it is (and left running). On a
multi-node cluster every node must see SRC and DEST at the same paths (shared storage), or DEST
is a URL: each task then writes into its node's staging folder and uploads the finished shard.

``ray`` is imported only here, and only when this engine runs.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["execute"]

log = logging.getLogger("fastdata.convert")
_POLL_S = 0.1


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("--engine ray needs Ray: pip install 'fastdata[ray]'") from e
    return ray


def _run(write: Callable[[Any, Callable[[int], None]], Any], task: Any) -> Any:
    return write(task, lambda n: None)


def execute(tasks: Sequence[Any], write: Callable[[Any, Callable[[int], None]], Any], *, workers: int | None,
            tick: Callable[[int], None], size: Callable[[Any], int]) -> Iterator[Any]:
    """Run ``write(task, tick)`` for every task on Ray; yield the results in completion order.

    ``workers`` caps the tasks in flight (None: as many as the cluster schedules, one CPU each);
    ``size(task)`` is the number of input samples of a task, reported through ``tick`` when it
    finishes. A failing task re-raises its error here; on any error or when the consumer stops,
    the tasks not finished are cancelled.
    """
    ray = _ray()
    started = not ray.is_initialized()
    if started:
        ray.init(log_to_driver=False)
        log.info("ray: connected (%s CPUs)", ray.cluster_resources().get("CPU"))
    try:
        yield from _execute(ray, tasks, write, workers=workers, tick=tick, size=size)
    finally:
        if started:  # what this conversion started ends with it, not in Ray's atexit hook (a Ctrl-C
            ray.shutdown()  # landing there printed a traceback after the summary and orphaned Ray's agents)


def _execute(ray: Any, tasks: Sequence[Any], write: Callable[[Any, Callable[[int], None]], Any], *,
             workers: int | None, tick: Callable[[int], None], size: Callable[[Any], int]) -> Iterator[Any]:
    remote = ray.remote(num_cpus=1, max_retries=1)(_run)  # a lost worker node reruns its shard once
    queue = list(tasks)
    limit = len(queue) if workers is None else max(1, workers)
    running: dict[Any, Any] = {}
    try:
        while queue or running:
            while queue and len(running) < limit:
                task = queue.pop(0)
                running[remote.remote(write, task)] = task
            done, _ = ray.wait(list(running), num_returns=1, timeout=_POLL_S)
            for ref in done:
                task = running.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as e:  # the task's own exception, with its traceback
                    cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
                    raise cause from None
                tick(size(task))
                yield result
    finally:
        for ref in running:
            try:
                ray.cancel(ref, force=True)
            except Exception as e:  # noqa: BLE001 - best effort: the task may have finished meanwhile
                log.debug("ray: cancelling a shard task failed: %s", e)
        t0 = time.monotonic()
        if running:
            ray.wait(list(running), num_returns=len(running), timeout=5.0)
            log.debug("ray: cancelled %d shard tasks in %.1fs", len(running), time.monotonic() - t0)
