#!/bin/bash
# A/B on the GPU: uploads coalesced (runs of tensors laid out alike in host and device memory
# copied as one, `SD_BENCH_COALESCE=1`, the default since this A/B) against one copy per tensor
# (`SD_BENCH_COALESCE=0`), with several segments prefetched ahead. SD1.5 at SD15_BUDGETS [0.75 0.5 0.25] of its weights
# in ROUNDS [2] interleaved rounds, SDXL at XL_BUDGETS [0.5] once, pinned params, reserve 0.
# Prints one line per run; the JSON lines in $OUT/results.jsonl. Run from the checkout root
# with stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
$B copy-bw --backend CUDA0 --mib 1024 | tail -1
$B write-weights /tmp/w15 --config sd15 >/dev/null
ab_one sd15-resident --config sd15 --weights /tmp/w15/unet.safetensors --params device
for r in $(seq ${ROUNDS-2}); do
  for f in ${SD15_BUDGETS-0.75 0.5 0.25}; do
    for co in 0 1; do SD_BENCH_COALESCE=$co ab_one sd15-$f-co$co-r$r --config sd15 --weights /tmp/w15/unet.safetensors --max-vram $f; done
  done
done
rm -rf /tmp/w15
if [ -n "${XL_BUDGETS-0.5}" ]; then
  $B write-weights /tmp/wxl --config sdxl >/dev/null
  for f in ${XL_BUDGETS-0.5}; do
    for co in 0 1; do SD_BENCH_COALESCE=$co ab_one sdxl-$f-co$co --config sdxl --weights /tmp/wxl/unet.safetensors --max-vram $f; done
  done
  rm -rf /tmp/wxl
fi
