"""Where a conversion writes and reads: DEST's lock and checks, a URL DEST's staging, a URL SRC's copy.

A local DEST is ``flock``ed for the conversion's life (a second conversion into it fails at once,
naming the holder's pid; the kernel drops the lock however the holder dies), and refused when it is
SRC or lies inside it. An OSError while writing into DEST becomes a ConversionError naming DEST and
what was being written. A URL DEST is written through a local staging folder (uploads, its remote
manifest); a URL SRC is staged into a local folder first. Design note: ``docs/design/conversion.md``.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from fastdata.errors import ConversionError, FastdataError, RemoteError
from fastdata.io import (
    RetryPolicy,
    download,
    folder_url,
    read_bytes,
    redact_url,
    remote_size,
    split_query,
    upload,
    url_identity,
    url_join,
)
from fastdata.manifest import MANIFEST_NAME, Manifest, sha256_file
from fastdata.shards import _progress
from fastdata.shards._formats import SHARD_FORMATS
from fastdata.shards._listing import Listing
from fastdata.shards._plan import ConvertOptions

__all__ = ["check_dest_vs_src", "converting_pid", "dest_lock", "held_locks", "remote_manifest", "stage_source",
           "staging_folder", "upload_file", "writing_into"]

log = logging.getLogger("fastdata.convert")

held_locks: set[int] = set()  # descriptors of the DEST locks this process holds (closed in forked workers)


@contextlib.contextmanager
def dest_lock(dest: Path, shown: str) -> Iterator[None]:
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
    held_locks.add(fd)
    try:
        yield
    finally:
        held_locks.discard(fd)
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


@contextlib.contextmanager
def writing_into(dest: str | os.PathLike[str], what: str) -> Iterator[None]:
    """An OSError while writing into DEST (disk full, quota, read-only) becomes a ConversionError
    naming DEST and what was being written, e.g. ``writing shard-000003.tar into DEST /d: [Errno 28] ...``."""
    try:
        yield
    except FastdataError:
        raise
    except OSError as e:
        detail = f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else str(e)
        raise ConversionError(f"{what} into DEST {dest}: {detail}") from e


def check_dest_vs_src(listing: Listing, dest: Path) -> None:
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


def staging_folder(url: str, opts: ConvertOptions) -> Path:
    if opts.staging is not None:
        return Path(opts.staging)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastdata" / "convert" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]


_SHARD_SUFFIXES = tuple(s for fmt in SHARD_FORMATS.values() for s in fmt.source_suffixes)


def stage_source(url: str, opts: ConvertOptions) -> Path:
    """A local copy of SRC ``url``: one file (``.tar``/``.h5``/``.npz``), or a shard folder with its
    ``manifest.json`` (every file checked against it). Files already staged intact are kept, and
    their mtimes are fixed, so a rerun plans the same conversion (resume works)."""
    from fastdata.shards.reader import load_manifest

    # a signed URL's token (query) stays out of the staged names (the manifest records them) and out
    # of the staging key (a rotated token resumes the same staging)
    if opts.staging is not None:
        root = Path(opts.staging + "-src")
    else:
        root = staging_folder("src:" + url_identity(url).rstrip("/"), opts)
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


def upload_file(local: Path, base_url: str, name: str) -> None:
    try:
        upload(local, url_join(base_url, name))
    except RemoteError as e:
        raise ConversionError(f"uploading {name} to DEST {redact_url(base_url)}: {e}") from e


def remote_manifest(url: str, staging: Path) -> Manifest | None:
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
