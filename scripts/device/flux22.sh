#!/bin/bash
# The third call of the twenty-second session (issue 19, Measure): the FLUX.1-dev transformer
# (random f16 weights of the real size, 23.8 GB; 1024x1024, batch 1) resident, as a bare
# graph, and under --max-vram at BUDGETS [0.5 0.25 0.1 0.75] of its weights (pinned params,
# reserve 0, STEPS [3]), then diffusers' FLUX.1-dev (bf16) with leaf-level group offload and
# resident in the same call. Run from the checkout root with stage/ (sd-bench.xz, module in
# stage/mod/) and .whl/ (diffusers) carried.
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-430}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
free -g | head -2
tw=$(date +%s); $B write-weights /tmp/w-flux --config flux-dev | tail -1; echo "weights written in $(($(date +%s)-tw)) s"
W=(--config flux-dev --weights /tmp/w-flux/unet.safetensors)
export STEPS=${STEPS:-3}
ab_one flux-resident "${W[@]}" --params device
ab_one flux-bare "${W[@]}" --params device --direct on
for f in ${BUDGETS:-0.5 0.25 0.1 0.75}; do
  late flux-$f && break
  ab_one flux-$f "${W[@]}" --max-vram $f
done
rm -rf /tmp/w-flux
install_wheels
for o in leaf none; do
  late diffusers-$o && break
  echo "[$(($(date +%s)-CALL_T0)) s] diffusers $o"
  timeout 200 env PYTHONUNBUFFERED=1 python3 scripts/bench/dit_step_diffusers.py --model flux-dev --dtype bf16 --reps 3 --offload $o 2>&1 | grep -v Warning | tail -7 | tee -a $OUT/peer-$o.txt
done
echo "done in $(($(date +%s)-CALL_T0)) s"
