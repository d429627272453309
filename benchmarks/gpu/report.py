"""The results of `check.sh --out DIR` as markdown, for the results page, and the defaults they decide.

    python3 benchmarks/gpu/report.py DIR            # tables of parts (b), (c), (d), the targets, the defaults
    python3 benchmarks/gpu/report.py --best-args DIR/decode.json   # part (b)'s best row as train_e2e.py options

Reads DIR/decode.json (part b, ``decode_contention.py``), DIR/train.json (part c, ``train_e2e.py``),
DIR/h2d.json (part d, ``h2d_overlap.py``) and the last line of DIR/pytest_cuda.txt (part a); a part
whose file is missing or broken is said so and the rest is printed. Works on the committed copies
under ``benchmarks/results/h200/`` as well.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as e:
        return None, f"{path.name}: not available ({type(e).__name__})"


def n(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def fed(r: dict[str, Any]) -> float:
    """What a training fed by this stage could reach beside it: min(stage, training) images/s."""
    return min(r["stage_beside_images_per_s"], r["train_beside_images_per_s"])


def measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "stage_beside_images_per_s" in r]


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row with the most :func:`fed` images/s (then the most stage images/s beside training), in brief."""
    done = [r for r in measured(rows) if not r.get("repeat")]
    if not done:
        return None
    top = max(done, key=lambda r: (fed(r), r["stage_beside_images_per_s"]))
    return {k: top[k] for k in ("decoder", "candidate", "priority", "stage_beside_images_per_s",
                                "train_beside_images_per_s", "train_share")}


def spread(rows: list[dict[str, Any]]) -> float | None:
    """Relative difference of the first row and its repeat (min(stage, training) beside training)."""
    done = measured(rows)
    rep = [r for r in done if r.get("repeat")]
    first = [r for r in done if not r.get("repeat")]
    if not rep or not first:
        return None
    a, b = fed(first[0]), fed(rep[0])
    return abs(a - b) / max((a + b) / 2, 1e-9)


def decode_section(d: dict[str, Any]) -> list[str]:
    env = d.get("env", {})
    about = (f"{env.get('gpu', env.get('device'))}, torch {env.get('torch')}, torchvision {env.get('torchvision')}, "
             f"TorchCodec {env.get('torchcodec')}, nvImageCodec {env.get('nvidia-nvimgcodec-cu13')}; "
             f"`benchmarks/gpu/decode_contention.py`, batches of {d.get('args', {}).get('batch')}; training alone "
             f"{n(d.get('train_alone_images_per_s'))} images/s (at the end {n(d.get('train_alone_end_images_per_s'))}).")
    head = ("| decoder | candidate | stream | stage alone (img/s) | CPU cores | stage beside training (img/s) "
            "| training beside (img/s) | training share | peak MB |")
    out = [f"### (b) Decode stage alone and beside {d.get('args', {}).get('model', 'resnet18')} training", "",
           about, "", head, "|---|---|---|---|---|---|---|---|---|"]
    for r in d.get("rows", []):
        name = f"| {r['decoder']} | {r['candidate']}{' (repeat)' if r.get('repeat') else ''} | {r['priority']} "
        if "stage_beside_images_per_s" not in r:
            out.append(name + f"| {r.get('skipped') or r.get('error', '')[:120]} | | | | | |")
            continue
        out.append(name + f"| {n(r['stage_alone_images_per_s'])} | {n(r['cpu_cores_alone'], 1)} "
                   f"| {n(r['stage_beside_images_per_s'])} | {n(r['train_beside_images_per_s'])} "
                   f"| {pct(r['train_share'])} | {n(r.get('peak_allocated_MB'))} |")
    missing = {k: v for k, v in d.get("decoders", {}).items() if v}
    if missing:
        out += ["", "Not measured: " + "; ".join(f"{k} ({v[:100]})" for k, v in missing.items()) + "."]
    s = spread(d.get("rows", []))
    b = d.get("best")
    best = "none" if not b else (f"{b['decoder']} {b['candidate']} on a {b['priority']}-priority stream (stage "
                                 f"{n(b['stage_beside_images_per_s'])}, training {n(b['train_beside_images_per_s'])})")
    out += ["", (f"Best beside training (most min(stage, training) images/s): {best}; the first row and its repeat "
                 f"differ by {pct(s)}.")]
    return out


def train_section(t: dict[str, Any]) -> list[str]:
    a = t.get("args", {})
    model = " and ".join(a.get("models") or ["?"])
    about = (f"{t.get('device_name', t.get('device'))}, `benchmarks/train_e2e.py`, {a.get('images')} JPEGs, batch "
             f"{a.get('batch_size')}, {a.get('workers')} workers, {a.get('warmup')} warm-up + {a.get('epochs')} timed "
             f"epochs; the cached row serves {a.get('size')} px centre crops from the cache (a random crop cannot be "
             "cached).")
    out = [f"### (c) {model} trained with RandomResizedCrop({a.get('size')}) + flip, bf16 channels_last", "", about, "",
           "| pipeline | images/s | of resident | GPU util | wait p99 (ms) | CPU cores |", "|---|---|---|---|---|---|"]
    for r in t.get("results", []):
        label = r["variant"]
        if "decoder" in r:
            label += f" ({r['decoder']}, {r.get('decode_candidate')}, {r.get('stream_priority')} stream)"
        if "error" in r:
            out.append(f"| {label} | {r['error'][:120]} | | | | |")
            continue
        util = None if r.get("gpu_util_pct") is None else r["gpu_util_pct"] / 100
        out.append(f"| {label} | {n(r['images_per_s'])} | {pct(r.get('share_of_resident'))} | {pct(util)} "
                   f"| {n(r.get('wait_p99_ms'), 2)} | {n(r.get('cpu_cores'), 1)} |")
    return out


PAIRS = (("pinned", "prefetcher_pinned", "one_ahead"), ("pageable", "prefetcher", "one_ahead_pin"))


def h2d_pairs(h: dict[str, Any]) -> list[tuple[float, str, float, float]]:
    """(compute ms, batches from, apex step ms, prefetcher step ms) per configuration."""
    by: dict[tuple[float, str], dict[str, float]] = {}
    for r in h.get("results", []):
        by.setdefault((r["compute_ms"], r.get("jitter", 0)), {})[r["variant"]] = r["step_ms"]
    out = []
    for (compute, jitter), g in sorted(by.items(), reverse=True):
        for source, ours, theirs in PAIRS:
            if ours in g and theirs in g and not jitter:
                out.append((compute, source, g[theirs], g[ours]))
    return out


def h2d_section(h: dict[str, Any]) -> list[str]:
    raw = h.get("raw", {})
    about = (f"{h.get('device')}, `benchmarks/h2d_overlap.py`, {h.get('args', {}).get('batch_mb')} MB uint8 batches, "
             f"step time in ms (lower is better); raw pinned copy {n(raw.get('pinned_gbps'), 1)} GB/s.")
    out = ["### (d) CUDAPrefetcher against apex's one-ahead loop", "", about, "",
           "| compute | batches | apex one-ahead | CUDAPrefetcher | prefetcher / apex |", "|---|---|---|---|---|"]
    for compute, source, apex, ours in h2d_pairs(h):
        out.append(f"| {compute} ms | {source} | {apex:.2f} | {ours:.2f} | {ours / apex:.2f}x |")
    return out


def targets(d: Any, t: Any, h: Any) -> list[str]:
    rows = measured(d.get("rows", [])) if d else []
    res = {r["variant"]: r for r in (t or {}).get("results", []) if "error" not in r}
    out = ["### Targets", "", "| target | reached |", "|---|---|"]

    def line(what: str, value: str, ok: bool | None) -> None:
        out.append(f"| {what} | {value} {'' if ok is None else ('(met)' if ok else '(not met)')} |")

    beside = max((r["stage_beside_images_per_s"] for r in rows), default=None)
    line("decode stage beside resnet18 training >= 10,000 images/s", n(beside), None if beside is None else beside >= 1e4)
    alone = max(rows, key=lambda r: r["stage_alone_images_per_s"], default=None)
    if alone is None:
        line("decode stage alone >= 22,000 images/s with <= 4 CPU cores", "-", None)
    else:
        line("decode stage alone >= 22,000 images/s with <= 4 CPU cores",
             f"{n(alone['stage_alone_images_per_s'])} with {n(alone['cpu_cores_alone'], 1)} cores",
             alone["stage_alone_images_per_s"] >= 22e3 and alone["cpu_cores_alone"] <= 4)
    g = next((r for k, r in res.items() if k.startswith("fastdata_gpu_rrc")), None)
    if g is None:
        line("uncached feed >= 95% of resident with <= 8 CPU cores", "-", None)
    else:
        line("uncached feed >= 95% of resident with <= 8 CPU cores",
             f"{pct(g.get('share_of_resident'))} with {n(g.get('cpu_cores'), 1)} cores",
             g.get("share_of_resident", 0) >= 0.95 and g.get("cpu_cores", 99) <= 8)
    c = res.get("fastdata_cached")
    line("cached feed >= 97% of resident", pct(c.get("share_of_resident")) if c else "-",
         None if c is None else c.get("share_of_resident", 0) >= 0.97)
    pairs = h2d_pairs(h) if h else []
    worst = max((ours / apex for _, _, apex, ours in pairs), default=None)
    line("prefetcher step <= 1.00x apex's at every compute", "-" if worst is None else f"worst {worst:.2f}x",
         None if worst is None else worst <= 1.0)
    return out


# The codec-side rows of candidates.py: (decoder, candidate, the DecodeImages argument it sets, its value)
CODEC_ROWS = (("nvimgcodec", "nowait", "host_wait", "False"), ("torchcodec", "threads4", "decode_threads", "4"))


def decisions(d: Any, t: Any) -> list[str]:
    out = ["### Defaults these figures decide", ""]
    rows = [r for r in measured(d.get("rows", [])) if not r.get("repeat")] if d else []
    if not rows:
        return out + [("No part (b) figures: every default stays (the decoder `device_decoder=\"auto\"` resolves to, "
                       "normal priority, one batch ahead, `host_wait=True`, one decode thread).")]
    margin = spread(d.get("rows", [])) or 0.0
    margin = max(margin, 0.05)  # below 5% a single run does not tell
    auto = d.get("auto_device_decoder") or "torchvision"  # results from before the key: torchvision was "auto"

    def top(pred: Any) -> dict[str, Any] | None:
        pick = [r for r in rows if pred(r)]
        return max(pick, key=fed) if pick else None

    def verdict(ours: dict[str, Any] | None, base: dict[str, Any] | None) -> bool:
        return ours is not None and base is not None and fed(ours) > fed(base) * (1 + margin)

    def row(dec: str, cand: str, prio: str) -> dict[str, Any] | None:
        return top(lambda r: (r["decoder"], r["candidate"], r["priority"]) == (dec, cand, prio))

    best_by = {dec: top(lambda r, dec=dec: r["decoder"] == dec) for dec in dict.fromkeys(r["decoder"] for r in rows)}
    base = best_by.get(auto)
    winner = max((r for r in best_by.values() if r), key=fed)
    change = winner["decoder"] != auto and verdict(winner, base)
    e2e = next((r for r in (t or {}).get("results", []) if r.get("variant") == "fastdata_gpu_rrc" and "error" not in r),
               None)
    out.append("- `device_decoder=\"auto\"` (fastdata/gpu/_codec.py) <- decode.json, min(stage, training) images/s "
               "beside training, best row of each decoder: "
               + ", ".join(f"{k} {n(fed(v))}" for k, v in best_by.items() if v)
               + f" (margin {margin:.0%}): " + (f"**make it {winner['decoder']}**" if change else f"keep {auto}"
                                                + ("" if base else " (what \"auto\" resolves to, not measured)"))
               + (f"; train.json's GPU-decode row with {e2e.get('decoder')} fed resnet18 at "
                  f"{pct(e2e.get('share_of_resident'))} of resident, which must confirm it" if e2e else ""))
    dec, cand, prio = winner["decoder"], winner["candidate"], winner["priority"]
    hi, lo = row(dec, cand, "high"), row(dec, cand, "normal")
    out.append(f"- `CUDAPrefetcher(stream_priority=)` with a decode stage <- decode.json, {dec} {cand}: high "
               f"{n(fed(hi)) if hi else '-'} vs normal {n(fed(lo)) if lo else '-'}: "
               + ("**make high the default there**" if verdict(hi, lo) else "keep normal"))
    two, one = row(dec, "ahead2", prio), row(dec, "ahead1", prio)
    out.append(f"- `DecodeImages.ahead(batches=)` <- decode.json, {dec} {prio} stream: two batches "
               f"{n(fed(two)) if two else '-'} vs one {n(fed(one)) if one else '-'}: "
               + ("**make 2 the default**" if verdict(two, one) else "keep 1"))
    for codec, name, arg, value in CODEC_ROWS:  # each against today's pipeline with the same decoder and stream
        at = (best_by.get(codec) or {}).get("priority", prio)
        ours, today = row(codec, name, at), row(codec, "ahead1", at)
        out.append(f"- `DecodeImages({arg}=)` with {codec} <- decode.json, {codec} {at} stream: {name} "
                   f"{n(fed(ours)) if ours else '-'} vs ahead1 {n(fed(today)) if today else '-'}: "
                   + (f"**make {arg}={value} the default with {codec}**" if verdict(ours, today)
                      else "keep the default"))
    return out


def best_args(path: Path) -> str:
    d, _ = load(path)
    b = (d or {}).get("best")
    if not b:
        return ""
    return f"--device-decoder {b['decoder']} --decode-candidate {b['candidate']} --stream-priority {b['priority']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, nargs="?")
    ap.add_argument("--best-args", type=Path, help="print part (b)'s best row as train_e2e.py options and exit")
    args = ap.parse_args(argv)
    if args.best_args is not None:
        print(best_args(args.best_args))
        return 0
    if args.dir is None:
        ap.error("DIR is required")
    d, ed = load(args.dir / "decode.json")
    t, et = load(args.dir / "train.json")
    h, eh = load(args.dir / "h2d.json")
    lines = ["## GPU check", ""]
    tests = args.dir / "pytest_cuda.txt"
    if tests.exists():
        last = [x for x in tests.read_text(errors="replace").splitlines() if x.strip()][-1:] or ["(empty)"]
        lines += [f"(a) CUDA tests: `{last[0].strip('= ')}`", ""]
    for data, err, section in ((d, ed, decode_section), (t, et, train_section), (h, eh, h2d_section)):
        lines += (section(data) if data else [err or ""]) + [""]
    lines += targets(d, t, h) + [""] + decisions(d, t)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
