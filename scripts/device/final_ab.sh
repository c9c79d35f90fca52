#!/bin/bash
# The fourth call of the twentieth session (issue 19): the table of record, side by side in
# one call. SD1.5: bare graph (with the flash padding), resident step, budgets 0.75 / 0.5 /
# 0.25 / 0.2 / 0.15 of its weights (pinned params, reserve 0), diffusers resident (50
# iterations) and leaf-level group offload; SDXL: bare, resident, 0.5 / 0.25, diffusers
# resident and leaf offload. DEADLINE [500].
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-500}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
install_wheels
bench_model sd15
ab_one sd15-bare "${W[@]}" --params device --direct on
for f in 0.75 0.5 0.25 0.2 0.15; do
  late sd15-$f && break
  ab_one sd15-$f "${W[@]}" --max-vram $f
done
late peers || peer sd15-diffusers-resident /tmp/w-sd15/unet.safetensors --iters 50 --warmup 10
late peers || peer sd15-diffusers-leaf /tmp/w-sd15/unet.safetensors --offload leaf --iters 20 --warmup 3
rm -rf /tmp/w-sd15
export STEPS=6
late sdxl || {
  bench_model sdxl
  ab_one sdxl-bare "${W[@]}" --params device --direct on
  for f in 0.5 0.25; do
    late sdxl-$f && break
    ab_one sdxl-$f "${W[@]}" --max-vram $f
  done
  late sdxl-peers || peer sdxl-diffusers-resident /tmp/w-sdxl/unet.safetensors --model sdxl --iters 20 --warmup 5
  late sdxl-peers || peer sdxl-diffusers-leaf /tmp/w-sdxl/unet.safetensors --model sdxl --offload leaf --iters 10 --warmup 2
}
echo "done in $(($(date +%s)-CALL_T0)) s"
