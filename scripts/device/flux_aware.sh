#!/bin/bash
# The fourth call of the twenty-second session (issue 19): FLUX.1-dev at BUDGETS [0.75 0.5
# 0.25] of its weights with the default resident set against the compute-aware one
# (`--compute-aware-residency on`: a segment streams in proportion to the compute before
# it, so the first segment of a step, behind the short last one, keeps its weights), which
# on the simulated device removes the wait at a step's start seen at 0.75 (51 ms a step).
# Run from the checkout root with stage/ (sd-bench.xz, module in stage/mod/).
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-330}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
$B write-weights /tmp/w-flux --config flux-dev | tail -1
W=(--config flux-dev --weights /tmp/w-flux/unet.safetensors)
export STEPS=${STEPS:-3}
for f in ${BUDGETS:-0.75 0.5 0.25}; do
  late flux-$f && break
  ab_one flux-$f-base "${W[@]}" --max-vram $f
  ab_one flux-$f-aware "${W[@]}" --max-vram $f --compute-aware-residency on
done
echo "done in $(($(date +%s)-CALL_T0)) s"
