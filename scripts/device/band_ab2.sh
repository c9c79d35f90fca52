#!/bin/bash
# The second call of the twentieth session (issue 19): the band limit's divisor (budget / D:
# 8, 16, off) at the budgets where bands helped (SD1.5 0.25 and below, SDXL 0.25) and cost
# (SD1.5 0.5 / 0.75), SDXL below a quarter of its weights, and diffusers' resident step
# (50 timed iterations) in the same call. Env as band_ab.sh; DEADLINE [480].
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-480}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
bench_model sd15
ab_one sd15-bare "${W[@]}" --params device --direct on
for f in 0.5 0.25 0.75 0.2 0.15; do
  for d in 8 16 0; do
    late sd15-$f-$d && break 2
    ab_one sd15-$f-bands$d "${W[@]}" --max-vram $f --band-divisor $d
  done
done
late diffusers || { install_wheels && PEER_TIMEOUT=120 PEER_CUT=400 peer sd15-diffusers-resident /tmp/w-sd15/unet.safetensors --iters 50 --warmup 10; }
rm -rf /tmp/w-sd15
export STEPS=6
late sdxl || {
  bench_model sdxl
  for f in 0.25 0.15 0.12; do
    for d in 8 16; do
      late sdxl-$f-$d && break 2
      ab_one sdxl-$f-bands$d "${W[@]}" --max-vram $f --band-divisor $d
    done
  done
}
echo "done in $(($(date +%s)-CALL_T0)) s"
