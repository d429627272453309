"""``fastdata shard SRC DEST`` and ``fastdata verify DEST``: the converter, shipped in the wheel.

A thin argument layer over :mod:`fastdata.shards.convert`. ``tools/shard.py`` runs the same code
from a source checkout with its original interface (``shard.py SRC DEST [options]``,
``shard.py --verify DEST``); both share the options, messages and exit status:

- 0: success, also when DEST already holds the finished conversion of the same arguments and inputs;
- 1: failed conversion or verification (one ``<prog>: error: <problem>`` line per problem,
  naming file, key, shard or byte offset; a traceback too with ``--debug``);
- 2: bad arguments;
- 130: interrupted (rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fastdata._runtime import thread
from fastdata.cli._args import byte_size, nonempty_path, nonneg_int, positive_int
from fastdata.errors import FastdataError
from fastdata.io import local_path

__all__ = ["add_shard_subparsers", "tool_main", "verify_folder"]

TOOL_PROG = "shard.py"

SRC_HELP = """\
SRC is an image folder (one subfolder per class -> 'cls' label = index of the sorted class
names), a .tar file or folder of tar shards (webdataset ones too), an HDF5 shard file or folder,
a fastdata output folder, or a .npz whose arrays share their first axis (one field <name>.npy
per array). DEST receives the shards and manifest.json, which is written last.

Output is byte-identical whatever --workers is. An interrupted run resumes when rerun with the
same arguments: finished shards whose sha256 still matches are kept. Rerunning a finished
conversion with the same arguments and unchanged inputs reports it complete and exits 0.
"""

VERIFY_HELP = """\
Re-read every shard of DEST against its manifest.json: file present, byte size, sha256, sample
count, tar index (or HDF5 layout) and fields. Every problem is listed, one line each; exit
status 1 if there is any.
"""


class UsageError(FastdataError, ValueError):
    """Bad command-line arguments (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """Raises :class:`UsageError` instead of printing usage and exiting (one-line errors)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _workers_help(what: str) -> str:
    return f"{what} (default: one per usable CPU, at most one per shard)"


def add_convert_options(p: argparse.ArgumentParser, *, with_verify: bool = False) -> None:
    """The conversion options of ``fastdata shard`` and ``tools/shard.py`` (``with_verify``: the tool's
    parser, whose ``--verify`` also takes ``--workers``)."""
    p.add_argument("--format", choices=("tar", "hdf5"), default="tar", help="shard format (default: tar)")
    p.add_argument("--shard-size", type=byte_size, metavar="SIZE",
                   help="target shard size: 256MB (powers of 10), 1GiB (powers of 2), 1e9 or plain bytes "
                        "(default: 256MiB unless --samples-per-shard is given; with both, a shard ends at "
                        "whichever comes first)")
    p.add_argument("--samples-per-shard", type=positive_int, metavar="N",
                   help="samples per shard (default: no count limit, only --shard-size)")
    p.add_argument("--workers", type=positive_int, metavar="N",
                   help=_workers_help("processes writing shards in parallel"
                                      + ("; with --verify, threads checking shards" if with_verify else "")))
    p.add_argument("--shuffle", action="store_true",
                   help="shuffle samples across shards, seeded by --seed (default: sorted input order)")
    p.add_argument("--seed", type=nonneg_int, metavar="S", help="seed of --shuffle (default: 0)")
    p.add_argument("--resize", type=positive_int, metavar="N",
                   help="decode images, resize the shorter side to N, centre-crop N x N and store uint8 "
                        "(3, N, N) arrays as field 'img.npy' (default: keep the encoded bytes)")
    p.add_argument("--check", choices=("header", "full"), default="header",
                   help="image check without --resize: 'header' = open + verify (fast), 'full' = decode "
                        "every pixel (default: header)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace shards and manifest already in DEST; other files are left alone (default: a "
                        "non-empty DEST is an error unless it holds this conversion, finished or interrupted)")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="where shard jobs run: 'local' (process pool) or 'ray' (tasks on the Ray cluster that "
                        "ray.init() finds or starts; pip install 'fastdata[ray]'); same output either way (default: local)")
    p.add_argument("--strict", action="store_true",
                   help="fail on the first unreadable input (default: skip it and list it in the manifest)")
    _add_common_options(p)


def _add_common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar, no summary, no info lines; warnings and errors still show "
                        "(default: a progress bar when stderr is a terminal, then a summary line)")
    p.add_argument("--debug", action="store_true", help="show tracebacks (default: one line per error)")


def build_tool_parser() -> argparse.ArgumentParser:
    """``tools/shard.py``'s parser: ``SRC DEST [options]`` or ``--verify DEST``."""
    p = _Parser(prog=TOOL_PROG, description=SRC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                usage=f"{TOOL_PROG} SRC DEST [options]\n       {TOOL_PROG} --verify DEST [--workers N]")
    p.add_argument("paths", nargs="*", metavar="SRC DEST", help="input and output (DEST is created)")
    p.add_argument("--verify", metavar="DEST",
                   help="re-read every shard of DEST against its manifest, list every problem and exit "
                        "(installed: fastdata verify DEST)")
    add_convert_options(p, with_verify=True)
    return p


def add_shard_subparsers(subparsers: Any) -> None:
    """Add ``shard`` and ``verify`` to the ``fastdata`` command's subparsers (``func`` set on each)."""
    shard = subparsers.add_parser(
        "shard", help="convert images, tar, HDF5 or .npz into shards + manifest.json", description=SRC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    shard.add_argument("src", metavar="SRC", type=nonempty_path, help="input: image folder, tar, HDF5, fastdata folder or .npz")
    shard.add_argument("dest", metavar="DEST", type=nonempty_path, help="output folder (created), or a URL (s3://, gs://, ...): "
                       "each shard is uploaded once complete, the manifest last")
    add_convert_options(shard)
    shard.set_defaults(func=_cmd_shard)

    verify = subparsers.add_parser(
        "verify", help="re-read every shard of a folder against its manifest, listing every problem",
        description=VERIFY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("dest", metavar="DEST", type=nonempty_path, help="shard folder with manifest.json")
    verify.add_argument("--workers", type=positive_int, metavar="N", help=_workers_help("threads checking shards"))
    _add_common_options(verify)
    verify.set_defaults(func=_cmd_verify)


def _cmd_shard(args: argparse.Namespace) -> int:
    return run_guarded("fastdata shard", args, lambda: _convert(args.src, args.dest, args))


def _cmd_verify(args: argparse.Namespace) -> int:
    return run_guarded("fastdata verify", args, lambda: _verify(args.dest, args.workers, args.quiet, "fastdata verify"))


def tool_main(argv: Sequence[str] | None = None) -> int:
    """``tools/shard.py``: run it and return the exit status."""
    parser = build_tool_parser()
    try:  # intermixed: options may stand between SRC and DEST, as with `fastdata shard`
        args = parser.parse_intermixed_args(argv)
    except UsageError as e:
        print(f"{TOOL_PROG}: error: {e} (see --help)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if "" in args.paths or args.verify == "":  # an unset shell variable, never the current folder
        print(f"{TOOL_PROG}: error: expected a non-empty path, got '' (see --help)", file=sys.stderr)
        return 2
    if args.verify is not None and args.paths:
        print(f"{TOOL_PROG}: error: --verify DEST takes no SRC DEST arguments", file=sys.stderr)
        return 2
    if args.verify is not None:
        return run_guarded(TOOL_PROG, args, lambda: _verify(args.verify, args.workers, args.quiet, TOOL_PROG))
    if len(args.paths) != 2:
        print(f"{TOOL_PROG}: error: expected SRC and DEST, got {len(args.paths)} path(s) (see --help)",
              file=sys.stderr)
        return 2
    return run_guarded(TOOL_PROG, args, lambda: _convert(*args.paths, args))


# ---------------------------------------------------------------------------------- running

def run_guarded(prog: str, args: argparse.Namespace, run: Callable[[], int]) -> int:
    """The commands' single error boundary: one line per error (status 1), 130 on Ctrl-C."""
    debug = bool(args.debug or getattr(args, "verbose", False))
    try:
        with _logging_to_stderr(prog, args.quiet):
            code = run()
            sys.stdout.flush()  # a reader that went away (`| head -1`) shows here, not at exit
            return code
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        verifying = getattr(args, "verify", None) is not None or getattr(args, "func", None) is _cmd_verify
        then = "nothing was changed" if verifying else "rerun the same command to resume"
        print(f"{prog}: error: interrupted; {then}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, status 1 (the traceback with --debug)
        if stdout_closed(e):
            return 1
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def stdout_closed(error: BaseException) -> bool:
    """Whether ``error`` is a write to stdout whose reader went away (``fastdata inspect DEST --shards | head -1``).

    Then stdout is pointed at ``os.devnull``, so that Python's flush at exit does not fail again, and the
    command ends quietly with status 1 (the Python docs' "Note on SIGPIPE"). A broken pipe elsewhere (a
    socket) stays an error.
    """
    if not isinstance(error, BrokenPipeError):
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return False
    try:
        import select

        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
            return False  # stdout is fine: the broken pipe was another one
    except (AttributeError, OSError, ValueError):  # no poll() (Windows): take it for stdout's
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return True


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    msg = text[0] if text else type(err).__name__
    if isinstance(err, (FastdataError, ValueError, OSError)):
        return msg
    return f"{type(err).__name__}: {msg}"


class _OneLine(logging.Formatter):
    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name == "py.warnings":  # "file:line: UserWarning: text\n  source line"
            message = message.strip().splitlines()[0].split("Warning: ", 1)[-1]
        return f"{self.prog}: {record.levelname.lower()}: {message}"


@contextlib.contextmanager
def _logging_to_stderr(prog: str, quiet: bool) -> Iterator[None]:
    """fastdata's log records and Python warnings as ``<prog>: warning: ...`` lines, for one run.

    The records do not propagate meanwhile, so a root handler (``fastdata``'s ``basicConfig``)
    does not print them twice.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(prog))
    loggers = [logging.getLogger("fastdata"), logging.getLogger("py.warnings")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.WARNING if quiet else logging.INFO)
        lg.propagate = False
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def _convert(src: str, dest: str, args: argparse.Namespace) -> int:
    from fastdata.shards.convert import ConvertOptions, convert

    if args.seed is not None and not args.shuffle:  # it would be ignored: the shards keep the sorted order
        raise UsageError("--seed S only seeds --shuffle: add --shuffle to shuffle the samples, or drop --seed")
    options = ConvertOptions(
        format=args.format, shard_size=args.shard_size, samples_per_shard=args.samples_per_shard,
        workers=args.workers, shuffle=args.shuffle, seed=args.seed or 0, resize=args.resize, check=args.check,
        strict=args.strict, overwrite=args.overwrite, progress=False if args.quiet else None,
        engine=args.engine,
    )
    result = convert(src, dest, options)
    if args.quiet:
        return 0
    from fastdata.io import redact_url

    dest = redact_url(dest)  # a URL's password and signed-URL tokens stay out of logs
    m = result.manifest
    shards = f"{len(m.shards)} {m.format} shard{'s' if len(m.shards) != 1 else ''}"
    if result.complete:
        print(f"{dest}: complete, {m.num_samples} samples in {shards}, "
              f"{len(m.skipped)} skipped (converted earlier with these arguments and inputs; nothing to do)")
        return 0
    rate = result.processed / result.seconds if result.seconds > 0 else 0.0
    kept = f", {result.kept} kept from the interrupted run" if result.kept else ""
    print(f"{dest}: {m.num_samples} samples in {shards}{kept}, "
          f"{len(m.skipped)} skipped, {result.seconds:.1f} s ({rate:.0f} samples/s)")
    return 0


def _verify(dest: str, workers: int | None, quiet: bool, prog: str) -> int:
    from fastdata.io import redact_url

    shown = redact_url(dest)  # a URL's password and signed-URL tokens stay out of logs
    problems = verify_folder(dest, workers=workers, progress=False if quiet else None)
    for problem in problems:
        print(f"{prog}: error: {shown}: {problem}", file=sys.stderr)
    if problems:
        if len(problems) > 1:
            print(f"{prog}: {shown}: {len(problems)} problems", file=sys.stderr)
        return 1
    if not quiet:
        from fastdata.shards.reader import load_manifest

        manifest = load_manifest(dest)
        n = len(manifest.shards)
        print(f"{shown}: ok, {n} shard{'s' if n != 1 else ''}, {manifest.num_samples} samples")
    return 0


def unfinished_conversion(folder: str | Path) -> str:
    """Why ``folder``, holding a conversion's progress records, has no manifest: still running, or interrupted."""
    from fastdata.manifest import MANIFEST_NAME
    from fastdata.shards.convert import converting_pid

    pid = converting_pid(folder)
    if pid is not None:
        return f"no {MANIFEST_NAME} yet: a conversion into it is running (pid {pid}); try again once it finishes"
    return f"no {MANIFEST_NAME}: the conversion into it did not finish (rerun it to resume)"


def verify_folder(dest: str | Path, *, workers: int | None = None, progress: bool | None = None) -> list[str]:
    """Every problem of the shard folder ``dest`` (empty: all good), checking shards in threads.

    ``workers`` threads (default: the usable CPUs) each verify whole shards: hashing and file
    reads release the GIL. ``progress`` shows a tqdm bar in bytes on stderr (None: when stderr is
    a terminal). Problems come in manifest order whatever ``workers`` is.
    """
    from fastdata.errors import ConversionError, ManifestError
    from fastdata.manifest import MANIFEST_NAME, Manifest
    from fastdata.shards.convert import PROGRESS_DIR, default_workers
    from fastdata.io import is_url
    from fastdata.shards.reader import unheld_fields, verify_remote_shard, verify_shard

    check: Callable[..., list[str]]
    path: Any
    if is_url(str(dest)):  # each shard downloaded to a temporary folder, checked, deleted
        from fastdata.shards.reader import load_manifest

        check, path = verify_remote_shard, str(dest)
        try:
            manifest = load_manifest(path)
        except ManifestError as e:
            return [str(e)]
    else:
        check, path = verify_shard, Path(local_path(os.fspath(dest)))
        if not path.is_dir():
            raise ConversionError(f"DEST {dest}: " + ("not a folder (pass the folder holding manifest.json)"
                                                     if path.exists() else "no such folder"))
        if not (path / MANIFEST_NAME).exists() and (path / PROGRESS_DIR).is_dir():
            return [unfinished_conversion(path)]
        try:
            manifest = Manifest.load(path)
        except ManifestError as e:
            return [str(e)]
    shards = list(manifest.shards)
    results: list[list[str]] = [[] for _ in shards]
    threads = max(1, min(workers or default_workers(), len(shards)))
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(shards)):
        todo.put(i)
    done: queue.SimpleQueue[tuple[int, list[str] | None, BaseException | None]] = queue.SimpleQueue()
    stop = threading.Event()
    seen: set[str] = set()  # the fields the shards hold

    def work() -> None:
        while not stop.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((i, check(path, manifest, shards[i], seen=seen), None))
            except BaseException as e:  # noqa: BLE001 - re-raised by the calling thread
                done.put((i, None, e))

    # Daemon threads: on Ctrl-C (or an error) the command ends at once instead of waiting at exit
    # for the shards being hashed, which takes minutes for large ones; they only read.
    for k in range(threads):
        thread(work, name=f"fastdata-verify-{k}").start()
    with _bytes_bar(sum(s.bytes for s in shards), progress) as advance:
        try:
            for _ in shards:
                while True:
                    try:
                        i, found, error = done.get(timeout=0.5)
                        break
                    except queue.Empty:
                        continue
                if error is not None:
                    raise error
                results[i] = found or []
                advance(shards[i].bytes)
        finally:
            stop.set()
    problems = [problem for found in results for problem in found]
    return problems or unheld_fields(manifest, seen)


@contextlib.contextmanager
def _bytes_bar(total: int, enabled: bool | None) -> Iterator[Callable[[int], Any]]:
    if not (sys.stderr.isatty() if enabled is None else enabled):
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
              dynamic_ncols=True) as bar:
        yield bar.update
