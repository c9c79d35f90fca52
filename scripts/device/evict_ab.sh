#!/bin/bash
# A/B on the GPU: with segments in flight, prefetches that evict at once (unpinned weights
# only: `sd-bench unet --evict-in-flight on`) against waiting until the segments before the
# current one are done (`off`, the default when this ran). SD1.5 at SD15_BUDGETS
# [0.75 0.5 0.25] of its weights, ROUNDS [3] interleaved rounds; SDXL at XL_BUDGETS
# [0.5 0.25], XL_ROUNDS [2]; pinned params, reserve 0; resident steps and the pinned copy
# bandwidth beside them. JSON lines in $OUT/results.jsonl. Run from the checkout root with
# stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
bench_model sd15
for r in $(seq ${ROUNDS-3}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    for e in off on; do
      ab_one sd15-$f-evict-$e-r$r "${W[@]}" --max-vram $f --evict-in-flight $e
    done
  done
done
rm -rf /tmp/w-sd15
STEPS=6 bench_model sdxl
for r in $(seq ${XL_ROUNDS-2}); do
  for f in ${XL_BUDGETS-0.5 0.25}; do
    for e in off on; do
      STEPS=6 ab_one sdxl-$f-evict-$e-r$r "${W[@]}" --max-vram $f --evict-in-flight $e
    done
  done
done
rm -rf /tmp/w-sdxl
echo "done in $(($(date +%s)-T0)) s"
