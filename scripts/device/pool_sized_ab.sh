#!/bin/bash
# A/B on the GPU: merged segments sized by the staging pool (`sd-bench unet
# --pool-sized-segments on`) against the default, SD1.5 at 0.75 and 0.5 of its weights and
# SDXL at 0.5, pinned params, reserve 0, interleaved. Prints one line per run; the JSON
# lines in $OUT/results.jsonl. Run from the checkout root with stage/ as for
# streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
$B write-weights /tmp/w15 --config sd15 >/dev/null
for f in ${SD15_BUDGETS-0.75 0.5}; do
  for ps in off on; do ab_one sd15-$f-psz-$ps --config sd15 --weights /tmp/w15/unet.safetensors --max-vram $f --pool-sized-segments $ps; done
done
rm -rf /tmp/w15
$B write-weights /tmp/wxl --config sdxl >/dev/null
for f in ${XL_BUDGETS-0.5}; do
  for ps in off on; do ab_one sdxl-$f-psz-$ps --config sdxl --weights /tmp/wxl/unet.safetensors --max-vram $f --pool-sized-segments $ps; done
done
