#!/bin/bash
# One device call (2026-12-05, third session), issue 19: (1) `sd` resident with the weights
# read straight into the GPU (the new default) against `--offload-to-cpu` (file -> RAM ->
# GPU, the old default), interleaved, random SD1.5 checkpoint, 512x512, CFG 7, 12 steps;
# (2) `sd --max-vram 1.2`: the device peak against the budget now that the allocator's
# rounding is measured and counted; (3) sd-bench: a 12-block Qwen-Image (the widths of the
# 20B model) at 4.8 and 1.6 GiB (1.7 and 38 MB over before), and the SD1.5 UNet at 0.75 / 0.5.
# Run from the checkout root with stage/ holding sd.xz, sd-bench.xz, random_sd15.py,
# compare.py and mod/libggml-cuda.so.xz.*; results in $OUT.
R=$(pwd)
source scripts/device/stage_module.sh >/dev/null 2>&1
xz -d -k -f $S/sd.xz && chmod +x $S/sd
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $L/env.txt
# measure LABEL CMD...: wall time and the device's peak memory.used (MiB, minus idle, nvidia-smi every 50 ms)
measure() {
  local label=$1; shift
  local idle; idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > /tmp/mem-$label 2>/dev/null &
  local smi=$! t0 t1 rc
  t0=$(date +%s.%N); "$@" > $L/$label.log 2>&1; rc=$?; t1=$(date +%s.%N)
  kill $smi; wait $smi 2>/dev/null
  local peak; peak=$(sort -n /tmp/mem-$label | tail -1)
  python3 -c "import sys; print(f'RESULT {sys.argv[1]} rc={sys.argv[2]} wall_s={float(sys.argv[4])-float(sys.argv[3]):.2f} peak_mib={int(sys.argv[5])-int(sys.argv[6])} idle_mib={sys.argv[6]}')" \
    $label $rc $t0 $t1 ${peak:-0} $idle | tee -a $L/results.txt
  ((rc == 0)) || tail -5 $L/$label.log
}
CK=/tmp/sd15-random.safetensors
python3 $S/random_sd15.py $CK --names crates/sd-formats/tests/fixtures/names > /dev/null
C=(-m $CK -p "a photograph of an astronaut riding a horse" -W 512 -H 512 --cfg-scale 7 --steps 12 -s 42 --backend CUDA0)
for i in 1 2; do
  measure direct-$i $S/sd "${C[@]}" -o /tmp/direct-$i.png -v
  measure offload-$i $S/sd "${C[@]}" --offload-to-cpu -o /tmp/offload-$i.png -v
done
python3 $S/compare.py /tmp/direct-1.png /tmp/offload-1.png | tee -a $L/results.txt
measure vram-1.2 $S/sd "${C[@]}" --max-vram 1.2 -o /tmp/v12.png -v
python3 $S/compare.py /tmp/direct-1.png /tmp/v12.png | tee -a $L/results.txt
for f in direct-1 offload-1 vram-1.2; do
  sed 's/\x1b\[[0-9;]*m//g' $L/$f.log | grep -iE "granularity|runtime_mib|took|steps in|sampling|decod|load" | cut -c1-300 | head -8
done
# sd-bench: 12-block Qwen-Image and the SD1.5 UNet under budgets.
W=/tmp/w-q12
$B write-weights $W --config qwen-image --blocks 12 > /dev/null
for g in resident 4.8 1.6; do
  if [[ $g == resident ]]; then extra=(--params device); else extra=(--params pinned --max-vram $(python3 -c "print(int($g*2**30))")); fi
  timeout 90 $B unet --config qwen-image --weights $W/unet.safetensors --backend CUDA0 --steps 3 "${extra[@]}" > $L/q12-$g.json 2> $L/q12-$g.err
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('Q12', sys.argv[2], {k: r.get(k) for k in ('step_ms_median','segments','prefetched','h2d_bytes_per_step','device_used_peak_bytes','budget_bytes','runtime_reserve_bytes','allocation_granularity','staging_pool_bytes')}, r.get('last_step_timing_ms'))" $L/q12-$g.json $g | tee -a $L/results.txt
done
rm -rf $W
cd $R
MODULE_DIR=$M SD_BENCH=$B PHASES=resident,budgets BUDGETS="0.75 0.5" MODES=pinned NORESERVE_BUDGETS= RAM_BUDGET= STEPS=10 DEADLINE=${SWEEP_DEADLINE:-100} \
  timeout 170 bash scripts/device/cuda_run.sh $OUT/sweep > /dev/null 2>&1
python3 - $OUT/sweep/results.jsonl <<'PY' | tee -a $L/results.txt
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print("SWEEP", r.get("label"), {k: r.get(k) for k in ("step_ms_median","h2d_bytes_per_step","segments","prefetched","device_used_peak_bytes","budget_bytes","runtime_reserve_bytes","allocation_granularity")})
PY
gzip -9 $L/*.log $L/*.err 2>/dev/null
