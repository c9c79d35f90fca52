#!/usr/bin/env bash
# Run from the checkout root with stage/ holding sd-bench(.xz), xtask and ggml.tgz (see
# stage_e2e.sh); diffusers wheels in .whl/. One device call: sd-bench check (CUDA vs CPU, async uploads included), then the async
# upload A/B: SD1.5 and SDXL UNet steps with pinned params under --max-vram 0.5 and 0.35,
# --async-upload on/off interleaved (two reps at 0.5), after a resident run (the floor).
set -uo pipefail
OUT=${1:?}
source "$(dirname "$0")/stage_module.sh"
timeout 60 "$B" check --backend CUDA0 2>&1 | grep '^{' | tail -3
run() { local label=$1; shift; echo "[$(($(date +%s)-T0))s] $label"; timeout 100 "$B" "$@" 2>"$OUT/$label.err" | grep '^{' | sed "s/^{/{\"label\":\"$label\",/" | tee -a "$OUT/ab.jsonl" | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); t=r.get("last_step_timing_ms") or {}
    print(r["label"], "step_ms", round(r["step_ms_median"],1), "h2d", r["h2d_bytes_per_step"], "segs", r["segments"], "pref", r.get("prefetched"), "peak", r["peak_device_used_bytes"], "budget", r.get("budget_bytes"), "copy_stream", r.get("copy_stream"), "rms", r.get("output_rms"), "timing", {k: round(v,1) for k,v in t.items()})'; tail -1 "$OUT/$label.err"; }
for cfg in ${CONFIGS:-sdxl sd15}; do
  W=/tmp/w-$cfg
  "$B" write-weights $W --config $cfg > /dev/null 2>&1
  run "$cfg-resident" unet --config $cfg --weights $W/unet.safetensors --backend CUDA0 --params device --steps 6
  for rep in a b; do
    for au in on off; do
      run "$cfg-0.5-async-$au-$rep" unet --config $cfg --weights $W/unet.safetensors --backend CUDA0 --params pinned --max-vram 0.5 --steps 6 --async-upload $au
    done
  done
  for au in on off; do
    run "$cfg-0.35-async-$au" unet --config $cfg --weights $W/unet.safetensors --backend CUDA0 --params pinned --max-vram 0.35 --steps 6 --async-upload $au
  done
  rm -rf $W
done
echo "done in $(($(date +%s)-T0)) s"
