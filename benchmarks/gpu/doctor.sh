#!/usr/bin/env bash
# GPU run of `fastdata doctor` and `fastdata tune` (issue 11) and the NVML device check (issue 10 item 5).
#
#   bash benchmarks/gpu/doctor.sh --out DIR        (from the repository root; budget ~120 s)
#
# 1. generates 1,024 photo-like JPEGs (300-640 px, in a process pool) and shards them;
# 2. `fastdata doctor SHARDS --model resnet18` (8 workers, batch 128): stage table + JSON, including the
#    input side with device decode (image_decode="device" + fastdata.gpu.DecodeImages) against CPU decode;
# 3. `fastdata tune SHARDS --model resnet18` from the CLI's default configuration (2 workers, depth 2,
#    batch 32, pil), batch-size search up to 256, device decode as a candidate, on 768 samples: text + JSON;
# 4. GPUSampler over a 2 s matmul loop and StallMeter(sample_gpu=True) over a short loop: how NVML
#    found the device (uuid/pci) and how many samples a window gets.
# The CUDA test to run besides (needs pytest): python3 -m pytest -q -m cuda tests/monitor/
# Each part has its own time limit; a failing part is reported and the next one runs.
# Prints a short table at the end; everything is under DIR (doctor.txt/json, tune.txt/json, nvml.json).
. "$(dirname "$0")/_setup.sh" "$@"  # --out DIR -> OUT; WORK (removed on exit); PYTHONPATH
# DRY=1: a plumbing check on a CPU machine (synthetic 5 ms step instead of resnet18, fewer images)
STEP="--model resnet18"; N=1024; SLOW=1
if [ "${DRY:-0}" = 1 ]; then STEP="--step-ms 5"; N=256; SLOW=4; fi  # DRY: a busy 2-core box needs more time
export N
declare -A STATUS

part() {  # part NAME SECONDS COMMAND...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  timeout --kill-after=5 "$((limit * SLOW))" "$@"
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  [ $rc -eq 0 ] || echo "== $name failed (rc=$rc) ==" >&2
}

part data 20 python3 - "$WORK" <<'EOF'
import sys, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
import numpy as np
from fastdata.cli._synth import jpeg_bytes, synth_image

root = Path(sys.argv[1]) / "img"
N = int(__import__("os").environ["N"])

def one(i):
    rng = np.random.default_rng([0, i])
    w, h = (int(v) for v in rng.integers(300, 641, size=2))
    path = root / f"class_{i % 10:02d}" / f"img_{i:06d}.jpg"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(jpeg_bytes(synth_image(rng, w, h, i % 10), int(rng.integers(75, 96))))

t0 = time.time()
with ProcessPoolExecutor() as pool:
    list(pool.map(one, range(N), chunksize=32))
from fastdata.shards.convert import ConvertOptions, convert
convert(root, Path(sys.argv[1]) / "shards", ConvertOptions(samples_per_shard=128, workers=8, overwrite=True, progress=False))
print(f"data: {N} JPEGs + shards in {time.time() - t0:.1f} s")
EOF

SHARDS="$WORK/shards"
part doctor 35 bash -c "python3 -m fastdata doctor '$SHARDS' $STEP --workers 8 --batch-size 128 \
  --samples $N --steps 20 --out '$OUT/doctor.json' | tee '$OUT/doctor.txt'; exit \${PIPESTATUS[0]}"

part tune 55 bash -c "python3 -m fastdata tune '$SHARDS' $STEP --max-batch 256 --samples $((N * 3 / 4)) --steps 8 \
  --out '$OUT/tune.json' | tee '$OUT/tune.txt'; exit \${PIPESTATUS[0]}"

part nvml 10 python3 - "$OUT" <<'EOF'
import json, sys, time, torch
from fastdata.monitor import GPUSampler, StallMeter
out = {}
try:
    s = GPUSampler(torch.cuda.current_device(), 0.05)
    x = torch.randn(4096, 4096, device="cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        x = (x @ x) / 64.0
    torch.cuda.synchronize()
    samples = s.stop()
    out.update(found_by=s.found_by, samples=len(samples), mean=sum(samples) / max(len(samples), 1),
               error=repr(s.error) if s.error else None, buffered=s._buffered)
    meter = StallMeter(sample_gpu=True)
    for _ in meter.wrap(range(20)):
        x = (x @ x) / 64.0
        torch.cuda.synchronize()
    rep = meter.report()
    out.update(short_window_s=rep.wall_s, short_window_samples=rep.gpu_util_samples, short_window_mean=rep.gpu_util_mean)
except Exception as e:
    out["error"] = repr(e)
print(json.dumps(out))
json.dump(out, open(sys.argv[1] + "/nvml.json", "w"), indent=1)
EOF

echo
echo "== benchmarks/gpu/doctor.sh summary =="
for k in data doctor tune nvml; do printf '%-12s %s\n' "$k" "${STATUS[$k]:-not run}"; done
python3 - "$OUT" <<'EOF'
import json, sys, os
o = sys.argv[1]
try:
    d = json.load(open(os.path.join(o, "doctor.json")))["diagnosis"]
    print(f"doctor: {d['verdict']}, bound by {d['bound']}, job {d['job_rate'] or 0:.0f} img/s, step alone {d['step_rate'] or 0:.0f} img/s")
except Exception as e:
    print("doctor: no result", repr(e))
try:
    t = json.load(open(os.path.join(o, "tune.json")))
    print(f"tune: {t['start_rate']:.0f} -> {t['best_rate']:.0f} img/s ({t['speedup']:.2f}x), best {t['best']['num_workers']} workers, depth {t['best']['depth']}, batch {t['best']['batch_size']}")
except Exception as e:
    print("tune: no result", repr(e))
try:
    n = json.load(open(os.path.join(o, "nvml.json")))
    print(f"nvml: {n}")
except Exception as e:
    print("nvml: no result", repr(e))
EOF
