#!/bin/bash
# The first call of the twenty-second session (issue 19): uploads on the copy stream
# (`--async-upload on`: a segment is queued behind its upload's event, so the host queues
# its kernels while the copy runs) against transfer threads (the default: the host waits
# for the copy, then queues), and segments refined for the resident set
# (`--refine-for-residency on --segment-weight-share 16`), each alone and together; SD1.5 at
# BUDGETS [0.75 0.5 0.25], ROUNDS [2] interleaved, then timelines of the copy-stream runs and
# SDXL at 0.5 / 0.25 both ways. Run from the checkout root with stage/ (sd-bench.xz and the
# module in stage/mod/).
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-420}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
bench_model sd15
ab_one sd15-bare "${W[@]}" --params device --direct on
R=(--refine-for-residency on --segment-weight-share 16)
A=(--async-upload on)
for round in $(seq ${ROUNDS:-2}); do
  for f in ${BUDGETS:-0.75 0.5 0.25}; do
    late sd15-$f && break 2
    ab_one sd15-$f-base "${W[@]}" --max-vram $f
    ab_one sd15-$f-async "${W[@]}" --max-vram $f "${A[@]}"
    ab_one sd15-$f-share16 "${W[@]}" --max-vram $f "${R[@]}"
    ab_one sd15-$f-async-share16 "${W[@]}" --max-vram $f "${A[@]}" "${R[@]}"
  done
done
for f in 0.75 0.5 0.25; do
  late sd15-timeline-$f && break
  ab_one sd15-$f-async-timeline "${W[@]}" --max-vram $f "${A[@]}" --timeline on
  tail -1 $OUT/results.jsonl | python3 scripts/device/timeline.py --segments >>$OUT/timelines.txt 2>&1
  tail -1 $OUT/results.jsonl | python3 scripts/device/timeline.py 2>&1 | head -1
done
rm -rf /tmp/w-sd15
export STEPS=6
late sdxl || {
  bench_model sdxl
  for f in 0.5 0.25; do
    late sdxl-$f && break
    ab_one sdxl-$f-base "${W[@]}" --max-vram $f
    ab_one sdxl-$f-async "${W[@]}" --max-vram $f "${A[@]}"
    ab_one sdxl-$f-share16 "${W[@]}" --max-vram $f "${R[@]}"
  done
}
echo "done in $(($(date +%s)-CALL_T0)) s"
