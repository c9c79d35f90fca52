#!/bin/bash
# `sd` end to end on the GPU, this build (stage/sd.xz) against an earlier one
# (stage/sd-old.xz): one random full-size SD1.5 checkpoint (random_sd15.py), 512x512, CFG 7,
# Euler, STEPS [8] steps, resident and under `--max-vram` VRAMS [2.4 1.8] GB, ROUNDS [2]
# rounds interleaved; RUST_LOG=sd_exec=debug,sd_pipeline=info (the engine's timing of each
# execution, sd's stage timings: preload, conditioning, sampling, decoding) into
# $OUT/e2e.txt, each image compared with the resident one (compare.py). Run from the
# checkout root with stage/ as for streaming_sweep.sh.
source scripts/device/stage_module.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for b in sd sd-old; do [[ -f $S/$b.xz ]] && xz -d -k -f $S/$b.xz && chmod +x $S/$b; done
CK=/tmp/sd15-random.safetensors
python3 $S/random_sd15.py $CK --names crates/sd-formats/tests/fixtures/names >/dev/null
C=(-m $CK -p "a photograph of an astronaut riding a horse" -W 512 -H 512 --cfg-scale 7 --steps ${STEPS:-8} -s 42 --backend CUDA0 -v)
one() {
  local label=$1 bin=$2; shift 2
  local t0; t0=$(date +%s.%N)
  RUST_LOG=sd_exec=debug,sd_pipeline=info timeout 150 $S/$bin "${C[@]}" "$@" -o /tmp/$label.png >/tmp/$label.out 2>/tmp/$label.err
  local rc=$?
  local wall; wall=$(python3 -c "import sys,time; print(f'{time.time()-float(sys.argv[1]):.2f}')" $t0)
  echo "## $label rc $rc wall $wall s" | tee -a $OUT/e2e.txt
  sed 's/\x1b\[[0-9;]*m//g' /tmp/$label.err | grep -E "completed|task=\"diffusion\"" | sed 's/^.*Z //' >> $OUT/e2e.txt
  sed 's/\x1b\[[0-9;]*m//g' /tmp/$label.err | grep -E "completed|error|Error" | sed 's/^.*: //' | cut -c1-160 | tr '\n' ';'; echo
  sed 's/\x1b\[[0-9;]*m//g' /tmp/$label.err | grep -E "task=\"diffusion\"" | head -2 | grep -oE "total_ms=[0-9.]+|prefetch_ms=[0-9.]+|staging_ms=[0-9.]+" | tr '\n' ' '; echo
}
for r in $(seq ${ROUNDS:-2}); do
  one direct-r$r sd
  for v in ${VRAMS-2.4 1.8}; do
    one new-$v-r$r sd --max-vram $v
    python3 $S/compare.py /tmp/direct-r1.png /tmp/new-$v-r$r.png
    [[ -x $S/sd-old ]] && one old-$v-r$r sd-old --max-vram $v && python3 $S/compare.py /tmp/direct-r1.png /tmp/old-$v-r$r.png
  done
done
echo "done in $(($(date +%s)-T0)) s"
