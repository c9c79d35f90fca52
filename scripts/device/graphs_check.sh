#!/bin/bash
# Whether CUDA graph replays are what segment graphs lose (eighteenth session, issue 19):
# the SD1.5 resident step with ggml's CUDA graphs off (GGML_CUDA_DISABLE_GRAPHS=1) beside
# it with them on, and SD1.5 at SD15_BUDGETS [0.75 0.5] with `--stable-placement on
# --stable-cuts on` beside the defaults, all with `--timeline on`. JSON lines in
# $OUT/results.jsonl, summaries by scripts/device/timeline.py. Run from the checkout root
# with stage/ as for streaming_sweep.sh.
CALL_T0=$(date +%s)
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
bench_model sd15
ab_one sd15-resident-timeline "${W[@]}" --params device --timeline on
GGML_CUDA_DISABLE_GRAPHS=1 ab_one sd15-resident-nographs "${W[@]}" --params device --timeline on
for f in ${SD15_BUDGETS-0.75 0.5}; do
  ab_one sd15-$f-timeline "${W[@]}" --max-vram $f --timeline on
  ab_one sd15-$f-stable "${W[@]}" --max-vram $f --timeline on --stable-placement on --stable-cuts on
  GGML_CUDA_DISABLE_GRAPHS=1 ab_one sd15-$f-nographs "${W[@]}" --max-vram $f --timeline on
done
python3 scripts/device/timeline.py $OUT/results.jsonl
echo "done in $(($(date +%s)-CALL_T0)) s"
