#!/bin/bash
# The first call of the twenty-first session (issue 19): builds ggml's CUDA module (saved to
# $OUT for the next calls), checks the build's flash attention that reads Q through a
# permuted view (SD1.5 bare graph, resident step, output against diffusers' f32 UNet), takes
# timelines of SD1.5's budgeted steps (0.75 / 0.5 / 0.25 of its weights; per-segment tables
# in $OUT/timelines.txt) and times SDXL's bare graph with flash attention on and off.
# Run from the checkout root with stage/ (sd-bench.xz, xtask, ggml.tgz) and .whl/ carried.
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-500}
SAVE_MODULE=1 source scripts/device/stage_module.sh 2>&1 | tail -4
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
install_wheels
bench_model sd15
ab_one sd15-bare "${W[@]}" --params device --direct on
STEPS=2 ab_one sd15-dump "${W[@]}" --params device --dump /tmp/dump >/dev/null
PEER_TIMEOUT=120 PEER_CUT=700 peer sd15-parity /tmp/w-sd15/unet.safetensors --dump /tmp/dump --iters 30 --warmup 5
for f in 0.75 0.5 0.25; do
  late sd15-$f && break
  ab_one sd15-$f-timeline "${W[@]}" --max-vram $f --timeline on
  tail -1 $OUT/results.jsonl | python3 scripts/device/timeline.py --segments >>$OUT/timelines.txt 2>&1
  tail -1 $OUT/results.jsonl | python3 scripts/device/timeline.py 2>&1 | tail -8
done
late sd15-ab || ab_one sd15-0.25-deep "${W[@]}" --max-vram 0.25 --prefetches-per-segment 4 --next-pass-segments 8
late sd15-ab || ab_one sd15-0.25-div16 "${W[@]}" --max-vram 0.25 --band-divisor 16
rm -rf /tmp/w-sd15
export STEPS=6
late sdxl || {
  bench_model sdxl
  ab_one sdxl-bare "${W[@]}" --params device --direct on
  ab_one sdxl-bare-noflash "${W[@]}" --params device --direct on --flash-attn off
}
echo "done in $(($(date +%s)-CALL_T0)) s"
