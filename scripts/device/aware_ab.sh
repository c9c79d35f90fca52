#!/bin/bash
# A/B on the GPU of the compute-aware resident set (sixteenth session, issue 19): `sd-bench
# unet` with `--compute-aware-residency on` (each segment streams in proportion to the
# compute before it) against `off` (every segment streams the same cap), interleaved.
# MODELS [sd15 sdxl]; SD1.5 at SD15_BUDGETS [0.75 0.5 0.25] of its weights, ROUNDS [2];
# SDXL at XL_BUDGETS [0.5 0.25], XL_ROUNDS [1]; pinned params, reserve 0; the resident step
# beside them. Runs start only until DEADLINE [540] s after the call began. JSON lines in
# $OUT/results.jsonl. Run from the checkout root with stage/ as for streaming_sweep.sh
# (stage/mod/ carrying the module saved by an earlier call).
CALL_T0=$(date +%s)
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
late() { (( $(date +%s) - CALL_T0 > ${DEADLINE:-540} )) && echo "deadline: skipping $1"; }
device_header
for m in ${MODELS-sd15 sdxl}; do
  [[ $m == sdxl ]] && export STEPS=6
  late $m && break
  bench_model $m
  budgets=${SD15_BUDGETS-0.75 0.5 0.25}; rounds=${ROUNDS-2}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5 0.25} && rounds=${XL_ROUNDS-1}
  for r in $(seq $rounds); do
    for f in $budgets; do
      late $m-$f && break 2
      ab_one $m-$f-aware-r$r "${W[@]}" --max-vram $f --compute-aware-residency on
      ab_one $m-$f-equal-r$r "${W[@]}" --max-vram $f --compute-aware-residency off
    done
  done
  rm -rf /tmp/w-$m
done
echo "done in $(($(date +%s)-CALL_T0)) s"
