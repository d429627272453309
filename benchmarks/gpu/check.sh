#!/usr/bin/env bash
# The whole GPU check of fastdata in one device call: at most 540 s on one H200 (BUDGET=... to change).
#
# The device call (the `run` tool), ready to paste:
#   command:   bash benchmarks/gpu/check.sh --out $OUT
#   carry:     [".whl"]
#   timeout_s: 600
# Once, here, before it: the wheels of benchmarks/gpu/wheels.txt into the ignored folder .whl/ (37 MB):
#   rm -rf .whl && sed 's/#.*//' benchmarks/gpu/wheels.txt | xargs python3 -m pip download --no-deps \
#     --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl
# First, on a CPU machine: DRY=1 bash benchmarks/gpu/check.sh --out /tmp/dry (every part on tiny sizes on
# the CPU, a few minutes; it exits 0 when every part did; PYTHON=... names an interpreter with torch).
#
# Parts, most important first, each under its own time limit (cut to what is left of BUDGET); a part cut
# at its limit or failing is reported and the next one still runs:
#   a. pytest -m cuda tests/: every CUDA test, the stream-order hazard tests included    (limit 140 s)
#   b. decode_contention.py: the decode stage alone and beside resnet18 bf16 training, each available
#      decoder x each row of candidates.py that applies to it x normal/high stream priority (limit 175 s)
#   c. train_e2e.py --augment random: resnet18, RandomResizedCrop(224) + flip, bf16 channels_last,
#      4,096 JPEGs, batch 128, 15 workers: resident batches / torchvision's CPU recipe / fastdata GPU
#      decode with part (b)'s best row / fastdata cached (224 px centre crops)           (limit 130 s)
#   d. h2d_overlap.py: CUDAPrefetcher vs apex's one-ahead loop at 4.9, 1.1 and 0.5 ms of compute,
#      38.5 MB batches from pinned and from pageable memory                               (limit 45 s)
#   a2. compute-sanitizer memcheck over the prefetcher and decode CUDA tests, less the stream-order
#       hazard loops (test_no_corruption_*: without the caching allocator no block is reused, so they
#       would test nothing there, slowly)                                                 (what is left)
# Expected on an H200, from the H100 run (benchmarks/results/h100/summary.txt: 28 CUDA tests 28 s, h2d
# 32 s for twice this grid, train_e2e 35 s for two models) and 7 s per row of part (b) (17 rows: 4
# candidates, two of them for one decoder each, plus a repeat): b 135 s, c 55 s, d 20 s; a 60-110 s is
# extrapolated, not measured (55 CUDA tests now, about 35 s of them GPU sleeps in the hazard loops of
# tests/gpu/test_stream_order_guard.py). That leaves a2 about 200 s; the limits total 490 s, so a2 has
# at least 35 s whatever happens.
# Files under DIR (7; the device returns 8): summary.txt (versions, every part's status, time and log
# tail, then report.md), pytest_cuda.txt, sanitizer.txt (its last 300 lines), decode.json (b),
# train.json (c), h2d.json (d), report.md (benchmarks/gpu/report.py: the tables for the results page,
# the targets, and which figure decides which `auto` default). Commit the JSON files (and
# summary.txt) under benchmarks/results/h200/.
[ -f benchmarks/gpu/check.sh ] || { echo "check.sh: run it from the repository root" >&2; exit 2; }
. "$(dirname "$0")/_setup.sh" "$@"  # --out DIR -> OUT; WORK (removed on exit); PYTHONPATH; unbuffered Python
BUDGET=${BUDGET:-540}
RESERVE=15  # seconds kept for the report at the end
PY=${PYTHON:-python3}
DRY=${DRY:-0}
G=benchmarks/gpu
if [ "$DRY" = 1 ]; then  # a check of the plumbing on a CPU machine: tiny sizes, CUDA tests skip
  DC=(--images 32 --batch 8 --size 32 --seconds 0.3 --model tiny --train-batch 8 --budget 100)  # every row: 17 x ~3.75 s
  E2E=(--models tiny --images 96 --batch-size 16 --size 64 --warmup 1 --epochs 1 --workers 2)
  H2D=(--batch-mb 2 --warmup 2 --steps 20 --reps 1)
else
  DC=(--images 1024 --batch 256 --size 224 --seconds 1.5 --model resnet18 --train-batch 128 --budget 165)
  E2E=(--models resnet18 --images 4096 --batch-size 128 --warmup 2 --epochs 4 --workers 15)
  H2D=(--batch-mb 38.5 --warmup 8 --steps 60 --reps 3)
fi
START=$SECONDS
SUM="$OUT/summary.txt"
FAILED=0

part() {  # part NAME LIMIT LOG COMMAND...: COMMAND under a time limit, its status and log tail into SUM
  local name="$1" limit="$2" log="$3"; shift 3
  local left=$((BUDGET - RESERVE - (SECONDS - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name: SKIPPED (${left} s of the budget left)" >> "$SUM"; FAILED=1; return; fi
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  local rc=$? how
  case $rc in
    0) how="ok" ;;
    124|137) how="CUT at its limit (rc=$rc)"; FAILED=1 ;;
    *) how="FAILED (rc=$rc)"; FAILED=1 ;;
  esac
  { echo "== $name: $how, $((SECONDS - t0)) s (limit $limit s)"; tail -n 25 "$log"; echo; } >> "$SUM"
}

{ echo "fastdata GPU check$([ "$DRY" = 1 ] && echo ' (DRY=1: plumbing on the CPU)'), $(date -u +%Y-%m-%dT%H:%MZ)"
  if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader 2>&1 | head -n 2; else echo "no nvidia-smi"; fi
  echo "fastdata tree: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') sha256 of fastdata/*.py:" \
    "$(find fastdata -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"
} > "$SUM"
WHEELS=${WHEELS:-.whl}  # the carried wheels (benchmarks/gpu/wheels.txt)
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then  # installed as the device README says
  SITE=/tmp/site FOR=()
  if [ "$DRY" = 1 ]; then  # DRY: install them as for the device's Python and platform, to check them; import none
    SITE="$WORK/site" FOR=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  fi
  if PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" ${FOR[@]+"${FOR[@]}"} "$WHEELS"/*.whl >> "$SUM" 2>&1; then
    echo "wheels: $(ls "$WHEELS" | grep '\.whl$' | tr '\n' ' ')installed into $SITE" >> "$SUM"
    [ "$DRY" = 1 ] || export PYTHONPATH="$PYTHONPATH:$SITE"  # after the repository
  else
    echo "wheels: pip install FAILED; parts run without them" >> "$SUM"; FAILED=1
  fi
else
  echo "wheels: none in $WHEELS/ (TorchCodec and nvImageCodec rows are skipped)" >> "$SUM"
fi
"$PY" - >> "$SUM" 2>&1 <<'EOF'
import os, sys, torch
from importlib import metadata
def v(p):
    try:
        return metadata.version(p)
    except metadata.PackageNotFoundError:
        return "-"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{len(os.sched_getaffinity(0))} cpus, " + ", ".join(f"{p} {v(p)}" for p in (
          "torchvision", "torchcodec", "nvidia-nvimgcodec-cu13", "nvidia-nvjpeg", "braceexpand", "webdataset")))
EOF
echo >> "$SUM"

part a_cuda_tests 140 "$OUT/pytest_cuda.txt" \
  "$PY" -m pytest -m cuda tests/ -q -rfEs -p no:cacheprovider --continue-on-collection-errors
part b_decode 175 "$WORK/decode.txt" "$PY" $G/decode_contention.py "${DC[@]}" --json "$OUT/decode.json"
BEST=$("$PY" $G/report.py --best-args "$OUT/decode.json" 2>/dev/null)  # part (b)'s best row, if any
echo "== part (c) GPU decode row: ${BEST:-defaults (no best row from part b)}" >> "$SUM"
part c_train 130 "$WORK/train.txt" "$PY" benchmarks/train_e2e.py --augment random \
  --variants resident torch_recipe_rrc fastdata_gpu_rrc fastdata_cached "${E2E[@]}" $BEST \
  --dir "$WORK/e2e" --json "$OUT/train.json"
part d_h2d 45 "$WORK/h2d.txt" "$PY" benchmarks/h2d_overlap.py "${H2D[@]}" --compute-ms 4.9 1.1 0.5 --jitter 0 \
  --variants one_ahead one_ahead_pin prefetcher prefetcher_pinned --json "$OUT/h2d.json"
# a2: no caching allocator, so every free is a real cudaFree and memcheck sees freed memory too
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
SELECT=(-m cuda tests/ -k "(prefetch or decode) and not corruption" -v -p no:cacheprovider --timeout 120)
if [ -n "$SAN" ]; then
  part a2_sanitizer $BUDGET "$WORK/sanitizer.txt" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SAN" --tool memcheck --error-exitcode 9 "$PY" -m pytest "${SELECT[@]}"
elif [ "$DRY" = 1 ]; then  # no sanitizer here: the same selection without it, to check it
  part a2_sanitizer 60 "$WORK/sanitizer.txt" "$PY" -m pytest "${SELECT[@]}"
else
  echo "== a2_sanitizer: skipped (no compute-sanitizer on this machine)" > "$WORK/sanitizer.txt"
  cat "$WORK/sanitizer.txt" >> "$SUM"
fi
tail -n 300 "$WORK/sanitizer.txt" > "$OUT/sanitizer.txt" 2>/dev/null

"$PY" $G/report.py "$OUT" > "$OUT/report.md" 2>&1 || FAILED=1
{ echo "== total $((SECONDS - START)) s of $BUDGET"; echo; cat "$OUT/report.md"; } >> "$SUM"
cat "$SUM"
exit $FAILED
