#!/bin/bash
# The last call of the twentieth session (issue 19): flash attention reading Q through a
# permuted view and K / V permuted by their f16 casts (no separate permute copies): the
# SD1.5 resident step and bare graph, its output against diffusers' f32 UNet
# (`diffusers_unet.py --dump`), SD1.5 at 0.5 of its weights, and the SDXL resident step.
CALL_T0=$(date +%s)
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
install_wheels
bench_model sd15
ab_one sd15-bare "${W[@]}" --params device --direct on
ab_one sd15-0.5 "${W[@]}" --max-vram 0.5
STEPS=2 ab_one sd15-dump "${W[@]}" --params device --dump /tmp/dump >/dev/null
PEER_TIMEOUT=120 PEER_CUT=900 peer sd15-parity /tmp/w-sd15/unet.safetensors --dump /tmp/dump --iters 30 --warmup 5
rm -rf /tmp/w-sd15
STEPS=6 bench_model sdxl
echo "done in $(($(date +%s)-CALL_T0)) s"
