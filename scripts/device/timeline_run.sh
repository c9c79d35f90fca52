#!/bin/bash
# Timelines of budgeted steps on the GPU (eighteenth session, issue 19): `sd-bench unet
# --timeline on` (when each segment was prepared, launched and done on the device, and
# when each transfer thread job copied), SD1.5 at SD15_BUDGETS [0.75 0.5 0.25] of its
# weights and SDXL at XL_BUDGETS [0.5] (MODELS [sd15 sdxl]), each beside the same run
# with the timeline off (the watcher thread must not change the step); pinned params,
# reserve 0, the resident step first. Summaries by scripts/device/timeline.py. Runs start
# only until DEADLINE [540] s after the call began. JSON lines in $OUT/results.jsonl. Run
# from the checkout root with stage/ as for streaming_sweep.sh.
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
  ab_one $m-resident-timeline "${W[@]}" --params device --timeline on
  budgets=${SD15_BUDGETS-0.75 0.5 0.25}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5}
  for f in $budgets; do
    late $m-$f && break
    ab_one $m-$f-timeline "${W[@]}" --max-vram $f --timeline on
    ab_one $m-$f "${W[@]}" --max-vram $f
    tail -2 $OUT/results.jsonl | head -1 | python3 scripts/device/timeline.py --segments
  done
  rm -rf /tmp/w-$m
done
echo "done in $(($(date +%s)-CALL_T0)) s"
