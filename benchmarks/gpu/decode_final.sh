#!/usr/bin/env bash
# The second GPU call (issue 9: decode and augment on the GPU, random-augmentation training):
#
#   bash benchmarks/gpu/decode_final.sh --out DIR    (from the repository root; budget ~560 s, BUDGET=... to change)
#
# Carry the ignored folder `wheels` (nvImageCodec + nvJPEG wheels, see nvimgcodec_probe.py) to get the
# nvImageCodec rows; without it they are skipped and said so.
#
# 1. train_e2e.py --augment random: resnet18, bf16, channels_last, batch 128, 2,048 generated JPEGs,
#    2 warm-up + 6 timed epochs (the GPU rows' windows > 1 s): resident / torchvision's recipe (tuned loader) / fastdata workers /
#    thread decoder / GPU decode / GPU decode on a high-priority side stream     (limit 190 s)
# 2. decode_gpu.py: the decode stage alone, its correctness, sync freedom, memory over 30 epochs,
#    resnet18 fed from packed batches (normal and high stream priority) and from tar shards (limit 180 s)
# 3. nvimgcodec_probe.py (only with wheels/): torchvision vs nvImageCodec's hardware decoder alone and
#    beside resnet18 training, normal and high stream priority                   (limit 90 s)
# 4. train_e2e.py --augment random, GPU decode rows only, FASTDATA_DEVICE_DECODER=nvimgcodec (only with
#    wheels/)                                                                     (the rest, <= 100 s)
# A first look before the run, on a CPU machine: DRY=1 bash benchmarks/gpu/decode_final.sh --out /tmp/x
# Writes: summary.txt, e2e_random.json, decode_gpu.json, nvimgcodec_probe.json, e2e_random_nvimgcodec.json.
. "$(dirname "$0")/_setup.sh" "$@"  # --out DIR -> OUT; WORK (removed on exit); PYTHONPATH
BUDGET=${BUDGET:-560}
. "$(dirname "$0")/_parts.sh"  # START, SUM (summary.txt), part NAME LIMIT LOG COMMAND...

SIZES=(--models resnet18 --images 2048 --batch-size 128)
# DRY=1: plumbing check on a CPU machine (tiny model, few images; the GPU-only parts say so and skip)
if [ "${DRY:-0}" = 1 ]; then SIZES=(--models tiny --images 96 --batch-size 16 --size 64); fi
E2E=(python3 benchmarks/train_e2e.py --augment random "${SIZES[@]}" --warmup 2 --epochs 6 --dir "$WORK/e2e")
part e2e_random 190 "$WORK/e2e_random.txt" "${E2E[@]}" --json "$OUT/e2e_random.json"
part decode_gpu 180 "$WORK/decode_gpu.txt" python3 benchmarks/gpu/decode_gpu.py --out "$OUT" --budget 170

if nvimgcodec_site "$PWD/wheels"; then
  NVENV=(env PYTHONPATH="$PYTHONPATH:$NVIMGCODEC_SITE")
  part nvimgcodec_probe 90 "$WORK/probe.txt" "${NVENV[@]}" python3 benchmarks/gpu/nvimgcodec_probe.py --out "$OUT" \
    --seconds 3
  part e2e_random_nvimgcodec 100 "$WORK/e2e_nv.txt" "${NVENV[@]}" FASTDATA_DEVICE_DECODER=nvimgcodec "${E2E[@]}" \
    --variants resident fastdata_gpu_rrc fastdata_gpu_rrc_hiprio --json "$OUT/e2e_random_nvimgcodec.json"
else
  echo "== nvimgcodec parts: skipped (no usable wheels/*.whl carried)" >> "$SUM"
fi
echo "== total $((SECONDS - START)) s" >> "$SUM"
cat "$SUM"
