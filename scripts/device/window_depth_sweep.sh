#!/bin/bash
# A sweep on the GPU: the staging pool's streaming window (`--stream-window W`, WINDOWS
# [3 4 5]) against the segments queued on the device (`--segments-in-flight N`, FLIGHTS
# [2 3]): SD1.5 at SD15_BUDGETS [0.75 0.5] and SDXL at XL_BUDGETS [0.5 0.25] of their
# weights, ROUNDS [1], pinned params, reserve 0 (SDXL 6 steps); the resident steps and the
# pinned copy bandwidth beside them. JSON lines in $OUT/results.jsonl. Run from the checkout
# root with stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
sweep() {
  local tag=$1; shift
  for r in $(seq ${ROUNDS-1}); do
    for f in $BUDGETS; do
      for n in ${FLIGHTS-2 3}; do
        for w in ${WINDOWS-3 4 5}; do
          ab_one $tag-$f-w$w-f$n-r$r "$@" --max-vram $f --stream-window $w --segments-in-flight $n
        done
      done
    done
  done
}
bench_model sd15
BUDGETS=${SD15_BUDGETS-0.75 0.5} sweep sd15 "${W[@]}"
rm -rf /tmp/w-sd15
STEPS=6 bench_model sdxl
STEPS=6 BUDGETS=${XL_BUDGETS-0.5 0.25} sweep sdxl "${W[@]}"
rm -rf /tmp/w-sdxl
echo "done in $(($(date +%s)-T0)) s"
