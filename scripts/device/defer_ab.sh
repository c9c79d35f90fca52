#!/bin/bash
# A/B on the GPU of two sd-bench builds, stage/sd-bench.xz against stage/sd-bench-base.xz
# (used for prefetched weights activated without waiting for their transfer thread, the
# copies joined just before the segment computed, against joining them at activation: no
# gain, not kept; docs/benchmarks.md, twelfth session). SD1.5 at SD15_BUDGETS [0.75 0.5 0.25] of its
# weights, ROUNDS [3] interleaved rounds; SDXL at XL_BUDGETS [0.5 0.25], XL_ROUNDS [1];
# pinned params, reserve 0; resident steps and the pinned copy bandwidth beside them. JSON
# lines in $OUT/results.jsonl. Run from the checkout root with stage/ as for
# streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
[[ -f $S/sd-bench-base || ! -f $S/sd-bench-base.xz ]] || xz -d -k $S/sd-bench-base.xz
chmod +x $S/sd-bench-base
BASE=$S/sd-bench-base
device_header
bench_model sd15
for r in $(seq ${ROUNDS-3}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    B=$BASE ab_one sd15-$f-base-r$r "${W[@]}" --max-vram $f
    ab_one sd15-$f-defer-r$r "${W[@]}" --max-vram $f
  done
done
rm -rf /tmp/w-sd15
STEPS=6 bench_model sdxl
for r in $(seq ${XL_ROUNDS-1}); do
  for f in ${XL_BUDGETS-0.5 0.25}; do
    STEPS=6 B=$BASE ab_one sdxl-$f-base-r$r "${W[@]}" --max-vram $f
    STEPS=6 ab_one sdxl-$f-defer-r$r "${W[@]}" --max-vram $f
  done
done
rm -rf /tmp/w-sdxl
echo "done in $(($(date +%s)-T0)) s"
