#!/usr/bin/env bash
# One-command GPU validation of fastdata. Run on a CUDA machine from anywhere:
#
#   bash benchmarks/gpu_check.sh                      # every step below, in this order
#   bash benchmarks/gpu_check.sh tests prefetch       # only some steps
#
# Steps:
#   tests       every @pytest.mark.cuda test in tests/ (+ the CPU prefetcher tests on this machine)
#   sanitizer   compute-sanitizer memcheck over a CUDA test subset and a short h2d_overlap run
#   NAME        benchmarks/gpu/NAME.sh or benchmarks/gpu/NAME.py (each writes JSON under its folder):
#               probe, prefetch (h2d_overlap incl. apex, cache_throughput, train_e2e), decode_gpu,
#               decode_threads, doctor, train_demo
#
# Writes details under $OUT (or a temporary folder), one subfolder per step, plus summary.md,
# which is printed at the end, and results.tgz (everything, for machines that return few files).
# Env: STEP_TIMEOUT (seconds per benchmark step, default 300), SANITIZER_TIMEOUT (default 240).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:-$(mktemp -d -t fastdata-gpu-check.XXXXXX)}"
WORK="$DEST/work"
mkdir -p "$WORK"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(probe tests prefetch decode_gpu decode_threads doctor train_demo sanitizer)
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch; nothing to do" >&2
    exit 2
fi
nvidia-smi > "$WORK/nvidia-smi.txt" 2>&1 || true
SUMMARY="$DEST/summary.md"
{
    echo "# fastdata GPU check"
    echo
    echo "torch / CUDA / device: $("$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"), $(nproc) CPUs"
    echo
} > "$SUMMARY"
status=0

run_tests() {
    mkdir -p "$WORK/tests"
    timeout 420 "$PY" -m pytest -m cuda tests/ -q -rA -p no:cacheprovider --continue-on-collection-errors \
        --junitxml "$WORK/tests/pytest_cuda.xml" > "$WORK/tests/pytest_cuda.txt" 2>&1
    local rc=$?
    timeout 240 "$PY" -m pytest tests/test_prefetch.py -q -p no:cacheprovider > "$WORK/tests/pytest_cpu.txt" 2>&1
    local rc_cpu=$?
    {
        echo "## Tests"
        echo
        echo "- CUDA tests, all of tests/ (rc=$rc): $(tail -n 1 "$WORK/tests/pytest_cuda.txt")"
        echo "- CPU prefetcher tests on this machine (rc=$rc_cpu): $(tail -n 1 "$WORK/tests/pytest_cpu.txt")"
        grep -E "^(FAILED|ERROR)" "$WORK/tests/pytest_cuda.txt" "$WORK/tests/pytest_cpu.txt" | sed 's/^/  - /' || true
        echo
    } >> "$SUMMARY"
    [ $rc -eq 0 ] && [ $rc_cpu -eq 0 ] || status=1
}

run_named() {  # benchmarks/gpu/NAME.{sh,py} --out DIR, under a timeout; its last lines go to the summary
    local name="$1" script rc
    mkdir -p "$WORK/$name"
    if [ -f "benchmarks/gpu/$name.sh" ]; then
        script=(bash "benchmarks/gpu/$name.sh" --out "$WORK/$name")
    elif [ -f "benchmarks/gpu/$name.py" ]; then
        script=("$PY" "benchmarks/gpu/$name.py" --out "$WORK/$name")
    else
        echo "gpu_check: unknown step '$name' (tests | sanitizer | a script in benchmarks/gpu/)" >&2
        status=2
        return
    fi
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "${script[@]}" > "$WORK/$name/log.txt" 2>&1
    rc=$?
    {
        echo "## $name (rc=$rc, $((SECONDS - t0)) s; 124 = timeout)"
        echo
        echo '```'
        tail -n 40 "$WORK/$name/log.txt"
        echo '```'
        echo
    } >> "$SUMMARY"
    [ $rc -eq 0 ] || status=1
}

run_sanitizer() {
    local san
    san="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
    if [ -z "$san" ]; then
        printf '## compute-sanitizer\n\nnot available on this machine\n\n' >> "$SUMMARY"
        return
    fi
    mkdir -p "$WORK/sanitizer"
    local limit="${SANITIZER_TIMEOUT:-240}"
    # No caching allocator: every free is a real cudaFree, so memcheck sees out-of-bounds and freed memory.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" "$san" --tool memcheck --error-exitcode 9 \
        "$PY" -m pytest -m cuda tests/test_prefetch_cuda.py -q -p no:cacheprovider \
        -k "test_equals_sync_copy_with_slow_consumer and 2 or test_keep_on_host or test_errors_break" \
        > "$WORK/sanitizer/tests.txt" 2>&1
    local rc_t=$?
    timeout "$limit" "$san" --tool memcheck --error-exitcode 9 \
        "$PY" benchmarks/h2d_overlap.py --quick --steps 20 --jitter 0.1 > "$WORK/sanitizer/bench.txt" 2>&1
    local rc_b=$?
    {
        echo "## compute-sanitizer memcheck ($san)"
        echo
        echo "- CUDA tests subset: rc=$rc_t (9 = sanitizer errors, 124 = timeout) $(grep -E 'ERROR SUMMARY' "$WORK/sanitizer/tests.txt" | tail -n 1)"
        echo "- h2d_overlap --quick: rc=$rc_b $(grep -E 'ERROR SUMMARY' "$WORK/sanitizer/bench.txt" | tail -n 1)"
        echo
    } >> "$SUMMARY"
    [ $rc_t -eq 0 ] && [ $rc_b -eq 0 ] || status=1
}

for step in "${STEPS[@]}"; do
    case "$step" in
        tests) run_tests ;;
        sanitizer) run_sanitizer ;;
        *) run_named "$step" ;;
    esac
done
tar czf "$DEST/results.tgz" -C "$WORK" . 2>/dev/null || true
cat "$SUMMARY"
echo "details: $DEST (results.tgz holds every step's folder)"
exit $status
