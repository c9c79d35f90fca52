#!/bin/bash
# The DiT kernel changes of the twenty-third session (issue 19, the resident gap), A/B in
# one call: BASE = stage/sd-bench-base.xz (the build before them), NEW = stage/sd-bench.xz.
# FLUX.1-dev of the real widths with 2 double and 4 single blocks (random f16 weights,
# 1024x1024, batch 1, 512 text tokens): bare graph and resident, interleaved; the new
# build's bare graph under Nsight Compute (kernels summed by name, one step); SDXL's UNet
# (head width 64: flash attention with the new K/V casts) bare and resident; then, time
# allowing, the whole FLUX.1-dev (23.8 GB) bare with both builds and resident with the new.
CALL_T0=${CALL_T0:-$(date +%s)}; DEADLINE=${DEADLINE:-420}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
NEW=$B
BASE=/tmp/sd-bench-base; xz -dc stage/sd-bench-base.xz > $BASE; chmod +x $BASE
$NEW write-weights /tmp/w-fluxs --config flux-dev --blocks 2 | tail -1
W=(--config flux-dev --weights /tmp/w-fluxs/unet.safetensors)
# `ab_builds NAME`: the bare graph of W with both builds, ROUNDS [2] times interleaved, then
# the resident step with both.
ab_builds() {
  for round in $(seq ${ROUNDS:-2}); do
    B=$BASE ab_one $1-bare-base "${W[@]}" --params device --direct on
    B=$NEW ab_one $1-bare-new "${W[@]}" --params device --direct on
  done
  B=$BASE ab_one $1-resident-base "${W[@]}" --params device
  B=$NEW ab_one $1-resident-new "${W[@]}" --params device
}
export STEPS=${STEPS:-5}
ab_builds flux2
NCU=$(which ncu 2>/dev/null || ls /usr/local/cuda*/bin/ncu | head -1)
GGML_CUDA_DISABLE_GRAPHS=1 timeout ${NCU_TIMEOUT:-120} $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
  $NEW unet --backend CUDA0 "${W[@]}" --params device --direct on --steps 1 >$OUT/ncu.csv 2>$OUT/ncu.err
echo "ncu rc $? at $(($(date +%s)-CALL_T0)) s"
python3 scripts/device/ncu_census.py $OUT/ncu.csv | tee $OUT/census.txt
rm -rf /tmp/w-fluxs
$NEW write-weights /tmp/w-sdxl --config sdxl >/dev/null
W=(--config sdxl --weights /tmp/w-sdxl/unet.safetensors)
export STEPS=6
ab_builds sdxl
rm -rf /tmp/w-sdxl
late flux-full && { echo "done in $(($(date +%s)-CALL_T0)) s"; exit 0; }
tw=$(date +%s); $NEW write-weights /tmp/w-flux --config flux-dev | tail -1; echo "weights written in $(($(date +%s)-tw)) s"
W=(--config flux-dev --weights /tmp/w-flux/unet.safetensors)
export STEPS=3
B=$BASE ab_one flux-bare-base "${W[@]}" --params device --direct on
B=$NEW ab_one flux-bare-new "${W[@]}" --params device --direct on
late flux-resident || B=$NEW ab_one flux-resident-new "${W[@]}" --params device
rm -rf /tmp/w-flux
echo "done in $(($(date +%s)-CALL_T0)) s"
