"""The ``fastdata`` command (also ``python -m fastdata``): demo, doctor, tune, bench, inspect, cache, shard, verify."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from fastdata._version import __version__
from fastdata.cli._args import nonempty_path, nonneg_int
from fastdata.cli._bench import add_bench_subparser
from fastdata.cli._cache_cmd import add_cache_subparser
from fastdata.cli._demo import add_demo_subparser
from fastdata.cli._doctor import add_doctor_subparser
from fastdata.cli._shard_cmd import (
    add_shard_subparsers,
    stdout_closed,
    unfinished_conversion,
)
from fastdata.cli._tune import add_tune_subparser
from fastdata.errors import FastdataError

log = logging.getLogger("fastdata")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from fastdata.shards.reader import load_manifest

    try:
        m = load_manifest(args.dest)  # a folder URL (s3://, https://, ...) too, as `fastdata verify` reads
    except FastdataError:
        _unfinished(args.dest)
        raise
    if args.json:  # the manifest as stored, plus the totals the table shows
        print(json.dumps({**m.to_json(), "total_bytes": sum(s.bytes for s in m.shards)}, indent=1))
        return 0
    total_bytes = sum(s.bytes for s in m.shards)
    print(f"format      {m.format} (version {m.format_version})")
    print(f"samples     {m.num_samples}")
    print(f"shards      {len(m.shards)}  ({total_bytes / 1e6:.1f} MB, "
          f"{total_bytes / max(m.num_samples, 1) / 1e3:.1f} kB/sample)")
    print("fields      " + ", ".join(
        f.name + f" [{f.kind}" + (f" {f.dtype}" if f.dtype else "")
        + (f" {tuple(f.shape)}" if f.shape is not None else "") + "]"
        for f in m.fields))
    print(f"skipped     {len(m.skipped)}")
    for item in m.skipped[: args.show_skipped]:
        print(f"  {item['source']}: {item['reason']}")
    if args.shards:
        for s in m.shards:
            print(f"  {s.name}  {s.num_samples:>8d} samples  {s.bytes:>12d} B  {s.sha256[:16]}")
    return 0


def _unfinished(dest: str) -> None:
    """Raise, as ``fastdata verify`` says it, when DEST (or DEST/manifest.json) lacks its manifest because the
    conversion into it did not finish."""
    from pathlib import Path

    from fastdata.io import is_url, local_path
    from fastdata.manifest import MANIFEST_NAME
    from fastdata.shards.convert import PROGRESS_DIR

    if is_url(dest):
        return
    path = Path(local_path(dest))
    folder = path if path.is_dir() else path.parent if path.name == MANIFEST_NAME else None
    if folder is not None and not (folder / MANIFEST_NAME).exists() and (folder / PROGRESS_DIR).is_dir():
        raise FastdataError(f"{dest}: {unfinished_conversion(folder)}")


def _message(error: BaseException) -> str:
    """The error's message; for one re-raised from a DataLoader worker, whose text is torch's "Caught X in
    DataLoader worker process N." and the worker's whole traceback, the original message and the worker."""
    text = str(error)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 3 or not lines[1].startswith("Original Traceback"):
        return text
    name = type(error).__name__
    start = next((i for i in range(len(lines) - 1, 1, -1)
                  if lines[i].split(":", 1)[0].rsplit(".", 1)[-1] == name and ":" in lines[i]), None)
    if start is None:
        return text
    where = lines[0].rstrip(".").split(" in ", 1)[-1]  # "DataLoader worker process 0"
    return f"{lines[start].split(': ', 1)[-1]} (in {where})"


def build_parser() -> argparse.ArgumentParser:
    """The ``fastdata`` command's parser: every subcommand, each leaf with ``func`` set to its handler."""
    p = argparse.ArgumentParser(prog="fastdata", description="Keep GPUs fed.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks (default: off)")
    sub = p.add_subparsers(dest="command", required=True)

    add_demo_subparser(sub)

    add_bench_subparser(sub)

    add_doctor_subparser(sub)
    add_tune_subparser(sub)

    inspect = sub.add_parser("inspect", help="summarise a shard folder's manifest",
                             description="Summarise DEST's manifest.json: format, samples, shards, bytes, fields "
                                         "and skipped inputs. Reads only the manifest (`fastdata verify` checks the shards).")
    inspect.add_argument("dest", metavar="DEST", type=nonempty_path, help="folder with manifest.json (or the file), or its URL")
    inspect.add_argument("--shards", action="store_true", help="list every shard (default: off)")
    inspect.add_argument("--show-skipped", type=nonneg_int, default=10, metavar="N",
                         help="list at most N skipped inputs with their reasons (default: 10)")
    inspect.add_argument("--json", action="store_true",
                         help="print the manifest and totals as JSON instead of a summary (default: off)")
    inspect.set_defaults(func=_cmd_inspect)

    add_cache_subparser(sub)
    add_shard_subparsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastdata`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away (`| head -1`) shows here, not at exit
        return code
    except (FastdataError, OSError, ValueError) as e:
        if stdout_closed(e):  # quietly, status 1 (the Python docs' "Note on SIGPIPE")
            return 1
        if args.verbose:
            raise
        print(f"fastdata {args.command}: error: {_message(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fastdata {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
