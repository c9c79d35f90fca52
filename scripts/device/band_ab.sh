#!/bin/bash
# A/B on the GPU of the twentieth session's changes (issue 19): under a budget, large
# intermediates in bands (`--band-divisor 16`, the default: convolutions whose im2col
# exceeds budget/16 in row bands, UNet feed-forwards in token chunks; GEGLU one ggml op)
# against whole ops (`--band-divisor 0`), the smaller workspace leaving the staging pool
# the room; SD1.5 at budgets it could not run at before (0.2 and 0.15 of its weights), its
# output checked against diffusers' f32 UNet (`diffusers_unet.py --dump`), and diffusers'
# leaf-level group offload beside it. MODELS [sd15 sdxl]; SD15_BUDGETS [0.25 0.5 0.75],
# LOW_BUDGETS [0.2 0.15], XL_BUDGETS [0.5 0.25]; pinned params, reserve 0. Runs start only
# until DEADLINE [500] s after the call began. JSON lines in $OUT/results.jsonl, summaries by
# scripts/device/timeline.py. Run from the checkout root with stage/ (and .whl/ for
# diffusers) as for keep_ab.sh.
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-500}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
device_header
for m in ${MODELS-sd15 sdxl}; do
  [[ $m == sdxl ]] && export STEPS=6
  late $m && break
  bench_model $m
  ab_one $m-bare "${W[@]}" --params device --direct on
  budgets=${SD15_BUDGETS-0.25 0.5 0.75}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5 0.25}
  for f in $budgets; do
    for d in 16 0; do
      late $m-$f-$d && break 2
      ab_one $m-$f-bands$d "${W[@]}" --max-vram $f --band-divisor $d
    done
  done
  if [[ $m == sd15 ]]; then
    for f in ${LOW_BUDGETS-0.2 0.15}; do
      late $m-$f && break
      ab_one $m-$f-bands16 "${W[@]}" --max-vram $f --timeline on
    done
    # The banded output against diffusers' f32 UNet, and the resident one beside it.
    if ! late dumps && install_wheels; then
      for v in "res --params device" "band --max-vram 0.15"; do
        set -- $v; tag=$1; shift
        STEPS=2 ab_one $m-dump-$tag "${W[@]}" "$@" --dump /tmp/dump-$tag >/dev/null
        PEER_TIMEOUT=150 PEER_CUT=600 peer $m-parity-$tag /tmp/w-$m/unet.safetensors --dump /tmp/dump-$tag --iters 3 --warmup 1
      done
    fi
    late diffusers || DIFFUSERS=leaf diffusers_sd15 /tmp/w-$m/unet.safetensors
  fi
  rm -rf /tmp/w-$m
done
python3 scripts/device/timeline.py $OUT/results.jsonl
echo "done in $(($(date +%s)-CALL_T0)) s"
