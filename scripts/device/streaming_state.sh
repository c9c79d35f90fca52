#!/bin/bash
# The state of budgeted streaming on one GPU, with diffusers beside it: sd-bench's SD1.5 UNet
# step resident, bare (`--direct on`) and at SD15_BUDGETS [0.75 0.5 0.25] of its weights in
# ROUNDS [2] rounds, then diffusers 0.42.1 on the same weights resident and with its group
# offloading (leaf and block level, streams); SDXL resident and at XL_BUDGETS [0.5 0.25],
# then diffusers' SDXL (random weights) resident and leaf-level. Pinned params, reserve 0,
# the engine's defaults. JSON lines in $OUT/results.jsonl (diffusers' lines labelled
# sd15-diffusers-MODE / sdxl-diffusers-MODE). Needs .whl/ carried (diffusers) and torch on
# the machine. Run from the checkout root with stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
bench_model sd15
ab_one sd15-bare "${W[@]}" --params device --direct on
for r in $(seq ${ROUNDS-2}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    ab_one sd15-$f-r$r "${W[@]}" --max-vram $f
  done
done
DIFFUSERS="none leaf block" diffusers_sd15 /tmp/w-sd15/unet.safetensors
rm -rf /tmp/w-sd15
STEPS=6 bench_model sdxl
for f in ${XL_BUDGETS-0.5 0.25}; do
  STEPS=6 ab_one sdxl-$f "${W[@]}" --max-vram $f
done
rm -rf /tmp/w-sdxl
for o in none leaf; do
  timeout 150 env PYTHONUNBUFFERED=1 python3 scripts/device/diffusers_unet.py /dev/null --model sdxl --offload $o --iters 10 --warmup 2 2>&1 | grep '^{' | tail -1 |
    sed "s/^{/{\"label\":\"sdxl-diffusers-$o\",/" | tee -a $OUT/results.jsonl | cut -c1-300
done
echo "done in $(($(date +%s)-T0)) s"
