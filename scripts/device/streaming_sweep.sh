#!/bin/bash
# One device call for issue 19 (streaming at the link's speed): the SD1.5 and SDXL UNet steps
# resident and under --max-vram budgets (sd-bench, pinned params), side by side with
# diffusers resident and with its group offloading (leaf and block level, CUDA streams), plus
# `sd` end to end (weights straight to the device against --offload-to-cpu, and --max-vram).
# Run from the checkout root with stage/ holding sd.xz, sd-bench.xz, random_sd15.py,
# compare.py and mod/libggml-cuda.so.xz.* (scripts/device/stage_module.sh), .whl/ the
# diffusers wheel. Results: $OUT/results.jsonl (one JSON object per run, tagged `label`,
# `model`), $OUT/logs.tgz.
#
# environment (set empty: none): PARTS [sd15,e2e,sdxl], BUDGETS [0.75 0.5 0.25 0.1], XL_BUDGETS [0.5 0.25 0.1],
# RESERVES [measured 0] (the runtime reserve: measured as `sd` does, or 0 = the engine's own
# allocations only, the way torch's peak counts), STEPS [10], DEADLINE [500] seconds,
# DIFFUSERS [none leaf block] (the SD1.5 peer's offload modes);
# part `deep`: SD1.5 resident, bare, then DEPTH_BUDGETS [0.75 0.5 0.25] x DEPTHS [1 2 all]
# (`sd-bench --prefetch-depth`, reserve 0, pinned; `all`: the default, as far as there is
# room) and without the resident set, the copy stream at 0.5, and diffusers leaf offload;
# part `deepxl`: the same for SDXL at XL_BUDGETS, with diffusers XL_DIFFUSERS [none leaf].
R=$(pwd)
source scripts/device/stage_module.sh >/dev/null 2>&1
PARTS=${PARTS:-sd15,e2e,sdxl}
BUDGETS=${BUDGETS-0.75 0.5 0.25 0.1}
XL_BUDGETS=${XL_BUDGETS-0.5 0.25 0.1}
RESERVES=${RESERVES-measured 0}
STEPS=${STEPS:-10}
DEADLINE=${DEADLINE:-500}
L=/tmp/logs
mkdir -p $L
RES=$OUT/results.jsonl
: >$RES
part() { [[ ",$PARTS," == *",$1,"* ]]; }
el() { echo $(($(date +%s) - T0)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $L/env.txt
# run LABEL MODEL CMD...: one JSON line from CMD's stdout, tagged, into results.jsonl; the
# device's peak memory.used (nvidia-smi every 50 ms, minus idle) added as smi_peak_mib.
run() {
  local label=$1 model=$2; shift 2
  if (($(el) > DEADLINE)); then echo "[$(el)s] SKIP $label"; return; fi
  local idle; idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 >/tmp/mem-$label 2>/dev/null &
  local smi=$!
  timeout 120 "$@" >$L/$label.out 2>$L/$label.err
  local rc=$?
  kill $smi; wait $smi 2>/dev/null
  local peak; peak=$(sort -n /tmp/mem-$label | tail -1)
  python3 - $label $model $rc $((${peak:-0} - idle)) $L/$label.out <<'PY' | tee -a $RES
import json, sys
label, model, rc, smi, path = sys.argv[1:6]
lines = [l for l in open(path) if l.startswith("{")]
d = json.loads(lines[-1]) if lines else {}
d.update(label=label, model=model, rc=int(rc), smi_peak_mib=int(smi))
t = d.get("last_step_timing_ms") or {}
print(json.dumps(d))
print(f"# {label}: step {d.get('step_ms_median')} segs {d.get('segments')} pre {d.get('prefetched')} ahead {d.get('max_prefetches_ahead')} "
      f"h2d {d.get('h2d_bytes_per_step')} peak {d.get('device_used_peak_bytes')} budget {d.get('budget_bytes')} "
      f"smi {smi} " + " ".join(f"{k}={v:.1f}" for k, v in t.items()), file=sys.stderr)
PY
  ((rc == 0)) || tail -3 $L/$label.err
}
run copy-bw - $B copy-bw --backend CUDA0 --mib 1024
sweep() { # MODEL WEIGHTS BUDGETS...
  local m=$1 w=$2; shift 2
  run $m-resident $m $B unet --config $m --weights $w --backend CUDA0 --params device --steps 20
  run $m-direct $m $B unet --config $m --weights $w --backend CUDA0 --direct on --steps 20
  # ggml's CUDA graphs replay a graph computed again unchanged (same tensors, same
  # addresses): the bare graph gets them, the engine's rebuilt graphs do not.
  run $m-direct-nographs $m env GGML_CUDA_DISABLE_GRAPHS=1 $B unet --config $m --weights $w --backend CUDA0 --direct on --steps 20
  run $m-resident-nographs $m env GGML_CUDA_DISABLE_GRAPHS=1 $B unet --config $m --weights $w --backend CUDA0 --params device --steps 20
  run $m-resident-noreuse $m $B unet --config $m --weights $w --backend CUDA0 --params device --steps 20 --reuse-graphs off
  for f in "$@"; do
    for rr in $RESERVES; do
      local ra=(); [[ $rr == measured ]] || ra=(--runtime-reserve $rr)
      run $m-$f-pinned-r$rr $m $B unet --config $m --weights $w --backend CUDA0 --params pinned --max-vram $f --steps $STEPS "${ra[@]}"
    done
  done
  run $m-0.5-pinned-r0-async $m $B unet --config $m --weights $w --backend CUDA0 --params pinned --max-vram 0.5 --steps $STEPS --runtime-reserve 0 --async-upload on
  run $m-0.5-disk-r0 $m $B unet --config $m --weights $w --backend CUDA0 --params disk --max-vram 0.5 --steps $STEPS --runtime-reserve 0
}
# deep_sweep MODEL WEIGHTS BUDGETS...: resident, bare, then per budget the prefetch depths
# (DEPTHS [1 2 all]; `all`: the default, as far as there is room) and the default without
# the resident set (`-nores`), pinned params, runtime reserve 0.
deep_sweep() {
  local m=$1 w=$2; shift 2
  run $m-resident $m $B unet --config $m --weights $w --backend CUDA0 --params device --steps 20
  run $m-direct $m $B unet --config $m --weights $w --backend CUDA0 --direct on --steps 20
  for f in "$@"; do
    for d in ${DEPTHS-1 2 all}; do
      da=(); [[ $d == all ]] || da=(--prefetch-depth $d)
      run $m-$f-pinned-r0-d$d $m $B unet --config $m --weights $w --backend CUDA0 --params pinned --max-vram $f --steps $STEPS --runtime-reserve 0 "${da[@]}"
    done
    run $m-$f-pinned-r0-dall-nores $m $B unet --config $m --weights $w --backend CUDA0 --params pinned --max-vram $f --steps $STEPS --runtime-reserve 0 --resident-set off
  done
}
if part deep; then
  W=/tmp/w15; $B write-weights $W --config sd15 >/dev/null
  deep_sweep sd15 $W/unet.safetensors ${DEPTH_BUDGETS-0.75 0.5 0.25}
  run sd15-0.5-pinned-r0-async sd15 $B unet --config sd15 --weights $W/unet.safetensors --backend CUDA0 --params pinned --max-vram 0.5 --steps $STEPS --runtime-reserve 0 --async-upload on
  for o in ${DIFFUSERS-leaf}; do
    run sd15-diffusers-$o sd15 env PYTHONUNBUFFERED=1 python3 scripts/device/diffusers_unet.py $W/unet.safetensors --offload $o --iters 20 --warmup 3
  done
  rm -rf $W
fi
if part deepxl; then
  W=/tmp/wxl; $B write-weights $W --config sdxl >/dev/null
  deep_sweep sdxl $W/unet.safetensors ${XL_BUDGETS-0.5 0.25 0.1}
  rm -rf $W
  for o in ${XL_DIFFUSERS-none leaf}; do
    run sdxl-diffusers-$o sdxl env PYTHONUNBUFFERED=1 python3 scripts/device/diffusers_unet.py - --model sdxl --offload $o --iters 10 --warmup 2
  done
fi
if part sd15; then
  W=/tmp/w15; $B write-weights $W --config sd15 >/dev/null
  sweep sd15 $W/unet.safetensors $BUDGETS
  for o in ${DIFFUSERS-none leaf block}; do
    run sd15-diffusers-$o sd15 env PYTHONUNBUFFERED=1 python3 scripts/device/diffusers_unet.py $W/unet.safetensors --offload $o --iters 20 --warmup 3
  done
  rm -rf $W
fi
if part e2e; then
  xz -d -k -f $S/sd.xz && chmod +x $S/sd
  CK=/tmp/sd15-random.safetensors
  python3 $S/random_sd15.py $CK --names crates/sd-formats/tests/fixtures/names >/dev/null
  C=(-m $CK -p "a photograph of an astronaut riding a horse" -W 512 -H 512 --cfg-scale 7 --steps 12 -s 42 --backend CUDA0 -v)
  e2e() { local label=$1; shift; local t0; t0=$(date +%s.%N); run $label sd15 "$@"; python3 -c "import sys,time; print(f'# {sys.argv[1]} wall {time.time()-float(sys.argv[2]):.2f} s')" $label $t0 | tee -a $L/e2e.txt; }
  e2e sd-direct $S/sd "${C[@]}" -o /tmp/direct.png
  e2e sd-offload $S/sd "${C[@]}" --offload-to-cpu -o /tmp/offload.png
  e2e sd-vram-1.2 $S/sd "${C[@]}" --max-vram 1.2 -o /tmp/v12.png
  # bf16 weights on the GPU (the convolutions' kernels bf16: ggml's im2col in f32 there).
  e2e sd-bf16 $S/sd "${C[@]}" --type bf16 -o /tmp/bf16.png
  python3 $S/compare.py /tmp/direct.png /tmp/offload.png | tee -a $L/e2e.txt
  python3 $S/compare.py /tmp/direct.png /tmp/bf16.png | tee -a $L/e2e.txt
  for f in sd-direct sd-offload sd-vram-1.2 sd-bf16; do
    sed 's/\x1b\[[0-9;]*m//g' $L/$f.err | grep -E "completed|steps in" | cut -c1-200 | tail -3 | tee -a $L/e2e.txt
  done
fi
if part sdxl; then
  W=/tmp/wxl; $B write-weights $W --config sdxl >/dev/null
  sweep sdxl $W/unet.safetensors $XL_BUDGETS
  rm -rf $W
  for o in none leaf block; do
    run sdxl-diffusers-$o sdxl env PYTHONUNBUFFERED=1 python3 scripts/device/diffusers_unet.py - --model sdxl --offload $o --iters 10 --warmup 2
  done
fi
echo "[$(el)s] done"
tar czf $OUT/logs.tgz -C /tmp logs
python3 scripts/device/summarize_sweep.py $RES $OUT/summary.md $OUT/runs.jsonl >/dev/null 2>&1 || echo "summary failed"
