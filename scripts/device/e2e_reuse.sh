#!/bin/bash
# `sd` end to end on the GPU: one random full-size SD1.5 checkpoint (random_sd15.py), 512x512,
# CFG 7, Euler, STEPS [12] steps, resident and under `--max-vram` VRAMS [1.2 0.8] GB (the UNet
# streamed in segments, its graphs kept from step to step), each image compared with the
# resident one (compare.py), `sd -v`'s timings; with stage/sd-old.xz (an earlier build) the
# same budgets run by it too, for the step time before. Run from the checkout root with
# stage/ as for streaming_sweep.sh (sd.xz instead of, or beside, sd-bench.xz).
source scripts/device/stage_module.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for b in sd sd-old; do [[ -f $S/$b.xz ]] && xz -d -k -f $S/$b.xz && chmod +x $S/$b; done
CK=/tmp/sd15-random.safetensors
python3 $S/random_sd15.py $CK --names crates/sd-formats/tests/fixtures/names >/dev/null
C=(-m $CK -p "a photograph of an astronaut riding a horse" -W 512 -H 512 --cfg-scale 7 --steps ${STEPS:-12} -s 42 --backend CUDA0 -v)
one() {
  local label=$1 bin=$2; shift 2
  local t0; t0=$(date +%s.%N)
  timeout 150 $S/$bin "${C[@]}" "$@" -o /tmp/$label.png >/tmp/$label.out 2>/tmp/$label.err
  local rc=$?
  echo "# $label rc $rc wall $(python3 -c "import sys,time; print(f'{time.time()-float(sys.argv[1]):.2f}')" $t0) s"
  sed 's/\x1b\[[0-9;]*m//g' /tmp/$label.err | grep -E "completed|steps in|segment|error|Error" | cut -c1-220 | tail -4
}
one direct sd
for v in ${VRAMS-1.2 0.8}; do
  one vram-$v sd --max-vram $v
  python3 $S/compare.py /tmp/direct.png /tmp/vram-$v.png
  [[ -x $S/sd-old ]] && one old-vram-$v sd-old --max-vram $v && python3 $S/compare.py /tmp/direct.png /tmp/old-vram-$v.png
done
cp /tmp/direct.png /tmp/vram-*.png $OUT/ 2>/dev/null
echo "done in $(($(date +%s)-T0)) s"
