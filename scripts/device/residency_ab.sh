#!/bin/bash
# The second call of the twenty-first session (issue 19): segments refined for a larger
# resident set (`sd-bench unet --refine-for-residency on --segment-weight-share N`, N in
# SHARES [8 16]) against the default plan, SD1.5 at BUDGETS [0.75 0.5 0.25] of its weights,
# pinned params, reserve 0, interleaved by budget, ROUNDS [2]; the resident step first with
# RESIDENT=1. Run from the checkout root with stage/ (sd-bench.xz and the module in
# stage/mod/ from the first call).
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-420}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
if [[ ${RESIDENT:-1} == 1 ]]; then
  bench_model sd15
else
  $B write-weights /tmp/w-sd15 --config sd15 >/dev/null
  W=(--config sd15 --weights /tmp/w-sd15/unet.safetensors)
fi
for round in $(seq ${ROUNDS:-2}); do
  for f in ${BUDGETS:-0.75 0.5 0.25}; do
    late sd15-$f && break 2
    ab_one sd15-$f-base "${W[@]}" --max-vram $f
    for n in ${SHARES:-8 16}; do
      ab_one sd15-$f-share$n "${W[@]}" --max-vram $f --refine-for-residency on --segment-weight-share $n
    done
  done
done
echo "done in $(($(date +%s)-CALL_T0)) s"
