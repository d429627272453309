"""The conversion engine behind ``fastdata shard`` (and ``tools/shard.py``): SRC (images, tar, HDF5, npz) -> shards.

A run plans (:func:`plan_conversion`, in ``_plan``: nothing is written), then writes every planned
shard as an independent job, in-process, in a process pool or on a Ray cluster (the same bytes
whatever the number of workers), records each finished shard in ``DEST/.fastdata-progress/`` (a
rerun resumes), and writes ``manifest.json`` last. Inputs that cannot be read are skipped and listed
in ``manifest.skipped`` with the reason, or abort the run with ``strict``; a planned shard whose
samples were all skipped is not written. This module runs the jobs (the pool, its workers' lifetime,
progress); DEST's lock, staging and uploads are in ``_dest``. Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdata._runtime import thread
from fastdata._util import parse_size
from fastdata._util import usable_cores as default_workers
from fastdata.errors import ConversionError, RemoteError
from fastdata.io import is_url, local_path, redact_url, remote_size, remove, url_join
from fastdata.manifest import MANIFEST_NAME, FieldInfo, Manifest
from fastdata.shards import _progress
from fastdata.shards._dest import (
    check_dest_vs_src,
    converting_pid,
    dest_lock,
    held_locks,
    remote_manifest,
    stage_source,
    staging_folder,
    upload_file,
    writing_into,
)
from fastdata.shards._fields import missing_fields, required_fields
from fastdata.shards._formats import shard_format
from fastdata.shards._images import (
    BadImage,
    check_image,
    is_image_field,
    resize_center_crop,
)
from fastdata.shards._plan import (
    DEFAULT_SHARD_SIZE,
    FINGERPRINT_KEY,
    ConvertOptions,
    ConvertResult,
    Plan,
    ShardJob,
    ShardResult,
    check_level,
    plan_conversion,
)
from fastdata.shards._progress import PROGRESS_DIR
from fastdata.shards._sources import SampleUnreadable, SourceReader

__all__ = [
    "DEFAULT_SHARD_SIZE", "PROGRESS_DIR", "ConversionError", "ConvertOptions", "ConvertResult", "Plan",
    "ShardJob", "ShardResult", "convert", "converting_pid", "default_workers", "parse_size", "plan_conversion",
]

log = logging.getLogger("fastdata.convert")

_TICK_S = 0.1  # how often workers report progress counts


# ------------------------------------------------------------------------------------- running

def convert(src: str | os.PathLike[str], dest: str | os.PathLike[str], options: ConvertOptions | None = None,
            ) -> ConvertResult:
    """Convert SRC into shards plus ``manifest.json`` in DEST (see the module docstring).

    DEST may be a URL (``s3://``, ``gs://``, any writable fsspec filesystem): shards are written
    into a local staging folder (``options.staging``, default under ``~/.cache/fastdata/convert``),
    each uploaded as soon as it is complete and then deleted locally; ``manifest.json`` is uploaded
    last. The staging folder keeps the progress records, so a rerun resumes (shards already
    uploaded with the recorded size are kept).
    """
    t0 = time.perf_counter()
    opts = options or ConvertOptions()
    if isinstance(src, str) and is_url(src):  # fetched into a local staging folder first, removed after
        staged = stage_source(src, opts)
        result = convert(staged, dest, options)
        shutil.rmtree(staged if staged.is_dir() else staged.parent, ignore_errors=True)
        return result
    plan = plan_conversion(src, opts)
    remote = isinstance(dest, str) and is_url(dest)
    dest_path = staging_folder(dest, opts) if remote else Path(local_path(os.fspath(dest)))  # file://, ~
    if remote:
        return _convert_remote(plan, str(dest), dest_path, opts, t0)
    check_dest_vs_src(plan.listing, dest_path)
    if opts.strict and plan.listing.skipped:
        first = plan.listing.skipped[0]
        raise ConversionError(f"{os.path.join(plan.listing.root, first['source'])}: {first['reason']} (--strict)")
    with dest_lock(dest_path, str(dest)):
        finished = None if opts.overwrite else _progress.finished(dest_path, plan)
        if finished is not None:
            if opts.strict and finished.skipped:
                first = finished.skipped[0]
                raise ConversionError(
                    f"{os.path.join(plan.listing.root, first['source'])}: {first['reason']} (--strict)")
            _check_some_read(plan, finished, dest_path)
            log.debug("%s already holds this conversion, finished (same arguments and inputs)", dest_path)
            return ConvertResult(finished, 0, len(finished.shards), time.perf_counter() - t0, 0, complete=True)
        state = _progress.prepare(dest_path, plan, overwrite=opts.overwrite)
        if opts.strict:
            for result in state.done.values():
                if result.skipped:
                    raise ConversionError(f"{result.skipped[0]['source']}: {result.skipped[0]['reason']} (--strict)")
        return _run_plan(plan, state, dest_path, opts, t0)


_held_locks = held_locks  # _dest's set of the DEST locks this process holds (pool workers close them)


def _run_plan(plan: Plan, state: Any, dest_path: Path, opts: ConvertOptions, t0: float,
              upload_to: str | None = None) -> ConvertResult:
    """Write the shards ``state`` lacks, record each, write the manifest (the common tail of a run)."""
    todo = [job for job in plan.jobs if job.number not in state.done]
    kept = len(plan.jobs) - len(todo)
    if kept:
        log.info("resuming: %d of %d shards already written to %s", kept, len(plan.jobs), upload_to or dest_path)
    tasks = [_Task(SourceReader.of(plan.listing), str(dest_path), job, opts.format, opts.resize,
                   check_level(opts), opts.strict, plan.fields, upload_to) for job in todo]
    initial = sum(len(plan.jobs[n].items) for n in state.done)
    with _progress_bar(plan.num_samples, initial, opts) as tick, closing(_execute(tasks, opts, tick)) as results:
        for result in results:  # closing(): an error or Ctrl-C here stops the workers at once
            with writing_into(dest_path, f"recording shard {plan.jobs[result.number].name} as done"):
                state.record(result)
    with writing_into(dest_path, f"writing {MANIFEST_NAME}"):
        manifest = state.finish()
    if upload_to is not None:  # the manifest goes last: readers never see a half-uploaded set
        upload_file(dest_path / MANIFEST_NAME, upload_to, MANIFEST_NAME)
        shutil.rmtree(dest_path, ignore_errors=True)
    _check_some_read(plan, manifest, upload_to or dest_path)
    if manifest.skipped:
        examples = "; ".join(f"{s['source']}: {s['reason']}" for s in manifest.skipped[:3])
        log.warning("skipped %d input(s) (listed in %s/%s under 'skipped'), e.g. %s",
                    len(manifest.skipped), upload_to or dest_path, MANIFEST_NAME, examples)
    return ConvertResult(manifest, len(todo), kept, time.perf_counter() - t0, plan.num_samples - initial)


def _check_some_read(plan: Plan, manifest: Manifest, dest: Any) -> None:
    """A conversion that read none of its inputs failed (its manifest lists them all as skipped), also
    when a rerun finds it finished."""
    if manifest.num_samples == 0 and manifest.skipped:
        first = manifest.skipped[0]
        raise ConversionError(f"SRC {plan.listing.root}: none of its {len(manifest.skipped)} inputs could be read "
                              f"(reasons in {dest}/{MANIFEST_NAME}, e.g. {first['source']}: {first['reason']})")


def _convert_remote(plan: Plan, url: str, staging: Path, opts: ConvertOptions, t0: float) -> ConvertResult:
    """:func:`convert` into a URL DEST through the local ``staging`` folder."""
    if url.split("://", 1)[0].lower() in ("http", "https"):
        raise ConversionError(f"DEST {redact_url(url)}: HTTP(S) is read-only; write to s3://, gs://, another "
                              "writable fsspec URL, or a local folder (and serve it)")
    if opts.strict and plan.listing.skipped:
        first = plan.listing.skipped[0]
        raise ConversionError(f"{os.path.join(plan.listing.root, first['source'])}: {first['reason']} (--strict)")
    with dest_lock(staging, redact_url(url)):  # two conversions into one URL share its staging folder
        return _convert_remote_locked(plan, url, staging, opts, t0)


def _convert_remote_locked(plan: Plan, url: str, staging: Path, opts: ConvertOptions, t0: float) -> ConvertResult:
    existing = remote_manifest(url, staging)
    if existing is not None and not opts.overwrite:
        if existing.extra.get(FINGERPRINT_KEY) == plan.fingerprint:
            _check_some_read(plan, existing, redact_url(url))
            log.debug("%s already holds this conversion, finished (same arguments and inputs)", redact_url(url))
            return ConvertResult(existing, 0, len(existing.shards), time.perf_counter() - t0, 0, complete=True)
        raise ConversionError(f"DEST {redact_url(url)} holds a finished conversion with different arguments or "
                              f"inputs{_progress.plan_changes(existing.extra, plan)}; pass --overwrite to replace its "
                              "shards or choose another DEST")
    if existing is not None:  # --overwrite: the old manifest goes first, so that no reader (and no rerun)
        try:                  # takes shards half replaced for the old dataset; an interrupted run resumes
            remove(url_join(url, MANIFEST_NAME))
        except RemoteError as e:
            raise ConversionError(
                f"--overwrite: removing the old {MANIFEST_NAME} of DEST {redact_url(url)}: {e}") from e

    def present(shard: Any) -> bool:
        names = [shard.name] + ([shard.index] if shard.index else [])
        try:
            sizes = [remote_size(url_join(url, n)) for n in names]
        except RemoteError:
            return False
        return sizes[0] == shard.bytes and all(x is not None for x in sizes)

    staging.mkdir(parents=True, exist_ok=True)
    state = _progress.prepare(staging, plan, overwrite=opts.overwrite, present=present)
    return _run_plan(plan, state, staging, opts, t0, upload_to=url)


@dataclass(frozen=True)
class _Task:
    reader: SourceReader
    dest: str
    job: ShardJob
    format: str
    resize: int | None
    check: str
    strict: bool
    fields: tuple[FieldInfo, ...]
    upload: str | None = None  # URL DEST: upload the finished shard there, then delete it locally


def _execute(tasks: list[_Task], opts: ConvertOptions, tick: Callable[[int], None]) -> Iterator[ShardResult]:
    """Run the jobs, yielding results in completion order (in-process for one worker).

    A failing job re-raises its exception here (with the worker's traceback as ``__cause__``); a
    worker that dies (e.g. killed for memory) is a ConversionError naming the shards being written
    (from the workers' start/end messages) instead of a hang. On
    any error or interrupt the remaining jobs are cancelled and the workers terminated.
    """
    if opts.engine == "ray":
        from fastdata.shards._ray import execute

        yield from execute(tasks, _write_job, workers=opts.workers, tick=tick, size=lambda t: len(t.job.items))
        return
    workers = min(opts.workers or default_workers(), len(tasks))
    if workers <= 1:
        for task in tasks:
            yield _write_job(task, tick)
        return
    ctx = _mp_context()
    queue = ctx.SimpleQueue()
    executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                   initargs=(queue, os.getpid()))
    try:
        pending = {executor.submit(_pool_job, task) for task in tasks}
        writing: set[str] = set()  # shards a worker has started and not finished (from its messages)
        while pending:
            done, pending = wait(pending, timeout=_TICK_S, return_when=FIRST_COMPLETED)
            _drain(queue, tick, writing)
            for future in done:
                try:
                    result = future.result()
                except BrokenProcessPool as e:  # which shard's inputs killed it (memory?) is worth knowing
                    _drain(queue, tick, writing)
                    names = sorted(writing)
                    which = names[0] if len(names) == 1 else f"one of {', '.join(names)}" if names else "a shard"
                    if not names and ctx.get_start_method() != "fork":  # died starting: the script re-imported?
                        raise ConversionError(
                            f"a worker process died before writing any shard into DEST {tasks[0].dest} (its error, "
                            f"if any, is printed above). The workers were started with {ctx.get_start_method()} "
                            "(fork only when this process runs no other thread: forking one that does can "
                            "deadlock), so each imported the script that called convert() again: a script must "
                            "call it under "
                            "`if __name__ == \"__main__\":`") from e
                    raise ConversionError(
                        f"a worker process died (killed, out of memory?) while writing {which} into DEST "
                        f"{tasks[0].dest}; the shards finished before are kept: rerun to resume") from e
                yield result
        executor.shutdown(wait=True)
    except BaseException:
        _terminate(executor)
        raise


def _terminate(executor: ProcessPoolExecutor) -> None:
    """Cancel queued jobs and stop running ones now (their partial ``.tmp`` files are removed on rerun)."""
    if hasattr(executor, "terminate_workers"):  # Python >= 3.14
        executor.terminate_workers()
        return
    executor.shutdown(wait=False, cancel_futures=True)
    processes = list((getattr(executor, "_processes", None) or {}).values())  # no public API before 3.14
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.join(timeout=5)


def _mp_context() -> Any:
    """fork when this process has no other threads (fast, nothing to re-import), else spawn.

    Forking a multi-threaded process can deadlock on locks held by other threads.
    """
    if "fork" in mp.get_all_start_methods() and threading.active_count() == 1:
        return mp.get_context("fork")
    return mp.get_context("spawn")


def _drain(queue: Any, tick: Callable[[int], None], writing: set[str]) -> None:
    """Workers' messages: sample counts for the progress bar, ``(shard, True/False)`` at a job's start/end."""
    while not queue.empty():
        message = queue.get()
        if isinstance(message, tuple):
            (writing.add if message[1] else writing.discard)(message[0])
        else:
            tick(message)


_worker_queue: Any = None


def _init_worker(queue: Any, parent: int) -> None:
    global _worker_queue
    _worker_queue = queue
    for fd in list(_held_locks):  # forked: the parent's DEST lock is the parent's (closing does not unlock it)
        _held_locks.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the workers
    _die_with_parent(parent)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """End this pool worker when the converting process dies, even by SIGKILL (no orphans).

    Linux: the kernel sends SIGKILL when the parent exits (``prctl(PR_SET_PDEATHSIG)``; the pool
    starts its workers from the thread that runs :func:`convert`, which outlives them). Elsewhere,
    or if prctl fails: a daemon thread checks once a second that the parent is still there.
    A killed worker leaves at most a ``.tmp`` file, removed by the rerun that resumes.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
        if ok:
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            return

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    thread(watch, name="fastdata-convert-parent-watch").start()


def _pool_job(task: _Task) -> ShardResult:
    pending = [0, time.monotonic()]

    def tick(n: int) -> None:
        pending[0] += n
        now = time.monotonic()
        if now - pending[1] >= _TICK_S:
            _worker_queue.put(pending[0])
            pending[0], pending[1] = 0, now

    _worker_queue.put((task.job.name, True))
    try:
        return _write_job(task, tick)
    finally:
        if pending[0]:
            _worker_queue.put(pending[0])
        _worker_queue.put((task.job.name, False))


def _write_job(task: _Task, tick: Callable[[int], None]) -> ShardResult:
    """Write one planned shard (atomically, through the formats' writers)."""
    path = Path(task.dest) / task.job.name
    skipped: list[dict[str, str]] = []
    # A readahead thread (reading/checking while this thread writes) was measured slower: the
    # image check and tar encoding both hold the GIL. Parallelism comes from --workers.
    samples = _prepared_samples(task, skipped, tick)
    try:
        with writing_into(task.dest, f"writing {task.job.name}"):  # source read errors are no OSErrors here
            info = shard_format(task.format).write(path, samples, fields=task.fields)
    finally:
        task.reader.close()
    if info.num_samples == 0:
        path.unlink()
        if info.index:
            (Path(task.dest) / info.index).unlink(missing_ok=True)
        return ShardResult(task.job.number, None, tuple(skipped), len(task.job.items))
    if task.upload is not None:  # URL DEST: the shard, then its index; the driver records it after
        for name in (info.name, info.index):
            if name:
                upload_file(Path(task.dest) / name, task.upload, name)
        for name in (info.name, info.index):
            if name:
                (Path(task.dest) / name).unlink(missing_ok=True)
    return ShardResult(task.job.number, info, tuple(skipped), len(task.job.items))


def _source_samples(task: _Task) -> Iterator[tuple[str, Any]]:
    """The task's inputs; an OSError reading SRC is a ConversionError naming SRC (not DEST's disk)."""
    items = task.reader.read(task.job.items)
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except OSError as e:
            raise ConversionError(f"reading SRC {task.reader.root} for {task.job.name}: {e}") from e
        yield item


def _prepared_samples(task: _Task, skipped: list[dict[str, str]], tick: Callable[[int], None],
                      ) -> Iterator[dict[str, Any]]:
    required = required_fields(f.name for f in task.fields)
    for origin, sample in _source_samples(task):
        reason = str(sample) if isinstance(sample, SampleUnreadable) else None
        if reason is None:
            try:
                sample = _process(sample, origin, task)  # type: ignore[arg-type]
            except BadImage as e:
                reason = str(e)
        if reason is None:
            missing = missing_fields(sample, required)  # type: ignore[arg-type]
            if missing:  # e.g. a tar sample without the 'cls' every other sample has
                reason = (f"sample {sample['__key__']!r} lacks field(s) {missing} "  # type: ignore[index]
                          f"(SRC's fields: {[f.name for f in task.fields]})")
        if reason is not None:
            if task.strict:
                raise ConversionError(f"{task.reader.location(origin)}: {reason} (--strict)")
            skipped.append({"source": origin, "reason": reason})
        else:
            yield sample  # type: ignore[misc]
        tick(1)


def _process(sample: dict[str, Any], origin: str, task: _Task) -> dict[str, Any]:
    images = [k for k in sample if not k.startswith("__") and is_image_field(k)]
    if task.resize:
        if len(images) != 1:
            raise ConversionError(f"{origin}: --resize needs exactly one image field per sample, "
                                  f"sample {sample['__key__']!r} has {images}")
        data = sample.pop(images[0])
        sample["img.npy"] = resize_center_crop(bytes(data), task.resize, field=images[0])
        return sample
    for name in images:
        try:
            check_image(bytes(sample[name]), check=task.check, field=name)
        except BadImage as e:
            raise BadImage(f"field {name!r}: {e}" if len(images) > 1 else str(e)) from e
    return sample


class _progress_bar:
    """tqdm bar in samples/s on stderr (only when enabled); yields a ``tick(n)`` callable."""

    def __init__(self, total: int, initial: int, opts: ConvertOptions):
        enabled = opts.progress if opts.progress is not None else sys.stderr.isatty()
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            class _Bar(tqdm):  # type: ignore[misc, valid-type]
                monitor_interval = 0  # no monitor thread: workers are forked only from a single-threaded process

            self._bar = _Bar(total=total, initial=initial, unit=" samples", file=sys.stderr,
                             dynamic_ncols=True, smoothing=0.1, desc="shard")

    def __enter__(self) -> Callable[[int], None]:
        bar = self._bar
        return bar.update if bar is not None else (lambda n: None)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()


def verify_dest(dest: str | os.PathLike[str]) -> list[str]:
    """Problems found re-reading every shard of DEST against its manifest (empty: all good)."""
    from fastdata.shards.reader import verify

    path = Path(local_path(os.fspath(dest)))
    if not path.is_dir():
        raise ConversionError(f"DEST {dest}: " + ("not a folder (pass the folder holding manifest.json)"
                                                 if path.exists() else "no such folder"))
    return verify(path)
