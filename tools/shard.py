#!/usr/bin/env python3
"""Convert a dataset into fastdata shards, or verify a shard folder.

    python tools/shard.py SRC DEST [--format tar|hdf5] [--shard-size 256MiB | --samples-per-shard N]
                          [--workers N] [--shuffle --seed S] [--resize N] [--overwrite] [--strict]
    python tools/shard.py --verify DEST

A thin argument layer over :mod:`fastdata.shards.convert`. Exit status: 0 success, 1 failed
conversion or verification, 2 bad arguments, 130 interrupted (rerun the same command to resume).
Every failure prints one line ``shard.py: error: <problem>`` (a traceback too with ``--debug``).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

PROG = "shard.py"

try:  # installed (pip install -e .) or on the path
    import fastdata  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_DESCRIPTION = """\
SRC is an image folder (one subfolder per class -> 'cls' label = index of the sorted class
names), a .tar file or folder of tar shards (webdataset ones too), an HDF5 shard file or folder,
a fastdata output folder, or a .npz whose arrays share their first axis (one field <name>.npy
per array). DEST receives the shards and manifest.json, which is written last.

Output is byte-identical whatever --workers is. An interrupted run resumes when rerun with the
same arguments: finished shards whose sha256 still matches are kept.
"""


class UsageError(Exception):
    """Bad command-line arguments (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_seed = _int_at_least(0, "an integer >= 0")


def _size(text: str) -> int:
    from fastdata.shards.convert import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                usage=f"{PROG} SRC DEST [options]\n       {PROG} --verify DEST")
    p.add_argument("paths", nargs="*", metavar="SRC DEST", help="input and output (DEST is created)")
    p.add_argument("--verify", metavar="DEST", help="re-read every shard of DEST against its manifest and exit")
    p.add_argument("--format", choices=("tar", "hdf5"), default="tar", help="shard format (default: tar)")
    p.add_argument("--shard-size", type=_size, metavar="SIZE",
                   help="target shard size: 256MB, 1GiB, 1000000, ... (default: 256MiB unless "
                        "--samples-per-shard is given; with both, a shard ends at whichever comes first)")
    p.add_argument("--samples-per-shard", type=_positive_int, metavar="N", help="samples per shard")
    p.add_argument("--workers", type=_positive_int, metavar="N",
                   help="processes writing shards in parallel (default: all CPUs, at most one per shard)")
    p.add_argument("--shuffle", action="store_true", help="shuffle samples across shards (see --seed)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of --shuffle (default: 0)")
    p.add_argument("--resize", type=_positive_int, metavar="N",
                   help="decode images, resize the shorter side to N, centre-crop N x N and store uint8 "
                        "(3, N, N) arrays as field 'img.npy' instead of the encoded bytes")
    p.add_argument("--check", choices=("header", "full"), default="header",
                   help="image check without --resize: 'header' = open + verify (fast, default), "
                        "'full' = decode every pixel")
    p.add_argument("--overwrite", action="store_true",
                   help="replace shards and manifest already in DEST (other files are left alone)")
    p.add_argument("--strict", action="store_true", help="fail on the first unreadable input instead of skipping it")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name == "py.warnings":  # "file:line: UserWarning: text\n  source line"
            message = message.strip().splitlines()[0].split("Warning: ", 1)[-1]
        return f"{PROG}: {record.levelname.lower()}: {message}"


@contextlib.contextmanager
def _logging_to_stderr(quiet: bool) -> Iterator[None]:
    """fastdata's log records and Python warnings as ``shard.py: warning: ...`` lines, for one run."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    loggers = [logging.getLogger("fastdata"), logging.getLogger("py.warnings")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.WARNING if quiet else logging.INFO)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _verify(dest: str, quiet: bool) -> int:
    from fastdata.manifest import Manifest
    from fastdata.shards.convert import verify_dest

    problems = verify_dest(dest)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        print(f"{PROG}: error: {dest}: {problems[0]}{more}", file=sys.stderr)
        return 1
    if not quiet:
        manifest = Manifest.load(dest)
        print(f"{dest}: ok, {len(manifest.shards)} shards, {manifest.num_samples} samples")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from fastdata.shards.convert import ConvertOptions, convert

    src, dest = args.paths
    options = ConvertOptions(
        format=args.format, shard_size=args.shard_size, samples_per_shard=args.samples_per_shard,
        workers=args.workers, shuffle=args.shuffle, seed=args.seed, resize=args.resize, check=args.check,
        strict=args.strict, overwrite=args.overwrite, progress=False if args.quiet else None,
    )
    result = convert(src, dest, options)
    if not args.quiet:
        m = result.manifest
        rate = result.processed / result.seconds if result.seconds > 0 else 0.0
        kept = f", {result.kept} kept from the interrupted run" if result.kept else ""
        print(f"{dest}: {m.num_samples} samples in {len(m.shards)} {m.format} shards{kept}, "
              f"{len(m.skipped)} skipped, {result.seconds:.1f} s ({rate:.0f} samples/s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e} (see --help)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if args.verify is not None and args.paths:
        print(f"{PROG}: error: --verify DEST takes no SRC DEST arguments", file=sys.stderr)
        return 2
    if args.verify is None and len(args.paths) != 2:
        print(f"{PROG}: error: expected SRC and DEST, got {len(args.paths)} path(s) (see --help)", file=sys.stderr)
        return 2
    try:
        with _logging_to_stderr(args.quiet):
            return _verify(args.verify, args.quiet) if args.verify is not None else _convert(args)
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's single error boundary: one line, status 1
        if args.debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    msg = text[0] if text else type(err).__name__
    from fastdata.errors import FastdataError

    if isinstance(err, (FastdataError, ValueError, OSError)):
        return msg
    return f"{type(err).__name__}: {msg}"


if __name__ == "__main__":
    sys.exit(main())
