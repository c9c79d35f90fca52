#!/bin/bash
# A/B on the GPU: segments queued without waiting, the next one prepared on the host while
# one computes (`--async-compute on`, the default since this A/B) against waiting for each
# segment (`off`). SD1.5 resident (engine and bare graph), then at SD15_BUDGETS [0.75 0.5
# 0.25 0.1] of its weights in ROUNDS [2] interleaved rounds, SDXL at XL_BUDGETS [0.5 0.25]
# once, pinned params, reserve 0; then diffusers' leaf-level group offload of the same SD1.5
# weights (DIFFUSERS [leaf]; needs .whl/ carried and torch on the machine). Prints one line
# per run; the JSON lines in $OUT/results.jsonl. Run from the checkout root with stage/ as
# for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
$B copy-bw --backend CUDA0 --mib 1024 | tail -1
$B write-weights /tmp/w15 --config sd15 >/dev/null
ab_one sd15-resident --config sd15 --weights /tmp/w15/unet.safetensors --params device
ab_one sd15-bare --config sd15 --weights /tmp/w15/unet.safetensors --params device --direct on
for r in $(seq ${ROUNDS-2}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25 0.1}; do
    for ac in on off; do ab_one sd15-$f-ac$ac-r$r --config sd15 --weights /tmp/w15/unet.safetensors --max-vram $f --async-compute $ac; done
  done
done
diffusers_sd15 /tmp/w15/unet.safetensors
rm -rf /tmp/w15
if [ -n "${XL_BUDGETS-0.5 0.25}" ]; then
  $B write-weights /tmp/wxl --config sdxl >/dev/null
  STEPS=6 ab_one sdxl-resident --config sdxl --weights /tmp/wxl/unet.safetensors --params device
  for f in ${XL_BUDGETS-0.5 0.25}; do
    for ac in on off; do STEPS=6 ab_one sdxl-$f-ac$ac --config sdxl --weights /tmp/wxl/unet.safetensors --max-vram $f --async-compute $ac; done
  done
  rm -rf /tmp/wxl
fi
echo "done in $(($(date +%s)-T0)) s"
