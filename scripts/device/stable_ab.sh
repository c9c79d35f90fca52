#!/bin/bash
# A/B on the GPU of stable placement (fifteenth session, issue 19): `sd-bench unet` with
# `--stable-placement on --stable-cuts on` (streamed weights back at their staging-pool offsets,
# cuts in the cut-cache buffers they had the step before, so that ggml's CUDA backend
# replays each kept segment graph as a CUDA graph) against `off` (`--stable-placement off
# --stable-cuts off`: first fit; cut spares within the largest segment's live cuts), and with
# CUTS_ONLY=1 stable cuts alone (`--stable-placement off`), with NOGRAPHS=1 the resident, bare and
# stable runs again with ggml's CUDA graphs off, interleaved. MODELS [sd15 sdxl]; SD1.5 at
# SD15_BUDGETS [0.75 0.5 0.25 0.1] of its weights, ROUNDS [2]; SDXL at XL_BUDGETS
# [0.5 0.25], XL_ROUNDS [1]; pinned params, reserve 0; the bare graph and the resident
# step beside them. Runs start only until DEADLINE [540] s after the call began. JSON
# lines in $OUT/results.jsonl. Run from the checkout root with stage/ as for
# streaming_sweep.sh (SAVE_MODULE=1 returns the built module for stage/mod/).
CALL_T0=$(date +%s)
# Built (or unpacked) in a subshell to show only its last lines, then sourced for its settings.
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
late() { (( $(date +%s) - CALL_T0 > ${DEADLINE:-540} )) && echo "deadline: skipping $1"; }
device_header
for m in ${MODELS-sd15 sdxl}; do
  [[ $m == sdxl ]] && export STEPS=6
  late $m && break
  bench_model $m
  ab_one $m-bare "${W[@]}" --params device --direct on
  # NOGRAPHS=1: the resident and bare steps again with ggml's CUDA graphs off (GGML_CUDA_DISABLE_GRAPHS).
  if [[ -n ${NOGRAPHS-} ]]; then
    GGML_CUDA_DISABLE_GRAPHS=1 ab_one $m-resident-nographs "${W[@]}" --params device
    GGML_CUDA_DISABLE_GRAPHS=1 ab_one $m-bare-nographs "${W[@]}" --params device --direct on
  fi
  budgets=${SD15_BUDGETS-0.75 0.5 0.25 0.1}; rounds=${ROUNDS-2}
  [[ $m == sdxl ]] && budgets=${XL_BUDGETS-0.5 0.25} && rounds=${XL_ROUNDS-1}
  for r in $(seq $rounds); do
    for f in $budgets; do
      late $m-$f && break 2
      ab_one $m-$f-stable-r$r "${W[@]}" --max-vram $f --stable-placement on --stable-cuts on
      ab_one $m-$f-moving-r$r "${W[@]}" --max-vram $f --stable-placement off --stable-cuts off
      [[ -n ${NOGRAPHS-} ]] && GGML_CUDA_DISABLE_GRAPHS=1 ab_one $m-$f-stable-nographs-r$r "${W[@]}" --max-vram $f --stable-placement on --stable-cuts on
      [[ -n ${CUTS_ONLY-} ]] && ab_one $m-$f-cutsonly-r$r "${W[@]}" --max-vram $f --stable-cuts on
    done
  done
  rm -rf /tmp/w-$m
done
echo "done in $(($(date +%s)-CALL_T0)) s"
