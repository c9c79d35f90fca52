#!/bin/bash
# A/B on the GPU of this session's streaming changes, `sd-bench unet` through the Runtime
# (stage/sd-bench): the defaults (next-pass prefetch on, device memory reports reused)
# against each turned off (`--next-pass-prefetch off`, SD_BENCH_MEMORY_REUSE=0), and at 0.5
# deeper queues (`--segments-in-flight 3`) and the copy stream (`--async-upload on`). SD1.5
# at SD15_BUDGETS [0.75 0.5 0.25] of its weights, ROUNDS [2] interleaved rounds; SDXL at
# XL_BUDGETS [0.5 0.25], XL_ROUNDS [1]; pinned params, reserve 0; the resident step and the
# bare graph beside them. JSON lines in $OUT/results.jsonl. Run from the checkout root
# with stage/ as for streaming_sweep.sh. (The memory-report reuse was reverted after its run:
# SD_BENCH_MEMORY_REUSE is ignored now, its rows equal the defaults.)
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
for m in sd15 sdxl; do
  [[ $m == sdxl ]] && export STEPS=6
  bench_model $m
  ab_one $m-bare "${W[@]}" --params device --direct on
  budgets=${SD15_BUDGETS-0.75 0.5 0.25}; rounds=${ROUNDS-2}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5 0.25} && rounds=${XL_ROUNDS-1}
  for r in $(seq $rounds); do
    for f in $budgets; do
      ab_one $m-$f-default-r$r "${W[@]}" --max-vram $f
      ab_one $m-$f-nonext-r$r "${W[@]}" --max-vram $f --next-pass-prefetch off
      SD_BENCH_MEMORY_REUSE=0 ab_one $m-$f-noreuse-r$r "${W[@]}" --max-vram $f
      if [[ $m == sd15 && $f == 0.5 ]]; then
        ab_one $m-$f-inflight3-r$r "${W[@]}" --max-vram $f --segments-in-flight 3
        ab_one $m-$f-copystream-r$r "${W[@]}" --max-vram $f --async-upload on
      fi
    done
  done
  rm -rf /tmp/w-$m
done
echo "done in $(($(date +%s)-T0)) s"
