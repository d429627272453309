#!/usr/bin/env bash
# GPU run of `fastdata demo` and the TrainStep CUDA tests (issue 11). Budget ~120 s.
#
#   bash benchmarks/gpu/train_demo.sh --out DIR        (from the repository root)
#
# 1. the CUDA tests of tests/train/ (no host sync in a training step, fp16 scaler, evaluate
#    on CUDA == CPU): python3 -m pytest -q -m cuda tests/train/
# 2. `fastdata demo --json` as a user runs it (1,024 images, batch 64, default workers, resnet18 when
#    torchvision imports): the before/after table with GPU utilisation, and the GPU decode row;
# 3. `fastdata demo` on 2 CPU cores of this idle machine, GPU hidden (CUDA_VISIBLE_DEVICES= taskset -c 0,1):
#    the "under 2 minutes on 2 CPU cores" check without the development box's other jobs (it gets
#    what is left of the budget: rc=124 in the table means it did not finish in that time);
# 4. the GPU demo with 4,096 images and batch 128 (longer measured epochs), if the budget allows;
# 5. benchmarks/plot.py over the demo JSONs (PNG charts), if matplotlib imports and time is left.
# Each part has its own time limit; a failing part is reported and the next one runs. Prints a
# short table at the end; everything is under DIR (tests.txt, demo.txt/json, demo_cpu2.txt/json,
# demo_4096.txt/json, plots/).
# DRY=1: a plumbing check on a CPU machine (small demo, CUDA tests skip).
. "$(dirname "$0")/_setup.sh" "$@"  # --out DIR -> OUT; WORK (removed on exit); PYTHONPATH
PY="${PYTHON:-python3}"
SMALL=(--images 1024 --batch-size 64)
BIG=(--images 4096 --batch-size 128)
if [ "${DRY:-0}" = 1 ]; then SMALL=(--images 128 --batch-size 32 --epochs 2); BIG=(--images 192 --batch-size 32 --epochs 2); fi
declare -A STATUS
T0=$SECONDS

part() {  # part NAME SECONDS LOGFILE COMMAND...
  local name="$1" limit="$2" log="$3"; shift 3
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  [ $rc -eq 0 ] || { echo "== $name failed (rc=$rc; 124 = timeout), last lines of $log:" >&2; tail -n 5 "$log" >&2; }
}

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
           torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" > "$OUT/env.txt" 2>&1
part tests 20 "$OUT/tests.txt" "$PY" -m pytest -q -rA -m cuda -p no:cacheprovider tests/train/
part demo 50 "$OUT/demo.txt" "$PY" -m fastdata demo "${SMALL[@]}" --json "$OUT/demo.json"
left=$((112 - (SECONDS - T0)))
if ! command -v taskset > /dev/null; then
  STATUS[demo_cpu2]="skipped (no taskset)"
elif [ "$left" -lt 30 ]; then
  STATUS[demo_cpu2]="skipped (${left}s left)"
else
  # the demo prints its own total; the part's seconds include the imports
  part demo_cpu2 "$left" "$OUT/demo_cpu2.txt" env CUDA_VISIBLE_DEVICES= taskset -c 0,1 \
    "$PY" -m fastdata demo --json "$OUT/demo_cpu2.json" $([ "${DRY:-0}" = 1 ] && echo --images 128 --epochs 2)
fi
left=$((115 - (SECONDS - T0)))
if [ "$left" -ge 30 ]; then
  part demo_4096 $((left - 8)) "$OUT/demo_4096.txt" "$PY" -m fastdata demo "${BIG[@]}" --json "$OUT/demo_4096.json"
else
  STATUS[demo_4096]="skipped (${left}s left)"
fi
left=$((118 - (SECONDS - T0)))
if [ "$left" -lt 6 ]; then
  STATUS[plots]="skipped (${left}s left)"
elif "$PY" -c "import matplotlib" 2>/dev/null; then
  gpu_json=("$OUT/demo.json"); [ -f "$OUT/demo_4096.json" ] && gpu_json+=("$OUT/demo_4096.json")
  part plots "$left" "$OUT/plots.txt" "$PY" benchmarks/plot.py --out "$OUT/plots" "${gpu_json[@]}"
else
  STATUS[plots]="skipped (no matplotlib)"
fi

echo
cat "$OUT/env.txt"
echo "--- CUDA tests (tests/train/ -m cuda): $(tail -n 1 "$OUT/tests.txt")"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/tests.txt" | sed 's/^/    /'
for f in demo demo_cpu2 demo_4096; do
  [ -f "$OUT/$f.txt" ] || continue
  echo "--- fastdata demo ($f):"
  sed -n '/^\[3\/4\]/,$p' "$OUT/$f.txt"
done
echo "--- parts"
for name in tests demo demo_cpu2 demo_4096 plots; do printf '%-10s %s\n' "$name" "${STATUS[$name]:-not run}"; done
echo "total $((SECONDS - T0))s; details in $OUT"
