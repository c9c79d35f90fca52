#!/bin/bash
# Where one SD1.5 UNet step's GPU time goes (issue 19, the resident gap to diffusers): the
# bare ggml graph (`sd-bench unet --direct on`, CUDA graphs off so each kernel launches on
# its own) under Nsight Compute, one duration metric per kernel, summed by kernel name over
# the timed step (the second half of the kernels: a warm-up step runs first); then
# diffusers' step under torch.profiler (kernel_profile.py). MODEL [sd15] or sdxl.
# Run from the checkout root with stage/ (and .whl/) as for band_ab.sh.
CALL_T0=$(date +%s)
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
MODEL=${MODEL:-sd15}
$B write-weights /tmp/w-$MODEL --config $MODEL >/dev/null
which ncu || ls /usr/local/cuda*/bin/ncu
NCU=$(which ncu 2>/dev/null || ls /usr/local/cuda*/bin/ncu | head -1)
GGML_CUDA_DISABLE_GRAPHS=1 timeout ${NCU_TIMEOUT:-300} $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  $B unet --backend CUDA0 --config $MODEL --weights /tmp/w-$MODEL/unet.safetensors --params device --direct on --steps 1 \
  >$OUT/ncu.csv 2>$OUT/ncu.err
echo "ncu rc $? in $(($(date +%s)-CALL_T0)) s"; tail -3 $OUT/ncu.err
python3 scripts/device/ncu_census.py $OUT/ncu.csv 40
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  timeout 150 python3 scripts/device/kernel_profile.py $MODEL 2>&1 | grep DIFF
fi
echo "done in $(($(date +%s)-CALL_T0)) s"
