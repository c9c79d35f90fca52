#!/bin/bash
# Where the host waits for prefetched weights, per segment, on the GPU: SD1.5 at
# SD15_BUDGETS [0.75 0.5] of its weights and SDXL at XL_BUDGETS [0.5] (`sd-bench unet`'s
# last_step_segments: index, weight MB, prefetched, ms waited, segments queued ahead),
# pinned params, reserve 0. JSON lines in $OUT/results.jsonl. Run from the checkout root
# with stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
for m in sd15 sdxl; do
  [[ $m == sdxl ]] && export STEPS=4
  bench_model $m
  budgets=${SD15_BUDGETS-0.75 0.5}; [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5}
  for f in $budgets; do
    ab_one $m-$f "${W[@]}" --max-vram $f
    tail -1 $OUT/results.jsonl | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['label'], d['last_step_segments'])"
  done
  rm -rf /tmp/w-$m
done
echo "done in $(($(date +%s)-T0)) s"
