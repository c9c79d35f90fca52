#!/bin/bash
# A/B on the GPU of the resident-set cap search (seventeenth session, issue 19): the
# sd-bench of this checkout (stage/sd-bench.xz: the smallest cap below the window-th
# largest segment) against the one before the fix (stage/sd-bench-old.xz: no resident set
# whenever a window of the largest segment overfills the pool), interleaved, and the new
# one with `--stream-window 2`, with `--pool-sized-segments on` and with both. MODELS [sd15 sdxl];
# SD1.5 at SD15_BUDGETS [0.75 0.5] of its weights, ROUNDS [2]; SDXL at XL_BUDGETS [0.5
# 0.75], XL_ROUNDS [1]; pinned params, reserve 0; the resident step beside them. Runs start
# only until DEADLINE [540] s after the call began. JSON lines in $OUT/results.jsonl. Run
# from the checkout root with stage/ as for streaming_sweep.sh (stage/mod/ carrying the
# module saved by an earlier call). VARIANTS [new old window2 poolsized poolsized-window2]
# picks the runs of each budget and round.
CALL_T0=$(date +%s)
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
[[ -f $S/sd-bench-old ]] || xz -d -k $S/sd-bench-old.xz
chmod +x $S/sd-bench-old
NEW=$B
OLD=$S/sd-bench-old
late() { (( $(date +%s) - CALL_T0 > ${DEADLINE:-540} )) && echo "deadline: skipping $1"; }
device_header
for m in ${MODELS-sd15 sdxl}; do
  [[ $m == sdxl ]] && export STEPS=6
  late $m && break
  B=$NEW
  bench_model $m
  budgets=${SD15_BUDGETS-0.75 0.5}; rounds=${ROUNDS-2}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5 0.75} && rounds=${XL_ROUNDS-1}
  for r in $(seq $rounds); do
    for f in $budgets; do
      late $m-$f && break 2
      for v in ${VARIANTS-new old window2 poolsized poolsized-window2}; do
        case $v in
          new) B=$NEW ab_one $m-$f-new-r$r "${W[@]}" --max-vram $f ;;
          old) B=$OLD ab_one $m-$f-old-r$r "${W[@]}" --max-vram $f ;;
          window2) B=$NEW ab_one $m-$f-new-window2-r$r "${W[@]}" --max-vram $f --stream-window 2 ;;
          poolsized) B=$NEW ab_one $m-$f-new-poolsized-r$r "${W[@]}" --max-vram $f --pool-sized-segments on ;;
          poolsized-window2) B=$NEW ab_one $m-$f-new-poolsized-window2-r$r "${W[@]}" --max-vram $f --pool-sized-segments on --stream-window 2 ;;
        esac
      done
    done
  done
  rm -rf /tmp/w-$m
done
echo "done in $(($(date +%s)-CALL_T0)) s"
