#!/bin/bash
# The third call of the twentieth session (issue 19): SD1.5's 40-wide heads through flash
# attention at width 64 (`--flash-pad on|off`), the convolutions' per-image products (no
# strided permute) and the 1x1 projections on tokens, against the build before them
# (stage/sd-bench-prev.xz: GEGLU as one op, bands) in the same call: bare graph, resident
# step, budgets; the outputs against diffusers' f32 UNet (`diffusers_unet.py --dump`);
# diffusers' resident step (50 iterations); SDXL. DEADLINE [520].
CALL_T0=$(date +%s); DEADLINE=${DEADLINE:-520}
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
source scripts/device/ab_run.sh
# Without the earlier build (the tree's 64 MiB), its runs are skipped; compare with the
# second call (band_ab2.sh).
PREV=/tmp/sd-bench-prev
[[ -f stage/sd-bench-prev.xz ]] && xz -d -c stage/sd-bench-prev.xz > $PREV && chmod +x $PREV
[[ -x $PREV ]] || PREV=/bin/false
device_header
bench_model sd15
B=$PREV ab_one sd15-prev-bare "${W[@]}" --params device --direct on
ab_one sd15-bare "${W[@]}" --params device --direct on
ab_one sd15-bare-nopad "${W[@]}" --params device --direct on --flash-pad off
B=$PREV ab_one sd15-prev-resident "${W[@]}" --params device
ab_one sd15-resident2 "${W[@]}" --params device
ab_one sd15-resident-nopad "${W[@]}" --params device --flash-pad off
for f in 0.5 0.25 0.75 0.2 0.15; do
  late sd15-$f && break
  ab_one sd15-$f "${W[@]}" --max-vram $f
  [[ $f == 0.5 || $f == 0.25 ]] && B=$PREV ab_one sd15-prev-$f "${W[@]}" --max-vram $f
done
if ! late diffusers && install_wheels; then
  for v in "res --params device" "q --max-vram 0.25"; do
    set -- $v; tag=$1; shift
    STEPS=2 ab_one sd15-dump-$tag "${W[@]}" "$@" --dump /tmp/dump-$tag >/dev/null
    PEER_TIMEOUT=150 PEER_CUT=700 peer sd15-parity-$tag /tmp/w-sd15/unet.safetensors --dump /tmp/dump-$tag --iters 50 --warmup 10
  done
fi
rm -rf /tmp/w-sd15
export STEPS=6
late sdxl || {
  bench_model sdxl
  B=$PREV ab_one sdxl-prev-resident "${W[@]}" --params device
  ab_one sdxl-bare "${W[@]}" --params device --direct on
  for f in 0.5 0.25; do
    late sdxl-$f && break
    ab_one sdxl-$f "${W[@]}" --max-vram $f
  done
}
echo "done in $(($(date +%s)-CALL_T0)) s"
