#!/bin/bash
# The second call of the twenty-first session (issue 19): segments refined for a larger
# resident set (`sd-bench unet --refine-for-residency on --segment-weight-share N`) against
# the default plan, SD1.5 at 0.75 / 0.5 / 0.25 of its weights, pinned params, reserve 0,
# interleaved by budget. Run from the checkout root with stage/ (sd-bench.xz and the module
# in stage/mod/ from the first call).
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-420}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
bench_model sd15
for round in 1 2; do
  for f in 0.75 0.5 0.25; do
    late sd15-$f && break 2
    ab_one sd15-$f-base "${W[@]}" --max-vram $f
    ab_one sd15-$f-share8 "${W[@]}" --max-vram $f --refine-for-residency on --segment-weight-share 8
    ab_one sd15-$f-share16 "${W[@]}" --max-vram $f --refine-for-residency on --segment-weight-share 16
  done
done
echo "done in $(($(date +%s)-CALL_T0)) s"
