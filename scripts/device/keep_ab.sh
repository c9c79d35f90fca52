#!/bin/bash
# A/B on the GPU of the nineteenth session's changes (issue 19): `sd-bench unet` with the
# step's graph kept from step to step (`--keep-graph on`, as `sd` now runs: nothing built,
# captured or planned after the first step) against built again at every step (`off`), and
# under budgets the prefetch switches: deeper next-step prefetch (`--next-pass-segments
# NP`), deep prefetches that may evict later segments' weights (`--evict-later-uses on`),
# more prefetches queued per segment (`--prefetches-per-segment PP`), all with timelines;
# and the resident step and bare graph with ggml's direct convolution (`--conv-direct on`).
# MODELS [sd15 sdxl]; SD1.5 at SD15_BUDGETS [0.5 0.75 0.25], SDXL at XL_BUDGETS [0.5];
# VARIANTS picks the budgeted variants [base np both all; also: evict]; pinned params,
# reserve 0; the bare graph and the resident step beside them. Runs start only until
# DEADLINE [480] s after the call began (the nineteenth session ran it with 150: 100 s). JSON lines in $OUT/results.jsonl, summaries by
# scripts/device/timeline.py. Run from the checkout root with stage/ as for
# streaming_sweep.sh.
CALL_T0=$(date +%s)
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
late() { (( $(date +%s) - CALL_T0 > ${DEADLINE:-480} )) && echo "deadline: skipping $1"; }
NP=${NP:-8}; PP=${PP:-4}
variant() {
  case $1 in
    off) echo --keep-graph off ;;
    base) echo ;;
    np) echo --next-pass-segments $NP ;;
    evict) echo --evict-later-uses on ;;
    both) echo --next-pass-segments $NP --evict-later-uses on ;;
    all) echo --next-pass-segments $NP --evict-later-uses on --prefetches-per-segment $PP ;;
  esac
}
device_header
for m in ${MODELS-sd15 sdxl}; do
  [[ $m == sdxl ]] && export STEPS=6
  late $m && break
  bench_model $m
  ab_one $m-resident-off "${W[@]}" --params device --keep-graph off
  ab_one $m-bare "${W[@]}" --params device --direct on
  ab_one $m-resident-conv "${W[@]}" --params device --conv-direct on
  ab_one $m-bare-conv "${W[@]}" --params device --direct on --conv-direct on
  budgets=${SD15_BUDGETS-0.5 0.75 0.25}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5}
  for f in $budgets; do
    for v in off ${VARIANTS-base np both all}; do
      late $m-$f-$v && break 2
      ab_one $m-$f-$v "${W[@]}" --max-vram $f --timeline on $(variant $v)
    done
  done
  rm -rf /tmp/w-$m
done
python3 scripts/device/timeline.py $OUT/results.jsonl
echo "done in $(($(date +%s)-CALL_T0)) s"
