"""``fastdata tune SHARDS``: search workers, prefetch depth, decode backend and batch size by measuring them.

The search lives in :func:`fastdata.monitor.tune`; this module prints the tuned configuration as
ready-to-paste Python and its measured throughput against the starting configuration.
"""
from __future__ import annotations

import json
from typing import Any


def _describe(o: Any, threads: int = 0) -> str:
    loading = f"num_workers={o.num_workers}" + (f", decode_threads={threads}" if threads else "")
    return f"{loading}, depth={o.depth}, decode={o.decode}, batch_size={o.batch_size}"


def format_result(r: Any, snippet: str) -> list[str]:
    what = {"job": "the whole job (loader -> CUDAPrefetcher -> step)", "loader": "the loader alone",
            "input": "the input side (loader -> CUDAPrefetcher -> transforms)"}[r.measured]
    lines = ["trials:"]
    width = max([8] + [len(str(t["value"])) for t in r.trials])  # "torchcodec" is wider than a number
    for t in r.trials:
        extra = ", ".join(f"{k} {v:,.0f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in t.items() if k not in ("dimension", "value"))
        lines.append(f"  {t['dimension']:<14} {t['value']!s:<{width}} {extra}")
    lines += [f"- {n}" for n in r.notes]
    lines += [f"measured on {what}, back to back:",
              f"  start  {_describe(r.start)}: {r.start_rate:,.0f} images/s",
              f"  tuned  {_describe(r.best, r.decode_threads)}: {r.best_rate:,.0f} images/s ({r.speedup:.2f}x)",
              "", "# the tuned configuration, ready to paste:", snippet]
    return lines


def _cmd_tune(args: Any) -> int:
    from fastdata.cli._doctor import options_from
    from fastdata.manifest import Manifest
    from fastdata.monitor import pick_fields, python_snippet, tune
    from fastdata.prefetch import resolve_device

    start = options_from(args)
    result = tune(args.shards, start, batch_limit=args.max_batch)
    fields = pick_fields(Manifest.load(args.shards), start.field, start.label)
    snippet = python_snippet(args.shards, result.best, fields, resolve_device(start.device), result.decode_threads)
    data = {**result.to_dict(), "python": snippet}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print("\n".join(format_result(result, snippet)))
    return 0


def add_tune_subparser(subparsers: Any) -> Any:
    """Add ``tune`` to the ``fastdata`` command's subparsers."""
    from fastdata.cli._args import nonempty_path, output_file, positive_int
    from fastdata.cli._doctor import add_pipeline_arguments

    p = subparsers.add_parser(
        "tune", help="search workers, prefetch depth, decode backend and batch size; print the best as Python",
        description="Measure the loader (or, with --model/--step-ms, the whole job) over SHARDS while varying "
                    "num_workers (never above the cores), the thread decoder on as many cores (decode_threads, no "
                    "worker processes), the decoder (Pillow or TorchCodec on the CPU; on the device "
                    "where CUDA is available), the prefetch depth and, with a "
                    "model on a GPU, the batch size (the largest that fits, less 10% headroom). The options give "
                    "the starting configuration; the best is printed as ready-to-paste Python with its measured "
                    "throughput against the start.")
    p.add_argument("shards", metavar="SHARDS", type=nonempty_path, help="shard folder with manifest.json")
    add_pipeline_arguments(p, samples=256)
    p.add_argument("--max-batch", type=positive_int, default=2048, metavar="N",
                   help="largest batch size the search tries (a model on a GPU), never above --samples (default: 2048)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of text (default: off)")
    p.add_argument("--out", type=output_file, default=None, metavar="PATH", help="also write the JSON results to PATH (default: none)")
    p.set_defaults(func=_cmd_tune)
    return p
