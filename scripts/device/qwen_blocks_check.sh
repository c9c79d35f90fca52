#!/bin/bash
# A short device call (2026-12-05): the 12-block Qwen-Image (same widths as the 60-block
# model, `sd-bench write-weights --blocks 12`) at 4.8 and 1.6 GiB, the budgets of 24 and 8 GiB
# scaled, to check prefetching and the device peak against the budget; then where `sd`'s
# resident CUDA run spends its time (the engine's timing of each execution). Run from the
# checkout root with stage/ as for dit_phases.sh plus sd.xz, random_sd15.py.
R=$(pwd); OUT_KEEP=$OUT; OUT=/tmp/q5
source scripts/device/stage_module.sh >/dev/null 2>&1
OUT=$OUT_KEEP; mkdir -p /tmp/q5
export RUST_LOG=sd_residency=info
W=/tmp/w-q12
$B write-weights $W --config qwen-image --blocks 12 | tail -c 100; echo
for g in 4.8 1.6; do
  timeout 60 $B unet --config qwen-image --weights $W/unet.safetensors --backend CUDA0 --steps 3 --params pinned --max-vram $(python3 -c "print(int($g*2**30))") > /tmp/q5/q12-$g.json 2> /tmp/q5/q12-$g.err
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], {k: r.get(k) for k in ('step_ms_median','segments','prefetched','h2d_bytes_per_step','device_used_peak_bytes','budget_bytes','runtime_reserve_bytes','staging_pool_bytes')}, r.get('last_step_timing_ms'))" /tmp/q5/q12-$g.json $g
  grep -h "temporaries" /tmp/q5/q12-$g.err | cut -c1-250 | head -2
done
xz -d -k -f stage/sd.xz && chmod +x stage/sd
python3 stage/random_sd15.py /tmp/ck.safetensors --names crates/sd-formats/tests/fixtures/names > /dev/null
RUST_LOG=sd_exec::task=debug timeout 60 stage/sd -m /tmp/ck.safetensors -p "a photograph of an astronaut riding a horse" -W 512 -H 512 --cfg-scale 7 --steps 12 -s 42 --backend CUDA0 -o /tmp/q5/e2e.png -v > /tmp/q5/sd-e2e.log 2>&1
sed 's/\x1b\[[0-9;]*m//g' /tmp/q5/sd-e2e.log | grep -E "execution timing" | sed 's/.*task=/task=/' | cut -c1-260 | head -4
sed 's/\x1b\[[0-9;]*m//g' /tmp/q5/sd-e2e.log | grep -E "execution timing" | sed 's/.*task=/task=/' | cut -c1-260 | tail -3
sed 's/\x1b\[[0-9;]*m//g' /tmp/q5/sd-e2e.log | grep -E "steps|saved" | tail -3
tar czf $OUT/logs5.tgz -C /tmp q5
