#!/bin/bash
# A/B on the GPU: the staging pool's streaming window (`sd-bench unet --stream-window N`:
# how many segments' streamed weights the pool holds at once; 1 = the plans before the
# window existed). SD1.5 at SD15_BUDGETS [0.75 0.5 0.25] of its weights and SDXL at
# XL_BUDGETS [0.5 0.25], windows WINDOWS [1 2 3] interleaved, ROUNDS [2] rounds for SD1.5
# (SDXL once, 6 steps), pinned params, reserve 0; the resident steps and the pinned copy
# bandwidth beside them. JSON lines in $OUT/results.jsonl. Run from the checkout root with
# stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$B copy-bw --backend CUDA0 --mib 1024 | tail -1
$B write-weights /tmp/w15 --config sd15 >/dev/null
W15=(--config sd15 --weights /tmp/w15/unet.safetensors)
ab_one sd15-resident "${W15[@]}" --params device
for r in $(seq ${ROUNDS-2}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    for w in ${WINDOWS-1 2 3}; do
      ab_one sd15-$f-w$w-r$r "${W15[@]}" --max-vram $f --stream-window $w
    done
  done
done
rm -rf /tmp/w15
if [ -n "${XL_BUDGETS-0.5 0.25}" ]; then
  $B write-weights /tmp/wxl --config sdxl >/dev/null
  WXL=(--config sdxl --weights /tmp/wxl/unet.safetensors)
  STEPS=6 ab_one sdxl-resident "${WXL[@]}" --params device
  for f in ${XL_BUDGETS-0.5 0.25}; do
    for w in ${WINDOWS-1 2 3}; do
      STEPS=6 ab_one sdxl-$f-w$w "${WXL[@]}" --max-vram $f --stream-window $w
    done
  done
  rm -rf /tmp/wxl
fi
echo "done in $(($(date +%s)-T0)) s"
