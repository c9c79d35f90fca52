#!/bin/bash
# Where a FLUX.1 transformer step's GPU time goes (issue 19, the resident gap to diffusers:
# 3.2x). A FLUX.1-dev of the real widths with BLOCKS [2] double and 2*BLOCKS single blocks
# (random f16 weights; 1024x1024, batch 1, 512 text tokens): bare graph and resident step
# timed, then the bare graph under Nsight Compute (CUDA graphs off, one duration per kernel,
# the timed step's kernels summed by name), then diffusers' same model (bf16) timed and
# under torch.profiler. Run from the checkout root with stage/ and .whl/ carried.
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-480}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
BLOCKS=${BLOCKS:-2}
$B write-weights /tmp/w-fluxs --config flux-dev --blocks $BLOCKS | tail -1
W=(--config flux-dev --weights /tmp/w-fluxs/unet.safetensors)
export STEPS=${STEPS:-5}
ab_one flux$BLOCKS-bare "${W[@]}" --params device --direct on
ab_one flux$BLOCKS-resident "${W[@]}" --params device
for extra in ${EXTRA_RUNS:-}; do ab_one flux$BLOCKS-$extra "${W[@]}" --params device --direct on $(echo $extra | tr '=' ' '); done
NCU=$(which ncu 2>/dev/null || ls /usr/local/cuda*/bin/ncu | head -1)
GGML_CUDA_DISABLE_GRAPHS=1 timeout ${NCU_TIMEOUT:-240} $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
  $B unet --backend CUDA0 "${W[@]}" --params device --direct on --steps 1 >$OUT/ncu.csv 2>$OUT/ncu.err
echo "ncu rc $? at $(($(date +%s)-CALL_T0)) s"; tail -2 $OUT/ncu.err
python3 scripts/device/ncu_census.py $OUT/ncu.csv | tee $OUT/census.txt
rm -rf /tmp/w-fluxs
if install_wheels; then
  timeout 200 env PYTHONUNBUFFERED=1 python3 scripts/bench/dit_step_diffusers.py --model flux-dev --dtype bf16 --reps 5 --blocks $BLOCKS --profile 2>&1 | grep -E "RESULT|DIFF|diffusers" | tee $OUT/peer.txt
fi
echo "done in $(($(date +%s)-CALL_T0)) s"
