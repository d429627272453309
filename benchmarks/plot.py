"""PNG charts from the benchmark JSON files (needs matplotlib: ``pip install -e ".[plot]"``).

    python benchmarks/plot.py --out docs/plots demo_w1.json demo_w2.json loader_w2.json

Understood inputs (recognised by their ``"benchmark"`` key):

- ``fastdata demo --json PATH`` (``"demo"``): one row per pipeline (tuned torch DataLoader, fastdata
  uncached / cached / GPU decode) with images/s, and every measured step's input wait;
- ``benchmarks/loader_throughput.py --json PATH`` (``"loader_throughput"``): images/s per loader.

Charts written to ``--out``:

- ``throughput_<benchmark>.png``: images/s by pipeline (bars) and DataLoader worker count (groups),
  one group per worker count found among the inputs of that benchmark (run it with several
  ``--workers`` to fill the chart); the machine is in the title;
- ``stall_timeline_<file>.png`` for each demo file: the input wait of every measured training step
  against wall time, one panel per pipeline on a shared log scale, so the saw-tooth of a starved loop
  (every k-th step waiting while the workers refill) is visible next to a fed one.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

KINDS = ("demo", "loader_throughput")


def load(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"plot.py: {path}: cannot read JSON: {e}") from None
        kind = data.get("benchmark") if isinstance(data, dict) else None
        if kind not in KINDS:
            raise SystemExit(f"plot.py: {path}: not a known benchmark JSON (\"benchmark\" is {kind!r}; "
                             f"expected one of {KINDS})")
        out.append((path, data))
    return out


def throughput(kind: str, data: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(workers, {pipeline: images/s}) of one file."""
    if kind == "demo":
        return int(data["settings"]["workers"]), {r["pipeline"]: float(r["images_per_s"]) for r in data["rows"]}
    return int(data["config"]["workers"]), {k: float(v["images_per_s"]) for k, v in data["results"].items()}


def load_avg(data: dict[str, Any]) -> float | None:
    """The machine's 1-minute load average when the run ended (demo JSONs record it)."""
    value = data.get("machine", {}).get("load_avg_1min")
    return float(value) if value is not None else None


def machine_label(kind: str, data: dict[str, Any], *, with_load: bool = True) -> str:
    m = data.get("machine", {})
    if kind == "demo":
        where = m.get("gpu") or f"{m.get('cpu_cores', '?')} CPU cores, no GPU"
        load = load_avg(data)
        if with_load and load is not None:
            where += f" (load average {load:.1f} at the end)"
        s = data["settings"]
        return (f"{where}, torch {m.get('torch', '?')}\n{s['model']}, batch {s['batch_size']}, "
                f"{s['images']} images")
    return f"{m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')}; batch {data['config']['batch_size']}"


def plot_throughput(plt: Any, kind: str, files: list[dict[str, Any]], out: Path) -> Path:
    by_workers: dict[int, dict[str, float]] = defaultdict(dict)
    loads: dict[int, float | None] = {}
    pipelines: list[str] = []
    for data in files:
        workers, rates = throughput(kind, data)
        loads[workers] = load_avg(data)
        for name, rate in rates.items():
            by_workers[workers][name] = rate  # a later file with the same workers wins
            if name not in pipelines:
                pipelines.append(name)
    groups = sorted(by_workers)
    width = 0.8 / max(len(pipelines), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) * max(len(pipelines), 2) / 2), 4.2))
    for i, name in enumerate(pipelines):
        xs = [g + (i - (len(pipelines) - 1) / 2) * width for g in range(len(groups))]
        ys = [by_workers[w].get(name, 0.0) for w in groups]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, labels=[f"{y:,.0f}" if y else "" for y in ys], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), [f"{w} worker{'s' if w != 1 else ''}" + (
        f"\n(load average {loads[w]:.1f})" if loads.get(w) is not None else "") for w in groups])
    ax.set_ylabel("images/s")
    ax.set_title(f"{kind}: throughput by pipeline and worker count\n"
                 f"{machine_label(kind, files[-1], with_load=False)}", fontsize=9)
    ax.legend(fontsize=8)
    ax.margins(y=0.12)
    fig.tight_layout()
    path = out / f"throughput_{kind}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(plt: Any, name: str, data: dict[str, Any], out: Path) -> Path:
    rows = [r for r in data["rows"] if r.get("timeline")]
    if not rows:
        raise SystemExit(f"plot.py: {name}: the demo JSON has no per-step timeline")
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 1.6 * len(rows) + 0.8), sharex=True, sharey=True,
                             squeeze=False)
    floor = 1e-3  # ms: waits below 1 us are drawn at 1 us on the log scale
    for ax, row in zip(axes[:, 0], rows):
        t0 = row["timeline"][0][0]
        xs = [t - t0 for t, _ in row["timeline"]]
        ys = [max(w * 1e3, floor) for _, w in row["timeline"]]
        ax.vlines(xs, floor, ys, linewidth=0.8)
        ax.plot(xs, ys, ".", markersize=2)
        ax.set_yscale("log")
        ax.set_title(f"{row['pipeline']}: {row['images_per_s']:,.0f} images/s, waiting "
                     f"{row['wait_share']:.0%} of the time", fontsize=8, loc="left")
        ax.set_ylabel("wait (ms)", fontsize=8)
    axes[-1, 0].set_xlabel("seconds into the measured epochs")
    fig.suptitle(f"input wait per training step\n{machine_label('demo', data)}", fontsize=9)
    fig.tight_layout()
    path = out / f"stall_timeline_{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", type=Path, help="benchmark JSON files")
    ap.add_argument("--out", type=Path, required=True, help="folder for the PNG files (created)")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit('plot.py: needs matplotlib: pip install -e ".[plot]"') from None
    files = load(args.inputs)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in KINDS:
        group = [d for _, d in files if d["benchmark"] == kind]
        if group:
            written.append(plot_throughput(plt, kind, group, args.out))
    for path, data in files:
        if data["benchmark"] == "demo":
            written.append(plot_timeline(plt, path.stem, data, args.out))
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
