#!/usr/bin/env bash
# One-shot GPU validation of CUDAPrefetcher (issue 5). Run on a CUDA machine from anywhere:
#
#   bash benchmarks/gpu_check.sh                 # tests + benchmark + compute-sanitizer
#   bash benchmarks/gpu_check.sh tests bench     # only some steps (tests | bench | sanitizer)
#
# Writes details under $OUT (or a temporary folder): pytest logs and junit XML, the benchmark JSON
# and log, sanitizer logs, nvidia-smi, and summary.md, which is also printed at the end.
# Env: BENCH_ARGS (extra h2d_overlap.py arguments), SANITIZER_TIMEOUT (seconds, default 480).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:-$(mktemp -d -t fastdata-gpu-check.XXXXXX)}"
mkdir -p "$DEST"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests bench sanitizer)
PY="${PYTHON:-python3}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch; nothing to do" >&2
    exit 2
fi
nvidia-smi > "$DEST/nvidia-smi.txt" 2>&1 || true
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" > "$DEST/torch.txt"
SUMMARY="$DEST/summary.md"
{
    echo "# CUDAPrefetcher GPU check"
    echo
    echo "torch / CUDA / device: $(cat "$DEST/torch.txt")"
    echo
} > "$SUMMARY"
status=0

run_tests() {
    "$PY" -m pytest -m cuda tests/test_prefetch_cuda.py -q -rA -p no:cacheprovider \
        --junitxml "$DEST/pytest_cuda.xml" > "$DEST/pytest_cuda.txt" 2>&1
    local rc=$?
    # the CPU tests must also pass on a GPU machine (they include the fake-CUDA stager test)
    "$PY" -m pytest tests/test_prefetch.py -q -p no:cacheprovider > "$DEST/pytest_cpu.txt" 2>&1
    local rc_cpu=$?
    {
        echo "## Tests"
        echo
        echo "- CUDA tests (rc=$rc): $(tail -n 1 "$DEST/pytest_cuda.txt")"
        echo "- CPU tests on this machine (rc=$rc_cpu): $(tail -n 1 "$DEST/pytest_cpu.txt")"
        grep -E "^(FAILED|ERROR)" "$DEST/pytest_cuda.txt" "$DEST/pytest_cpu.txt" | sed 's/^/  - /' || true
        echo
    } >> "$SUMMARY"
    [ $rc -eq 0 ] && [ $rc_cpu -eq 0 ] || status=1
}

run_bench() {
    # shellcheck disable=SC2086
    "$PY" benchmarks/h2d_overlap.py --json "$DEST/h2d_overlap.json" ${BENCH_ARGS:-} > "$DEST/h2d_overlap.txt" 2>&1
    local rc=$?
    {
        echo "## h2d_overlap.py (rc=$rc)"
        echo
        echo '```'
        cat "$DEST/h2d_overlap.txt"
        echo '```'
        echo
    } >> "$SUMMARY"
    if [ $rc -eq 0 ]; then
        "$PY" - "$DEST/h2d_overlap.json" >> "$SUMMARY" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
rows = r["results"]
print("Targets (issue 5): prefetcher efficiency >= 0.95, H2D >= 90% of raw pinned, fastest with jitter.\n")
for cfg in sorted({(x["compute_ms"], x["jitter"]) for x in rows}):
    group = [x for x in rows if (x["compute_ms"], x["jitter"]) == cfg]
    best = min(group, key=lambda x: x["step_ms"])
    pf = next(x for x in group if x["variant"] == "prefetcher")
    ok = pf["efficiency"] >= 0.95 and pf.get("h2d_vs_raw", 1) >= 0.9
    print(f"- compute {cfg[0]} ms, jitter {cfg[1]}: fastest = {best['variant']}; prefetcher efficiency "
          f"{pf['efficiency']:.3f}, H2D {pf.get('h2d_gbps', 0):.1f} GB/s = {pf.get('h2d_vs_raw', 0):.0%} of raw "
          f"-> {'meets' if ok else 'MISSES'} targets")
print()
PYEOF
    fi
    [ $rc -eq 0 ] || status=1
}

run_sanitizer() {
    local san
    san="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
    if [ -z "$san" ]; then
        printf '## compute-sanitizer\n\nnot available on this machine\n\n' >> "$SUMMARY"
        return
    fi
    local limit="${SANITIZER_TIMEOUT:-480}"
    # No caching allocator: every free is a real cudaFree, so memcheck sees out-of-bounds and freed memory.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" "$san" --tool memcheck --error-exitcode 9 \
        "$PY" -m pytest -m cuda tests/test_prefetch_cuda.py -q -p no:cacheprovider \
        -k "test_equals_sync_copy_with_slow_consumer and 2 or test_keep_on_host or test_errors_break" \
        > "$DEST/sanitizer_tests.txt" 2>&1
    local rc_t=$?
    timeout "$limit" "$san" --tool memcheck --error-exitcode 9 \
        "$PY" benchmarks/h2d_overlap.py --quick --steps 20 --jitter 0.1 > "$DEST/sanitizer_bench.txt" 2>&1
    local rc_b=$?
    {
        echo "## compute-sanitizer memcheck ($san)"
        echo
        echo "- CUDA tests subset: rc=$rc_t (9 = sanitizer errors, 124 = timeout) $(grep -E 'ERROR SUMMARY' "$DEST/sanitizer_tests.txt" | tail -n 1)"
        echo "- h2d_overlap --quick: rc=$rc_b $(grep -E 'ERROR SUMMARY' "$DEST/sanitizer_bench.txt" | tail -n 1)"
        echo
    } >> "$SUMMARY"
    [ $rc_t -eq 0 ] && [ $rc_b -eq 0 ] || status=1
}

for step in "${STEPS[@]}"; do
    case "$step" in
        tests) run_tests ;;
        bench) run_bench ;;
        sanitizer) run_sanitizer ;;
        *) echo "gpu_check: unknown step '$step' (tests | bench | sanitizer)" >&2; exit 2 ;;
    esac
done
cat "$SUMMARY"
echo "details: $DEST"
exit $status
