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
device_header
bench_model sd15
for r in $(seq ${ROUNDS-2}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    for w in ${WINDOWS-1 2 3}; do
      ab_one sd15-$f-w$w-r$r "${W[@]}" --max-vram $f --stream-window $w
    done
  done
done
rm -rf /tmp/w-sd15
if [ -n "${XL_BUDGETS-0.5 0.25}" ]; then
  STEPS=6 bench_model sdxl
  for f in ${XL_BUDGETS-0.5 0.25}; do
    for w in ${WINDOWS-1 2 3}; do
      STEPS=6 ab_one sdxl-$f-w$w "${W[@]}" --max-vram $f --stream-window $w
    done
  done
  rm -rf /tmp/w-sdxl
fi
echo "done in $(($(date +%s)-T0)) s"
