#!/usr/bin/env bash
# The one-shot GPU validation inside one device call (issues 9, 10, 11):
#
#   bash benchmarks/gpu/final.sh --out DIR          (from the repository root; budget ~590 s, BUDGET=... to change)
#
# 1. every @pytest.mark.cuda test in tests/                                   (limit 100 s)
# 2. h2d_overlap.py: 38.5 MB pageable batches, compute 4.9 / 1.1 / 0.5 ms, without and with 8 ms loader
#    spikes; sync, one_ahead, one_ahead_pin (apex) and the prefetcher          (limit 45 s)
# 3. train_e2e.py: resnet18 and resnet50, bf16, channels_last, batch 128, 2,048 generated JPEGs, 2 warm-up
#    epochs (the cached pipeline's fill and memo epochs) and 8 timed ones (resnet18 cached: ~2 s, a dozen
#    NVML samples; at 3 epochs the H100 run's resident row had 2 samples and read 89.5%):
#    resident / tuned torch DataLoader / fastdata uncached / fastdata cached   (limit 200 s)
# 4. decode_stage.py at 8 and 15 cores: worker processes, thread decoder, GPU decode, torchvision recipe,
#    3 timed epochs per row (medians; each N's child needs ~20 s on 16 cores)   (limit 100 s)
# 5. epoch_start.py: 15 persistent workers, batch 128, 224 px from 400 px JPEGs, CUDAPrefetcher: epoch-start
#    waits with and without the next-epoch preload                            (limit 90 s)
# 6. producer_overhead.py: GIL-held Python per batch on the cached path, epoch plan (CPU only) (limit 60 s)
# 7. fastdata doctor on the e2e shards with --model resnet18                  (the rest)
# Opt-in, only when the device call carries a wheels/ folder (gitignored; WHEELS=... to change) holding
# nvImageCodec's wheels (nvidia-nvimgcodec-cu13, nvidia-nvjpeg; see benchmarks/gpu/nvimgcodec_probe.py):
#    they are installed into WORK (pip --no-deps --no-index --target; its nvidia/ package then comes first
#    on PYTHONPATH; libnvjpeg is found through the extension's RUNPATH, no preload) before part 1, so the
#    nvImageCodec CUDA tests run in part 1 too, and after part 4 come
# 4a. decode_stage.py, gpu row at 8 cores, --device-decoder nvimgcodec (same corpus as part 4)  (limit 35 s)
# 4b. nvimgcodec_probe.py: torchvision vs nvImageCodec (raw, fastdata's glue; normal/high-priority stream),
#     alone and beside resnet18 training                                     (limit 70 s)
#    The parts after them then get 105 s less (the budget shortens or skips the last ones).
#    Without the folder nothing changes. "auto" stays torchvision in every other part.
# A first look before the run, on a CPU machine: DRY=1 bash benchmarks/gpu/final.sh --out /tmp/x
# Writes few files (the device returns at most 8): summary.txt, pytest_cuda.txt, h2d.json, e2e.json,
# decode_stage.json, epoch_start.json, producer.json, doctor.txt; each part's log tail goes into summary.txt.
# With wheels/ also decode_stage_nvimgcodec.json and nvimgcodec_probe.json (10 files: the device returns 8,
# so then look for epoch_start.json/producer.json in the summary's log tails).
. "$(dirname "$0")/_setup.sh" "$@"  # --out DIR -> OUT; WORK (removed on exit); PYTHONPATH
BUDGET=${BUDGET:-590}
# DRY=1: plumbing check on a CPU machine (tiny model, few images, 2 workers; CUDA tests skip)
H2D=(--batch-mb 38.5 --warmup 8 --steps 60); E2E=(--models resnet18 resnet50 --images 2048 --batch-size 128)
DS=(--workers 8 15 --images 1024 --reps 3 --budget 75); DSNV=(--workers 8 --images 1024); ES=(--workers 15 --batch-size 128
--images 4096 --side 400 --size 224); PO=(--size 224 --images 8192 --workers 15 --reps 2)
DOC=(--model resnet18 --workers 8 --batch-size 128 --samples 512 --steps 15)
if [ "${DRY:-0}" = 1 ]; then
  H2D=(--batch-mb 2 --warmup 2 --steps 10); E2E=(--models tiny --images 96 --batch-size 16 --size 64)
  DS=(--workers 2 --images 64 --reps 1 --budget 60); DSNV=(--workers 2 --images 64); ES=(--workers 2 --batch-size 16
  --images 256 --side 96 --size 64); PO=(--size 64 --images 512 --workers 2 --reps 1)
  DOC=(--step-ms 1 --workers 2 --batch-size 16 --samples 64 --steps 4)
fi
. "$(dirname "$0")/_parts.sh"  # START, SUM (summary.txt), part NAME LIMIT LOG COMMAND...

NV=""  # nvImageCodec installed from carried wheels: the opt-in parts 4a/4b run
if nvimgcodec_site "${WHEELS:-wheels}"; then
  NV=1
  export PYTHONPATH="$PYTHONPATH:$NVIMGCODEC_SITE"
fi

part pytest_cuda 100 "$OUT/pytest_cuda.txt" \
  python3 -m pytest -m cuda tests/ -q -rfE -p no:cacheprovider --continue-on-collection-errors
part h2d 45 "$WORK/h2d.txt" \
  python3 benchmarks/h2d_overlap.py "${H2D[@]}" --reps 2 --compute-ms 4.9 1.1 0.5 --jitter 0 0.2 \
  --spike-ms 8 --json "$OUT/h2d.json"
part train_e2e 200 "$WORK/e2e.txt" \
  python3 benchmarks/train_e2e.py "${E2E[@]}" --warmup 2 --epochs 8 \
  --dir "$WORK/e2e" --json "$OUT/e2e.json"
part decode_stage 100 "$WORK/decode_stage.txt" \
  python3 benchmarks/decode_stage.py "${DS[@]}" --data "$WORK/ds" \
  --json "$OUT/decode_stage.json"
if [ -n "$NV" ]; then
  part decode_stage_nvimgcodec 35 "$WORK/decode_stage_nv.txt" \
    python3 benchmarks/decode_stage.py "${DSNV[@]}" --rows gpu --device-decoder nvimgcodec --reps 2 \
    --budget 25 --data "$WORK/ds" --json "$OUT/decode_stage_nvimgcodec.json"
  part nvimgcodec_probe 70 "$WORK/nvimgcodec_probe.txt" \
    python3 benchmarks/gpu/nvimgcodec_probe.py --images 512 --seconds 3 --out "$OUT"
fi
part epoch_start 90 "$WORK/epoch_start.txt" \
  python3 benchmarks/epoch_start.py "${ES[@]}" --reps 1 \
  --epochs 3 --dir "$WORK/es" --json "$OUT/epoch_start.json"
part producer 60 "$WORK/producer.txt" \
  python3 benchmarks/producer_overhead.py "${PO[@]}" --dir "$WORK/po" --json "$OUT/producer.json"
SH=$(ls -d "$WORK"/e2e/shards-* 2>/dev/null | head -n 1)
if [ -n "$SH" ]; then
  part doctor 60 "$OUT/doctor.txt" python3 -m fastdata doctor "$SH" "${DOC[@]}"
fi
echo "== total $((SECONDS - START)) s" >> "$SUM"
cat "$SUM"
