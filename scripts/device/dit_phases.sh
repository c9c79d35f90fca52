#!/usr/bin/env bash
# Run from the checkout root with stage/ holding sd-bench(.xz), xtask and ggml.tgz (see
# stage_e2e.sh); diffusers wheels in .whl/. Like dit_run.sh, in phases so that a large
# model's measurements can span two device calls on a warm machine (the CUDA module and the
# written weights stay in /tmp between them):
#   PHASES="resident 24 q8_0" CFG=qwen-image bash scripts/device/dit_phases.sh $OUT
# Phases: `resident` (weights on the device), a number N (params pinned in RAM, budget N GiB),
# `q8_0` / `q4_K` (resident, linear weights converted when loaded), `peer` (diffusers bf16),
# `rm` (deletes the written weights). CFG=qwen25vl-7b measures Qwen-Image's text encoder.
set -uo pipefail
OUT=${1:?}
source "$(dirname "$0")/stage_module.sh"
CFG=${CFG:-qwen-image}
run() { local label=$1; shift; echo "[$(($(date +%s)-T0))s] $label"; timeout ${RUN_TIMEOUT:-200} "$B" "$@" 2>"$OUT/$label.err" | grep '^{' | sed "s/^{/{\"label\":\"$label\",/" | tee -a "$OUT/dit.jsonl" | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); t=r.get("last_step_timing_ms") or {}
    print(r["label"], {k: r.get(k) for k in ("step_ms_median","step_ms_min","h2d_bytes_per_step","segments","peak_device_used_bytes","budget_bytes","weight_bytes","gib_per_s","output_finite","setup_and_first_step_s")}, "timing", t)'; tail -2 "$OUT/$label.err"; }
W=/tmp/w-$CFG
if [[ ! -f $W/unet.safetensors ]]; then
  run copy-bw copy-bw --backend CUDA0 --mib 1024
  tw=$(date +%s); "$B" write-weights $W --config $CFG | tail -1; echo "weights written in $(($(date +%s)-tw)) s"
fi
for ph in ${PHASES:-resident}; do
  # DEADLINE (seconds since the start): later phases are skipped, so one call ends in time.
  if (( $(date +%s) - T0 > ${DEADLINE:-100000} )); then echo "SKIP $CFG $ph (past DEADLINE)"; continue; fi
  case $ph in
    resident) run $CFG-resident unet --config $CFG --weights $W/unet.safetensors --backend CUDA0 --params device --steps 3 ;;
    q8_0|q4_K) run $CFG-$ph unet --config $CFG --weights $W/unet.safetensors --backend CUDA0 --params device --steps 3 --type $ph ;;
    peer)
      echo "[$(($(date +%s)-T0))s] diffusers"
      if ls $ROOT/.whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ROOT/.whl/*.whl && export PYTHONPATH=/tmp/site
      fi
      timeout ${PEER_TIMEOUT:-200} env PYTHONUNBUFFERED=1 python3 scripts/bench/dit_step_diffusers.py --model $CFG --dtype bf16 --reps 4 2>&1 | grep -v Warning | tail -6 | tee -a "$OUT/peer.txt" ;;
    rm) rm -rf $W ;;
    *) run $CFG-${ph}g unet --config $CFG --weights $W/unet.safetensors --backend CUDA0 --params pinned --max-vram $((ph << 30)) --steps 3 ;;
  esac
done
echo "done in $(($(date +%s)-T0)) s"
