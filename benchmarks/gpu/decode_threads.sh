#!/usr/bin/env bash
# GPU-machine run for DataLoader(decode_threads=N) (issue 9 item 4), about 150 s in all:
#
#   bash benchmarks/gpu/decode_threads.sh --out DIR
#
# 1. benchmarks/decode_stage.py at 4, 8 and 15 cores (rows pinned to that many cores): worker
#    processes with Pillow, the thread decoder, GPU decode (decode-gpu's fastdata.gpu stage in
#    CUDAPrefetcher, min(N, 4) workers reading bytes; gpu-threads: the same bytes read by min(N, 4)
#    decode_threads instead) and torchvision's usual CPU recipe; images/s
#    and CPU ms per image, medians of interleaved epochs -> DIR/decode_stage.json. First, one
#    thread's time per sample and the share of it spent holding the GIL (upper bound; its inverse
#    bounds the thread decoder's speed-up over one core) -> "gil" in the same JSON.
# 2. Pinned batch buffers: steady-state cost of a fresh torch.empty(pin_memory=True) per batch
#    (what the thread decoder does with pin_memory=True) against reusing one -> DIR/pinned_alloc.json.
# 3. The CUDA test of tests/loader/test_thread_decoder.py (pinned batches through CUDAPrefetcher).
# Each part runs under its own timeout; a failing part is reported and the others still run.
# Needs numpy, pillow, torch (+ torchvision for the peer row); no webdataset, no network.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        *) echo "usage: $0 --out DIR" >&2; exit 2 ;;
    esac
done
[ -n "$OUT" ] || OUT="$(mktemp -d -t decode-threads.XXXXXX)"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
T0=$SECONDS

echo "== decode_stage.py --workers 4 8 15 (budget 115 s)"
timeout 135 "$PY" benchmarks/decode_stage.py --workers 4 8 15 --images 2048 --reps 3 --budget 115 --gil \
    --data "$OUT/data" --json "$OUT/decode_stage.json" > "$OUT/decode_stage.txt" 2>&1
echo "rc=$? ($((SECONDS - T0)) s)"
tail -n 16 "$OUT/decode_stage.txt"
rm -rf "$OUT/data"

echo "== pinned batch buffers"
timeout 30 "$PY" - "$OUT/pinned_alloc.json" > "$OUT/pinned_alloc.txt" 2>&1 <<'EOF'
import json, statistics, sys, time
import torch

out = {}
for rows in (64, 256):
    shape = (rows, 3, 224, 224)
    src = torch.randint(0, 255, shape, dtype=torch.uint8)
    dev = torch.empty(shape, dtype=torch.uint8, device="cuda")
    res = {}
    for name in ("fresh", "reuse", "fresh", "reuse"):
        ring = [torch.empty(shape, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
        held, ts = [], []
        for i in range(40):
            t = time.perf_counter()
            b = torch.empty(shape, dtype=torch.uint8, pin_memory=True) if name == "fresh" else ring[i % 3]
            b.copy_(src)  # the pool threads' writes
            dev.copy_(b, non_blocking=True)  # the consumer's H2D copy
            ts.append(time.perf_counter() - t)
            held = (held + [b])[-2:]  # the consumer holds the last two batches
        torch.cuda.synchronize()
        res.setdefault(name, []).append(statistics.median(ts[5:]) * 1e3)
    out[f"batch{rows}"] = {k: min(v) for k, v in res.items()}
    print(f"pinned batch of {rows}: fresh {out[f'batch{rows}']['fresh']:.2f} ms, reused {out[f'batch{rows}']['reuse']:.2f} ms "
          "(fill + non_blocking H2D enqueue, median)")
json.dump(out, open(sys.argv[1], "w"), indent=1)
EOF
echo "rc=$?"
cat "$OUT/pinned_alloc.txt"

echo "== CUDA test of tests/loader/test_thread_decoder.py"
timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/loader/test_thread_decoder.py > "$OUT/pytest_cuda.txt" 2>&1
echo "rc=$? $(tail -n 1 "$OUT/pytest_cuda.txt")"
echo "done in $((SECONDS - T0)) s; details in $OUT"
