#!/usr/bin/env bash
# GPU run for issue 10 (CUDAPrefetcher bound / apex parity / seamless epochs / cached gather).
#
#   bash benchmarks/gpu/prefetch.sh --out DIR        (from the repository root; budget ~360 s)
#
# 1. pytest: the CUDA tests of tests/test_prefetch_cuda.py (limit 75 s), plus the fake-CUDA stager
#    tests of tests/test_prefetch.py on this machine (limit 25 s)
# 2. h2d_overlap.py: 38.5 MB uint8 batches; compute 4.9 / 1.1 / 0.5 ms, without and with 8 ms loader
#    spikes (p=0.2); variants sync, pinned, one_ahead (pinned loader), one_ahead_pin (apex, pins in the
#    training thread), prefetcher (pageable), prefetcher_pinned; --pack (pack options); then
#    prefetcher with pack_threads=8 at 0.5 ms; then multi-epoch mode (4 epochs, 8 ms epoch start)
#                                                                       (limits 50 + 15 + 20 s)
# 3. train_e2e.py: resnet18 + resnet50, bf16, channels_last, batch 128, 4,096 generated JPEGs,
#    3 timed epochs: resident / tuned torch DataLoader / fastdata uncached / fastdata cached
#                                                                                  (limit 130 s)
#    (a first look before the run: DRY=1 bash benchmarks/gpu/prefetch.sh --out /tmp/x on a CPU machine)
# 4. cache_throughput.py --workers 15 (2,048 images, medians of 5 epochs: a cached one is ~50 ms) (limit 60 s)
# 5. integrity.py: spawn/forkserver early stops (aborted workers, "killed by signal") and Python 3.12's
#    multi-threaded fork warnings behind the prefetcher, 5 rounds per scenario  (the rest, <= 110 s)
# Each part has its own time limit; a failing part is reported and the next one runs.
# The device returns at most 8 files, so DIR gets exactly these: summary.txt (versions, every part's
# exit status, time and log tail, then the tables), pytest_cuda.txt, h2d_grid.json, h2d_pack8.json,
# h2d_epochs.json, train_e2e.json, cache.json, integrity.json; the other logs stay in a temporary folder.
. "$(dirname "$0")/_setup.sh" "$@"  # --out DIR -> OUT; WORK (removed on exit); PYTHONPATH
BUDGET=${BUDGET:-360}
# DRY=1: plumbing check on a CPU machine (tiny model, few images, 2 workers; CUDA tests skip)
E2E="--images 4096 --batch-size 128"; CW=15; CI=2048; IR=5
if [ "${DRY:-0}" = 1 ]; then E2E="--images 128 --batch-size 16 --models tiny"; CW=2; CI=128; IR=1; fi
. "$(dirname "$0")/_parts.sh"  # START, SUM (summary.txt), part NAME LIMIT LOG COMMAND...

part pytest_cuda 75 "$OUT/pytest_cuda.txt" \
  python3 -m pytest -m cuda tests/test_prefetch_cuda.py -q -rA -p no:cacheprovider
part pytest_cpu 25 "$WORK/pytest_cpu.txt" \
  python3 -m pytest tests/test_prefetch.py -q -p no:cacheprovider -k "fake or cuda_stager or pack or pinned_gathers"

H2D="python3 benchmarks/h2d_overlap.py --batch-mb 38.5 --warmup 8 --reps 2"
part h2d_grid 50 "$WORK/h2d_grid.txt" \
  $H2D --compute-ms 4.9 1.1 0.5 --jitter 0 0.2 --spike-ms 8 --steps 60 --pack --json "$OUT/h2d_grid.json"
part h2d_pack8 15 "$WORK/h2d_pack8.txt" \
  $H2D --compute-ms 0.5 --jitter 0 --steps 60 --variants prefetcher --pack-threads 8 --json "$OUT/h2d_pack8.json"
part h2d_epochs 20 "$WORK/h2d_epochs.txt" \
  $H2D --compute-ms 4.9 --jitter 0 --steps 80 --epochs 4 --epoch-start-ms 8 --json "$OUT/h2d_epochs.json"

part train_e2e 130 "$WORK/train_e2e.txt" \
  python3 benchmarks/train_e2e.py $E2E --epochs 3 --dir "$WORK/e2e" --json "$OUT/train_e2e.json"

part cache_throughput 60 "$WORK/cache.txt" \
  python3 benchmarks/cache_throughput.py --workers $CW --images $CI --repeats 5 --dir "$WORK/cache" --json "$OUT/cache.json"

part integrity 110 "$WORK/integrity.txt" \
  python3 benchmarks/gpu/integrity.py --out "$WORK/integrity" --rounds $IR --budget 100
cp "$WORK/integrity/integrity.json" "$OUT/integrity.json" 2>/dev/null

python3 - "$OUT" <<'EOF' >> "$SUM" 2>&1
import json, sys
from pathlib import Path
out = Path(sys.argv[1])

def load(name):
    p = out / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        print(f"{name}: not available ({e.__class__.__name__})")
        return None

for name in ("h2d_grid.json", "h2d_pack8.json", "h2d_epochs.json"):
    r = load(name)
    if not r:
        continue
    raw = r.get("raw", {})
    print(f"\n{name}: raw pinned copy {raw.get('pinned_copy_ms', 0):.2f} ms ({raw.get('pinned_gbps', 0):.1f} GB/s)")
    print(f"{'compute':>7} {'jit':>4} {'ep':>2} {'variant':<22} {'step ms':>8} {'eff':>6} {'p99 ms':>7} {'H2D/raw':>7}")
    for x in r["results"]:
        print(f"{x['compute_ms']:7.1f} {x['jitter']:4.1f} {x['epochs']:2d} {x['variant']:<22} {x['step_ms']:8.3f} "
              f"{x['efficiency']:6.3f} {x['wait_p99_ms']:7.2f} {x.get('h2d_vs_raw', 0):7.2f}")
    groups = {}
    for x in r["results"]:
        groups.setdefault((x["compute_ms"], x["jitter"], x["epochs"]), {})[x["variant"]] = x
    for cfg, g in sorted(groups.items()):
        # like for like: pageable input (prefetcher vs apex pinning in the training thread),
        # pinned input (prefetcher_pinned vs one_ahead over the pinned loader)
        for ours, theirs in (("prefetcher", "one_ahead_pin"), ("prefetcher_pinned", "one_ahead")):
            if ours in g and theirs in g:
                a, b = g[ours]["step_ms"], g[theirs]["step_ms"]
                eff = g[ours]["efficiency"]
                print(f"  compute {cfg[0]} jitter {cfg[1]} epochs {cfg[2]}: {ours} {a:.3f} vs {theirs} {b:.3f} ms "
                      f"-> {'OK' if a <= b * 1.005 else 'SLOWER'}; efficiency {eff:.3f}")
    for p in r.get("pack", []):
        print(f"  pack: {p['option']:<58} " + (f"{p['gbps']:6.1f} GB/s" if "gbps" in p else p.get("error", "")))
r = load("train_e2e.json")
if r:
    print(f"\ntrain_e2e on {r.get('device_name')}: images/s, share of resident, GPU util, wait p99")
    for x in r["results"]:
        if "error" in x:
            print(f"  {x['model']:<9} {x['variant']:<18} ERROR {x['error']}")
            continue
        util = f"{x['gpu_util_pct']:.0f}%" if x.get("gpu_util_pct") is not None else "n/a"
        print(f"  {x['model']:<9} {x['variant']:<18} {x['images_per_s']:8.0f} {x.get('share_of_resident', 0):6.0%} "
              f"{util:>5} {x['wait_p99_ms']:8.2f} ms  {x.get('paths', '')}")
r = load("cache.json")
if r:
    print("\ncache_throughput (--workers 15):")
    for k in ("uncached_samples_per_s", "cached_samples_per_s", "cached_workers_samples_per_s", "cached_over_uncached",
              "cached_workers_over_uncached", "gather_read_samples_per_s", "cached_gather_threads"):
        if k in r:
            print(f"  {k:<32} {r[k]:.1f}" if isinstance(r[k], float) else f"  {k:<32} {r[k]}")
EOF
echo "== total $((SECONDS - START)) s" >> "$SUM"
cat "$SUM"
