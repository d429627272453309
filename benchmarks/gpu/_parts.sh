# Shared by final.sh and decode_final.sh; source it after _setup.sh with BUDGET set:
#   . "$(dirname "$0")/_parts.sh"
# Starts the clock (START), begins OUT/summary.txt (SUM) with the GPU, torch, CUDA and Python versions, and
# defines `part NAME LIMIT LOG COMMAND...`: runs COMMAND with its output in LOG under a time limit of LIMIT
# seconds, cut to what is left of BUDGET (skipped when under 6 s), and appends its exit status, time and
# log tail to SUM. A failing part never stops the script.
START=$SECONDS
SUM="$OUT/summary.txt"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys, os; print(torch.__version__, torch.version.cuda, sys.version.split()[0], len(os.sched_getaffinity(0)), 'cpus')"
} > "$SUM" 2>&1

part() {  # part NAME LIMIT LOG COMMAND...
  local name="$1" limit="$2" log="$3"; shift 3
  local left=$((BUDGET - 5 - (SECONDS - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name: skipped (budget)" >> "$SUM"; return; fi
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  { echo "== $name: rc=$rc, $((SECONDS - t0)) s (limit $limit s; 124 = timeout)"; tail -n 25 "$log"; } >> "$SUM"
}

# nvimgcodec_site WHEELS: when WHEELS holds wheels (nvidia-nvimgcodec-cu13, nvidia-nvjpeg; see
# nvimgcodec_probe.py), installs them into WORK/nvimgcodec (no index, no dependencies), checks that
# nvImageCodec imports from there (libnvjpeg is found through the extension's RUNPATH) and sets
# NVIMGCODEC_SITE to that folder, for PYTHONPATH; returns 1 without wheels or when that fails (said in SUM).
nvimgcodec_site() {
  local wheels="$1" site="$WORK/nvimgcodec"
  ls "$wheels"/*.whl > /dev/null 2>&1 || return 1
  if PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-deps --no-index --target "$site" "$wheels"/*.whl >> "$SUM" 2>&1 &&
     PYTHONPATH="$PYTHONPATH:$site" python3 -c "from nvidia import nvimgcodec as nv; print('nvImageCodec', nv.__version__)" >> "$SUM" 2>/dev/null; then
    NVIMGCODEC_SITE=$site
    return 0
  fi
  echo "== nvimgcodec: the wheels in $wheels did not install or import; its parts are skipped" >> "$SUM"
  return 1
}
