"""The conversion engine behind ``fastdata shard`` (and ``tools/shard.py``): SRC (images, tar, HDF5, npz) -> shards.

How a conversion runs:

1. **Plan** (:func:`plan_conversion`), before anything is written: enumerate SRC in sorted
   order (:mod:`fastdata.shards._sources`), optionally permute it with ``seed``, reject
   duplicate keys, and cut the sample list into shards by ``samples_per_shard`` and/or an
   estimated ``shard_size`` (input sizes plus tar header overhead, or the fixed resized size).
2. **Write** every shard as an independent job, in-process or in a process pool. A shard's
   bytes depend only on the plan, so the output is byte-identical whatever ``workers`` is.
3. **Resume**: after a shard's atomic rename, ``DEST/.fastdata-progress/shard-NNNNNN.json``
   records it. Rerunning with the same plan keeps recorded shards whose sha256 still matches
   and redoes the rest. ``manifest.json`` is written last; then the progress folder is removed.

Inputs that cannot be read (unreadable files, corrupt images, files that are not images) are
skipped and listed in ``manifest.skipped`` with the reason, or abort the run with ``strict``.
Image checks are described in :mod:`fastdata.shards._images`. A planned shard whose samples
were all skipped is not written (shard numbers then have a gap; the manifest lists the rest).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
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

import numpy as np

from fastdata._util import parse_size
from fastdata._util import usable_cores as default_workers
from fastdata.errors import ConversionError, FastdataError, RemoteError
from fastdata.io import (
    RetryPolicy,
    download,
    folder_url,
    is_url,
    local_path,
    read_bytes,
    redact_url,
    remote_size,
    remove,
    split_query,
    upload,
    url_identity,
    url_join,
)
from fastdata.manifest import MANIFEST_NAME, FieldInfo, Manifest, sha256_file
from fastdata.shards import _progress
from fastdata.shards._fields import missing_fields, required_fields
from fastdata.shards._images import (
    BadImage,
    check_image,
    is_image_field,
    resize_center_crop,
)
from fastdata.shards._formats import SHARD_FORMATS, shard_format
from fastdata.shards._plan import (
    DEFAULT_SHARD_SIZE,
    ConvertOptions,
    ConvertResult,
    Plan,
    ShardJob,
    ShardResult,
)
from fastdata.shards._progress import PROGRESS_DIR
from fastdata.shards._sources import (
    Listing,
    SampleUnreadable,
    SourceReader,
    list_source,
)

__all__ = [
    "DEFAULT_SHARD_SIZE", "PROGRESS_DIR", "ConversionError", "ConvertOptions", "ConvertResult", "Plan",
    "ShardJob", "ShardResult", "convert", "converting_pid", "default_workers", "parse_size", "plan_conversion",
]

log = logging.getLogger("fastdata.convert")

_PLAN_VERSION = 1
_TICK_S = 0.1  # how often workers report progress counts


def plan_conversion(src: str | os.PathLike[str], options: ConvertOptions | None = None) -> Plan:
    """Enumerate SRC and cut it into shards; nothing is written."""
    opts = options or ConvertOptions()
    fmt = shard_format(opts.format)
    listing = list_source(src)
    _check_duplicates(listing)
    if fmt.utf8_keys:
        _check_utf8_keys(listing, fmt.name)
    fields = _output_fields(listing, opts)
    n = len(listing.keys)
    order = np.random.default_rng(opts.seed).permutation(n) if opts.shuffle else np.arange(n)
    sizes = fmt.estimate(listing, opts.resize, fields)
    jobs = []
    fixed = fmt.file_bytes(len(fields))
    for number, (a, b) in enumerate(_boundaries([sizes[i] for i in order.tolist()], opts, fixed)):
        items = tuple((listing.keys[i], listing.refs[i]) for i in order[a:b].tolist())
        jobs.append(ShardJob(number, f"shard-{number:06d}{fmt.suffix}", items))
    extra: dict[str, Any] = {"source": {"kind": listing.kind, "path": listing.root, **listing.extra},
                             "shuffle": opts.shuffle, "resize": opts.resize, "check": _check_level(opts)}
    if opts.shuffle:
        extra["seed"] = opts.seed
    from fastdata._version import __version__

    # what a refused rerun compares, to name the argument or inputs that differ (_progress.plan_changes)
    extra[_progress.PLAN_KEY] = {"format": opts.format, "shard_size": opts.max_bytes,
                                 "samples_per_shard": opts.samples_per_shard, "shuffle": opts.shuffle,
                                 "seed": opts.seed if opts.shuffle else None, "resize": opts.resize,
                                 "check": _check_level(opts), "fastdata": __version__, "inputs": listing.inputs}
    fingerprint = _fingerprint(listing, opts, jobs, fields)
    extra[_progress.FINGERPRINT_KEY] = fingerprint  # lets a rerun recognise the finished conversion
    return Plan(listing, opts, tuple(jobs), fields, fingerprint, extra)


def _check_level(opts: ConvertOptions) -> str:
    return "full" if opts.resize else opts.check  # resizing decodes everything anyway


def _check_duplicates(listing: Listing) -> None:
    first: dict[str, int] = {}
    for i, key in enumerate(listing.keys):
        j = first.setdefault(key, i)
        if j != i:
            raise ConversionError(f"duplicate key {key!r}: {listing.origin(listing.refs[j])} and "
                                  f"{listing.origin(listing.refs[i])} (keys must be unique across SRC)")


def _check_utf8_keys(listing: Listing, format: str) -> None:
    """Keys stored as UTF-8 strings (HDF5): refuse, naming the input, a key from a file name in another encoding."""
    for key, ref in zip(listing.keys, listing.refs):
        if not key.isascii():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise ConversionError(f"{listing.origin(ref)}: key {key!r} is not valid UTF-8 (a file name in "
                                      f"another encoding?); --format {format} stores keys as UTF-8: rename it or "
                                      "use --format tar"
                                      ) from None


def _output_fields(listing: Listing, opts: ConvertOptions) -> tuple[FieldInfo, ...]:
    fields = list(listing.fields)
    images = [f.name for f in fields if is_image_field(f.name)]
    if opts.resize:
        if not images:
            raise ConversionError(f"--resize: SRC {listing.root} has no image field "
                                  f"(fields: {[f.name for f in fields]})")
        if any(f.name == "img.npy" for f in fields):
            raise ConversionError(f"--resize: SRC {listing.root} already has a field 'img.npy'")
        size = opts.resize
        fields = [f for f in fields if f.name not in images] + [FieldInfo("img.npy", "array", "uint8", (3, size, size))]
    elif shard_format(opts.format).same_fields and len(images) > 1:
        # an image stored in one format or another (jpg|png) satisfies a sample; an HDF5 row needs every field
        n = len(listing.keys)
        for group in required_fields(images):
            mixed = sorted(group)
            if len(group) > 1 and (listing.kind == "images" or any(listing.field_counts.get(f, n) < n for f in group)):
                raise ConversionError(f"--format {opts.format} needs the same fields in every sample, but SRC "
                                      f"{listing.root} mixes image types {mixed}; use --format tar or --resize")
    return tuple(sorted(fields, key=lambda f: f.name))


def _boundaries(sizes: list[int], opts: ConvertOptions, fixed: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each shard: a shard ends before the next sample would pass a limit
    (``fixed``: a shard file's bytes besides its samples)."""
    max_bytes, max_samples = opts.max_bytes, opts.samples_per_shard
    start, total = 0, fixed
    for i, size in enumerate(sizes):
        count = i - start
        if count and ((max_samples is not None and count >= max_samples)
                      or (max_bytes is not None and total + size > max_bytes)):
            yield start, i
            start, total = i, fixed
        total += size
    yield start, len(sizes)


def _fingerprint(listing: Listing, opts: ConvertOptions, jobs: list[ShardJob], fields: tuple[FieldInfo, ...]) -> str:
    from fastdata._version import __version__

    h = hashlib.sha256()
    head = {"plan": _PLAN_VERSION, "fastdata": __version__, "kind": listing.kind, "stamp": listing.stamp,
            "format": opts.format, "resize": opts.resize, "check": _check_level(opts),
            "fields": [f.to_json() for f in fields]}
    if "classes" in listing.extra:  # the labels: a class folder added without images shifts them
        head["classes"] = listing.extra["classes"]
    h.update(json.dumps(head, sort_keys=True).encode())
    for job in jobs:
        h.update(f"\n{job.name}:".encode())
        h.update("\0".join(k for k, _ in job.items).encode("utf-8", "surrogateescape"))
    return h.hexdigest()


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
        staged = _stage_source(src, opts)
        result = convert(staged, dest, options)
        shutil.rmtree(staged if staged.is_dir() else staged.parent, ignore_errors=True)
        return result
    plan = plan_conversion(src, opts)
    remote = isinstance(dest, str) and is_url(dest)
    dest_path = _staging(dest, opts) if remote else Path(local_path(os.fspath(dest)))  # file://, ~
    if remote:
        return _convert_remote(plan, str(dest), dest_path, opts, t0)
    _check_dest_vs_src(plan.listing, dest_path)
    if opts.strict and plan.listing.skipped:
        first = plan.listing.skipped[0]
        raise ConversionError(f"{os.path.join(plan.listing.root, first['source'])}: {first['reason']} (--strict)")
    with _dest_lock(dest_path, str(dest)):
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


_held_locks: set[int] = set()  # descriptors of the DEST locks this process holds (closed in forked workers)


@contextlib.contextmanager
def _dest_lock(dest: Path, shown: str) -> Iterator[None]:
    """An exclusive lock on the folder ``dest`` (created) for the conversion's life.

    A second conversion into the same DEST fails at once, naming the holder's pid, instead of
    "resuming" the running one and deleting its partial shards. The lock is a ``flock`` on the
    folder itself, so no file is left behind and the kernel drops it when the holder dies, however
    it dies (a rerun after a crash resumes). Pool workers close their inherited copy; they die with
    the converting process anyway. Where folders cannot be locked (no ``fcntl``, some network file
    systems) conversions run unlocked, as before.
    """
    if dest.exists() and not dest.is_dir():
        raise ConversionError(f"DEST {dest} exists and is not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(dest, shown)
    if fd is None:
        yield
        return
    _held_locks.add(fd)
    try:
        yield
    finally:
        _held_locks.discard(fd)
        os.close(fd)  # the lock goes with the last descriptor of it


def _try_lock(dest: Path, shown: str) -> int | None:
    """A descriptor of ``dest`` holding its exclusive ``flock``; None where folders cannot be locked."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    try:
        fd = os.open(dest, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        pid = _lock_holder(os.fstat(fd))
        os.close(fd)
        raise ConversionError(f"another conversion is writing DEST {shown}" + (f" (pid {pid})" if pid else "")
                              + ": wait for it to finish, or stop it and rerun to resume") from None
    except OSError as e:  # e.g. a network file system without locks
        os.close(fd)
        log.debug("DEST %s cannot be locked (%s): converting without a lock", dest, e)
        return None


def converting_pid(dest: str | os.PathLike[str]) -> int | None:
    """The pid of the process converting into the local folder ``dest`` right now (it holds the DEST
    lock), read from ``/proc/locks`` without taking the lock; None if none, or where that is unknown."""
    try:
        return _lock_holder(os.stat(dest))
    except OSError:
        return None


def _lock_holder(st: os.stat_result) -> int | None:
    """The pid holding a ``flock`` on the file of ``st``, from ``/proc/locks`` (Linux; else None)."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "FLOCK" not in parts or "->" in parts:  # "->": a waiter, not the holder
            continue
        try:
            i = parts.index("FLOCK")
            pid, where = int(parts[i + 3]), parts[i + 4].split(":")
            major, minor, inode = int(where[0], 16), int(where[1], 16), int(where[2])
        except (IndexError, ValueError):
            continue
        if inode == st.st_ino and os.makedev(major, minor) == st.st_dev and pid > 0:  # (an inode number alone
            return pid  # is another file on another disk; pid 0: a process in another pid namespace, unknown here)
    return None


def _run_plan(plan: Plan, state: Any, dest_path: Path, opts: ConvertOptions, t0: float,
              upload_to: str | None = None) -> ConvertResult:
    """Write the shards ``state`` lacks, record each, write the manifest (the common tail of a run)."""
    todo = [job for job in plan.jobs if job.number not in state.done]
    kept = len(plan.jobs) - len(todo)
    if kept:
        log.info("resuming: %d of %d shards already written to %s", kept, len(plan.jobs), upload_to or dest_path)
    tasks = [_Task(SourceReader.of(plan.listing), str(dest_path), job, opts.format, opts.resize,
                   _check_level(opts), opts.strict, plan.fields, upload_to) for job in todo]
    initial = sum(len(plan.jobs[n].items) for n in state.done)
    with _progress_bar(plan.num_samples, initial, opts) as tick, closing(_execute(tasks, opts, tick)) as results:
        for result in results:  # closing(): an error or Ctrl-C here stops the workers at once
            with _writing(dest_path, f"recording shard {plan.jobs[result.number].name} as done"):
                state.record(result)
    with _writing(dest_path, f"writing {MANIFEST_NAME}"):
        manifest = state.finish()
    if upload_to is not None:  # the manifest goes last: readers never see a half-uploaded set
        _upload(dest_path / MANIFEST_NAME, upload_to, MANIFEST_NAME)
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


def _staging(url: str, opts: ConvertOptions) -> Path:
    if opts.staging is not None:
        return Path(opts.staging)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastdata" / "convert" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]


_SHARD_SUFFIXES = tuple(s for fmt in SHARD_FORMATS.values() for s in fmt.source_suffixes)


def _stage_source(url: str, opts: ConvertOptions) -> Path:
    """A local copy of SRC ``url``: one file (``.tar``/``.h5``/``.npz``), or a shard folder with its
    ``manifest.json`` (every file checked against it). Files already staged intact are kept, and
    their mtimes are fixed, so a rerun plans the same conversion (resume works)."""
    from fastdata.shards.reader import load_manifest

    # a signed URL's token (query) stays out of the staged names (the manifest records them) and out
    # of the staging key (a rotated token resumes the same staging)
    if opts.staging is not None:
        root = Path(opts.staging + "-src")
    else:
        root = _staging("src:" + url_identity(url).rstrip("/"), opts)
    shown = redact_url(url)

    def last_segment(u: str) -> str:  # without a signed URL's query
        return split_query(u)[0].rstrip("/").rsplit("/", 1)[-1] or "src"

    name = last_segment(url)
    try:
        if name.lower().endswith((*_SHARD_SUFFIXES, ".npz")):
            local = root / name
            root.mkdir(parents=True, exist_ok=True)
            size = remote_size(url)
            if size is None:
                raise ConversionError(f"SRC {shown}: not found")
            if not (local.is_file() and local.stat().st_size == size):
                download(url, local, size=size)
            os.utime(local, ns=(0, 0))
            return local
        url = folder_url(url)  # the folder of a manifest.json URL
        name = last_segment(url)
        manifest = load_manifest(url)
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for shard in manifest.shards:
            local = folder / shard.name
            local.parent.mkdir(parents=True, exist_ok=True)
            if not (local.is_file() and local.stat().st_size == shard.bytes and sha256_file(local) == shard.sha256):
                download(url_join(url, shard.name), local, size=shard.bytes, sha256=shard.sha256)
            os.utime(local, ns=(0, 0))
            if shard.index:  # no checksum in the manifest: the tar reader checks it against the shard's size
                download(url_join(url, shard.index), folder / shard.index)
                os.utime(folder / shard.index, ns=(0, 0))
        manifest.save(folder)
        os.utime(folder / MANIFEST_NAME, ns=(0, 0))
        return folder
    except RemoteError as e:
        raise ConversionError(f"SRC {shown}: {e}") from e


def _upload(local: Path, base_url: str, name: str) -> None:
    try:
        upload(local, url_join(base_url, name))
    except RemoteError as e:
        raise ConversionError(f"uploading {name} to DEST {redact_url(base_url)}: {e}") from e


def _remote_manifest(url: str, staging: Path) -> Manifest | None:
    """The manifest at URL DEST, or None when there is none (a copy passes through ``staging``)."""
    murl = url_join(url, MANIFEST_NAME)
    try:
        if remote_size(murl) is None:
            return None
        data = read_bytes(murl, retry=RetryPolicy(attempts=3))
    except RemoteError as e:
        raise ConversionError(f"DEST {redact_url(url)}: {e}") from e
    local = staging / f".remote-{MANIFEST_NAME}"
    local.write_bytes(data)
    try:
        return Manifest.load(local)
    except ValueError as e:
        raise ConversionError(f"DEST {redact_url(url)}: its {MANIFEST_NAME} is not a valid manifest: "
                              f"{str(e).replace(str(local), redact_url(murl))}") from None
    finally:
        local.unlink(missing_ok=True)


def _convert_remote(plan: Plan, url: str, staging: Path, opts: ConvertOptions, t0: float) -> ConvertResult:
    """:func:`convert` into a URL DEST through the local ``staging`` folder."""
    if url.split("://", 1)[0].lower() in ("http", "https"):
        raise ConversionError(f"DEST {redact_url(url)}: HTTP(S) is read-only; write to s3://, gs://, another "
                              "writable fsspec URL, or a local folder (and serve it)")
    if opts.strict and plan.listing.skipped:
        first = plan.listing.skipped[0]
        raise ConversionError(f"{os.path.join(plan.listing.root, first['source'])}: {first['reason']} (--strict)")
    with _dest_lock(staging, redact_url(url)):  # two conversions into one URL share its staging folder
        return _convert_remote_locked(plan, url, staging, opts, t0)


def _convert_remote_locked(plan: Plan, url: str, staging: Path, opts: ConvertOptions, t0: float) -> ConvertResult:
    existing = _remote_manifest(url, staging)
    if existing is not None and not opts.overwrite:
        if existing.extra.get(_progress.FINGERPRINT_KEY) == plan.fingerprint:
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


@contextlib.contextmanager
def _writing(dest: str | os.PathLike[str], what: str) -> Iterator[None]:
    """An OSError while writing into DEST (disk full, quota, read-only) becomes a ConversionError
    naming DEST and what was being written, e.g. ``writing shard-000003.tar into DEST /d: [Errno 28] ...``."""
    try:
        yield
    except FastdataError:
        raise
    except OSError as e:
        detail = f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else str(e)
        raise ConversionError(f"{what} into DEST {dest}: {detail}") from e


def _check_dest_vs_src(listing: Listing, dest: Path) -> None:
    """Refuse a DEST that is SRC, lies inside an image SRC or holds an input file named like an
    output, also through symlinks: writing (or ``--overwrite`` removing) shards there would destroy
    inputs not yet read."""
    root, target = Path(os.path.realpath(listing.root)), Path(os.path.realpath(dest))
    if target == root or (listing.kind == "images" and root in target.parents):
        raise ConversionError(f"DEST {dest} is inside SRC {listing.root}; choose a folder outside SRC")
    for file in listing.files + tuple(i for i in listing.indexes if i is not None):
        real = Path(os.path.realpath(file))
        if real.parent == target and _progress.is_output(real.name):
            raise ConversionError(f"DEST {dest} holds SRC file {file}, which the conversion would replace; "
                                  "choose a folder outside SRC")


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

    threading.Thread(target=watch, name="fastdata-convert-parent-watch", daemon=True).start()


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
        with _writing(task.dest, f"writing {task.job.name}"):  # source read errors are no OSErrors here
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
                _upload(Path(task.dest) / name, task.upload, name)
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

