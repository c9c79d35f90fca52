#!/usr/bin/env bash
# Run from the checkout root with stage/ holding sd-bench(.xz), xtask and ggml.tgz (see
# stage_e2e.sh); diffusers wheels in .whl/. One device call: the CUDA module (built unless a warm machine kept it), copy bandwidth,
# the SD3.5 Large MMDiT step (random f16 weights of the real size) resident and under
# 12 and 8 GiB budgets through sd-bench, then diffusers' SD3.5 Large step (bf16) resident.
set -uo pipefail
OUT=${1:?}
source "$(dirname "$0")/stage_module.sh"
run() { local label=$1; shift; echo "[$(($(date +%s)-T0))s] $label"; timeout ${RUN_TIMEOUT:-150} "$B" "$@" 2>"$OUT/$label.err" | grep '^{' | sed "s/^{/{\"label\":\"$label\",/" | tee -a "$OUT/dit.jsonl" | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); t=r.get("last_step_timing_ms") or {}
    print(r["label"], {k: r.get(k) for k in ("step_ms_median","step_ms_min","h2d_bytes_per_step","segments","peak_device_used_bytes","budget_bytes","weight_bytes","gib_per_s","output_finite","setup_and_first_step_s","flash_attn_head_dims")}, "timing", t)'; tail -2 "$OUT/$label.err"; }
timeout 60 "$B" check --backend CUDA0 2>&1 | grep '^{' | tail -2
run copy-bw copy-bw --backend CUDA0 --mib 1024
CFG=${CFG:-sd35-large}
W=/tmp/w-$CFG
if [[ ! -f $W/unet.safetensors ]]; then
  tw=$(date +%s); "$B" write-weights $W --config $CFG | tail -1; echo "weights written in $(($(date +%s)-tw)) s"
fi
run $CFG-resident unet --config $CFG --weights $W/unet.safetensors --backend CUDA0 --params device --steps 3
for gib in ${BUDGETS:-12 8}; do
  run $CFG-${gib}g unet --config $CFG --weights $W/unet.safetensors --backend CUDA0 --params pinned --max-vram $((gib << 30)) --steps 3
done
run $CFG-8g-sync-uploads unet --config $CFG --weights $W/unet.safetensors --backend CUDA0 --params pinned --max-vram $((8 << 30)) --steps 3 --async-upload off
[[ ${PEER:-} == none ]] && exit 0
echo "[$(($(date +%s)-T0))s] diffusers"
if ls $ROOT/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ROOT/.whl/*.whl && export PYTHONPATH=/tmp/site
fi
timeout ${PEER_TIMEOUT:-120} env PYTHONUNBUFFERED=1 python3 scripts/bench/dit_step_diffusers.py --model ${PEER:-sd35-large} --dtype bf16 --reps 4 2>&1 | grep -v Warning | tail -6 | tee "$OUT/peer.txt"
echo "done in $(($(date +%s)-T0)) s"
