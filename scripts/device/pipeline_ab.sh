#!/bin/bash
# A/B on the GPU: segments queued behind the one computing (`--segments-in-flight 2`, the
# default since this A/B; the inputs written in the device's queue, prefetches that evict
# scheduled after queueing) against one segment in flight (`1`, the host waits for it
# before queueing the next) and against the previous build (stage/sd-bench-base.xz: one
# segment in flight, no refinement for the staging pool). SD1.5 resident (engine and bare
# graph), then at SD15_BUDGETS [0.75 0.5 0.25] of its weights in ROUNDS [2] interleaved
# rounds, SDXL at XL_BUDGETS [0.5 0.25] once, pinned params, reserve 0; then diffusers'
# leaf-level group offload of the same SD1.5 weights (DIFFUSERS [leaf]; needs .whl/
# carried). The JSON lines in $OUT/results.jsonl. Run from the checkout root with stage/ as
# for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
[[ -f $S/sd-bench-base || ! -f $S/sd-bench-base.xz ]] || xz -d -k $S/sd-bench-base.xz
chmod +x $S/sd-bench-base 2>/dev/null
NEW=$B
BASE=$S/sd-bench-base
$B copy-bw --backend CUDA0 --mib 1024 | tail -1
$B write-weights /tmp/w15 --config sd15 >/dev/null
ab_one sd15-resident --config sd15 --weights /tmp/w15/unet.safetensors --params device
ab_one sd15-bare --config sd15 --weights /tmp/w15/unet.safetensors --params device --direct on
for r in $(seq ${ROUNDS-2}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    [[ -x $BASE ]] && B=$BASE ab_one sd15-$f-base-r$r --config sd15 --weights /tmp/w15/unet.safetensors --max-vram $f
    for d in ${DEPTHS-2 1}; do
      B=$NEW ab_one sd15-$f-d$d-r$r --config sd15 --weights /tmp/w15/unet.safetensors --max-vram $f --segments-in-flight $d
    done
  done
done
diffusers_sd15 /tmp/w15/unet.safetensors
rm -rf /tmp/w15
if [ -n "${XL_BUDGETS-0.5 0.25}" ]; then
  $NEW write-weights /tmp/wxl --config sdxl >/dev/null
  STEPS=6 B=$NEW ab_one sdxl-resident --config sdxl --weights /tmp/wxl/unet.safetensors --params device
  for f in ${XL_BUDGETS-0.5 0.25}; do
    [[ -x $BASE ]] && STEPS=6 B=$BASE ab_one sdxl-$f-base --config sdxl --weights /tmp/wxl/unet.safetensors --max-vram $f
    STEPS=6 B=$NEW ab_one sdxl-$f-d2 --config sdxl --weights /tmp/wxl/unet.safetensors --max-vram $f --segments-in-flight 2
  done
  rm -rf /tmp/wxl
fi
echo "done in $(($(date +%s)-T0)) s"
