#!/bin/bash
# A/B on the GPU: segment graphs kept from step to step (`--reuse-graphs on`, the default
# since this A/B: each segment's ggml graph runs again, nothing built or allocated, and
# ggml's CUDA backend may replay it as a CUDA graph) against building every segment's graph
# each step (`off`), and `on` without CUDA graphs (GGML_CUDA_DISABLE_GRAPHS=1: what the
# kept graphs gain from the build alone). SD1.5 resident (engine and bare graph), then at
# SD15_BUDGETS [0.75 0.5 0.25] of its weights in ROUNDS [2] interleaved rounds, SDXL at
# XL_BUDGETS [0.5 0.25] once, pinned params, reserve 0; then diffusers' leaf-level group
# offload of the same SD1.5 weights (DIFFUSERS [leaf]; needs .whl/ carried). The JSON lines
# in $OUT/results.jsonl. Run from the checkout root with stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$B copy-bw --backend CUDA0 --mib 1024 | tail -1
$B write-weights /tmp/w15 --config sd15 >/dev/null
W15=(--config sd15 --weights /tmp/w15/unet.safetensors)
ab_one sd15-resident "${W15[@]}" --params device
ab_one sd15-bare "${W15[@]}" --params device --direct on
for r in $(seq ${ROUNDS-2}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    ab_one sd15-$f-off-r$r "${W15[@]}" --max-vram $f --reuse-graphs off
    ab_one sd15-$f-on-r$r "${W15[@]}" --max-vram $f --reuse-graphs on
    GGML_CUDA_DISABLE_GRAPHS=1 ab_one sd15-$f-on-nocg-r$r "${W15[@]}" --max-vram $f --reuse-graphs on
  done
done
diffusers_sd15 /tmp/w15/unet.safetensors
rm -rf /tmp/w15
if [ -n "${XL_BUDGETS-0.5 0.25}" ]; then
  $B write-weights /tmp/wxl --config sdxl >/dev/null
  WXL=(--config sdxl --weights /tmp/wxl/unet.safetensors)
  STEPS=6 ab_one sdxl-resident "${WXL[@]}" --params device
  for f in ${XL_BUDGETS-0.5 0.25}; do
    STEPS=6 ab_one sdxl-$f-off "${WXL[@]}" --max-vram $f --reuse-graphs off
    STEPS=6 ab_one sdxl-$f-on "${WXL[@]}" --max-vram $f --reuse-graphs on
  done
  rm -rf /tmp/wxl
fi
echo "done in $(($(date +%s)-T0)) s"
