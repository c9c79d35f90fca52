#!/bin/bash
# A/B on the GPU: `sd-bench unet` through the Runtime `sd` uses (stage/sd-bench, this build:
# the step's graph built at each call, the model in a runtime session) against the build
# that drove the engine directly with one prebuilt task (stage/sd-bench-old). SD1.5 resident
# and at SD15_BUDGETS [0.75 0.5 0.25] of its weights, ROUNDS [2] interleaved rounds; SDXL
# resident and at XL_BUDGETS [0.5 0.25], XL_ROUNDS [1]; pinned params, reserve 0; the bare
# graph (`--direct on`) and the pinned copy bandwidth beside them. JSON lines in
# $OUT/results.jsonl. Run from the checkout root with stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
[[ -f $S/sd-bench-old || ! -f $S/sd-bench-old.xz ]] || xz -d -k $S/sd-bench-old.xz
chmod +x $S/sd-bench-old
NEW=$B OLD=$S/sd-bench-old
device_header
lscpu | grep "Model name"; echo "AMX: $(grep -o -w "amx[a-z_0-9]*" /proc/cpuinfo | sort -u | tr "\n" " ")"
# `pair MODEL LABEL ARGS...`: the old build, then this one, same arguments.
pair() {
  local m=$1 l=$2; shift 2
  B=$OLD ab_one $m-$l-engine "${W[@]}" "$@"
  B=$NEW ab_one $m-$l-runtime "${W[@]}" "$@"
}
for m in sd15 sdxl; do
  [[ $m == sdxl ]] && export STEPS=6
  bench_model $m
  ab_one $m-bare "${W[@]}" --params device --direct on
  budgets=${SD15_BUDGETS-0.75 0.5 0.25}; rounds=${ROUNDS-2}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5 0.25} && rounds=${XL_ROUNDS-1}
  for r in $(seq $rounds); do
    pair $m resident-r$r --params device
    for f in $budgets; do pair $m $f-r$r --max-vram $f; done
  done
  rm -rf /tmp/w-$m
done
echo "done in $(($(date +%s)-T0)) s"
