"""The ``fastdata`` command (also ``python -m fastdata``): demo, doctor, bench, inspect, cache, shard, verify."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from fastdata.cli._args import nonneg_int, positive_int
from fastdata.cli._cache_cmd import add_cache_subparser
from fastdata.cli._shard_cmd import add_shard_subparsers
from fastdata.errors import FastdataError

log = logging.getLogger("fastdata")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from fastdata.manifest import Manifest

    m = Manifest.load(args.dest)
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


def _cmd_doctor(args: argparse.Namespace) -> int:
    from fastdata.cli._doctor import run_doctor

    return run_doctor()


def _cmd_demo(args: argparse.Namespace) -> int:
    from fastdata.cli._demo import run_demo

    return run_demo(workdir=args.dir, num_images=args.images, num_workers=args.workers,
                    epochs=args.epochs, batch_size=args.batch_size)


def _cmd_bench(args: argparse.Namespace) -> int:
    from fastdata.cli._demo import run_bench

    return run_bench(workdir=args.dir, num_images=args.images, num_workers=args.workers,
                     repeats=args.repeats, json_path=args.json)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastdata", description="Keep GPUs fed.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate a small JPEG set, shard it, and train from it end to end")
    demo.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    demo.add_argument("--images", type=positive_int, default=1024)
    demo.add_argument("--workers", type=nonneg_int, default=2)
    demo.add_argument("--epochs", type=positive_int, default=3)
    demo.add_argument("--batch-size", type=positive_int, default=64)
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="measure this machine: raw reads, decode pipeline, cache, H2D")
    bench.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    bench.add_argument("--images", type=positive_int, default=1024)
    bench.add_argument("--workers", type=nonneg_int, default=2)
    bench.add_argument("--repeats", type=positive_int, default=3)
    bench.add_argument("--json", default=None, help="write results as JSON to this path")
    bench.set_defaults(func=_cmd_bench)

    doctor = sub.add_parser("doctor", help="check this environment for input-pipeline pitfalls")
    doctor.set_defaults(func=_cmd_doctor)

    inspect = sub.add_parser("inspect", help="summarise a shard folder's manifest")
    inspect.add_argument("dest", help="folder with manifest.json (or the file)")
    inspect.add_argument("--shards", action="store_true", help="list every shard")
    inspect.add_argument("--show-skipped", type=nonneg_int, default=10, metavar="N")
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
        return int(args.func(args) or 0)
    except (FastdataError, OSError, ValueError) as e:
        if args.verbose:
            raise
        print(f"fastdata {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fastdata {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
