#!/bin/bash
# One device call (2026-12-05): `sd` end to end on CUDA and Vulkan (issue 20), the SD1.5 UNet
# budget sweep (issue 19), and a 12-block Qwen-Image at budgets scaled from 24 and 8 GiB.
# Run from the checkout root with stage/ holding: sd.xz, sd-bench.xz, sd_e2e.sh,
# random_sd15.py, compare.py (scripts/device/), mod/libggml-cuda.so.xz.* (a module saved by
# SAVE_MODULE=1), vk/libggml-vulkan.so.xz (built here: README, GPU); .gl/ with Debian's
# Vulkan loader debs (the device README). Results in $OUT/all.tgz.
R=$(pwd)
cd stage
mkdir -p mods-cuda mods-vulkan
[[ -f /tmp/mod/libggml-cuda.so ]] && cp /tmp/mod/libggml-cuda.so mods-cuda/ || cat mod/libggml-cuda.so.xz.* | xz -d -T0 > mods-cuda/libggml-cuda.so
xz -d -c vk/libggml-vulkan.so.xz > mods-vulkan/libggml-vulkan.so
xz -d -k -f sd-bench.xz; chmod +x sd-bench
echo 'int sdrs_ggml_base_stub;' > /tmp/stub.c
gcc -shared -fPIC -Wl,-soname,libggml-base.so.0 -o mods-cuda/libggml-base.so.0 /tmp/stub.c && cp mods-cuda/libggml-base.so.0 mods-vulkan/
for f in $R/.gl/*.deb; do dpkg -x $f /; done; ldconfig
ls /usr/local/nvidia/share/vulkan/icd.d/ /usr/share/vulkan/icd.d/ /etc/vulkan/icd.d 2>&1 | head
J=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[[ -f $J ]] && export VK_DRIVER_FILES=$J
PHASES=${E2E_PHASES:-list,e2e,vulkan-e2e} BUDGETS="1.2 0.8 0.6" VK_BUDGETS=1.2 DEADLINE=${E2E_DEADLINE:-230} bash sd_e2e.sh $OUT/e2e
cd $R
MODULE_DIR=$R/stage/mods-cuda SD_BENCH=$R/stage/sd-bench PHASES=resident,budgets BUDGETS="0.75 0.5" MODES=pinned \
  NORESERVE_BUDGETS="0.5 0.25 0.1" RAM_BUDGET= STEPS=10 DEADLINE=${SWEEP_DEADLINE:-120} \
  timeout 200 bash scripts/device/cuda_run.sh $OUT/sweep > /dev/null 2>&1
grep -h "RESULT\|COMPARE\|CUDA0\|Vulkan0\|SKIP" $OUT/e2e/results.txt $OUT/e2e/log.txt | sort -u | head -60
python3 - $OUT/sweep/results.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r.get("label"), {k: r.get(k) for k in ("step_ms_median","h2d_bytes_per_step","segments","prefetched","peak_device_used_bytes","device_used_peak_bytes","budget_bytes","runtime_reserve_bytes")})
PY
# Qwen-Image, 12 of its 60 blocks (same widths), at budgets scaled as 24/12/8 GiB are to the
# whole: why do its segments not prefetch (engine decisions in the debug log)?
B=$R/stage/sd-bench; export LD_LIBRARY_PATH=$R/stage/mods-cuda SD_BACKEND_MODULES=$R/stage/mods-cuda/libggml-cuda.so
mkdir -p $OUT/q12; W=/tmp/w-q12
$B write-weights $W --config qwen-image --blocks 12 | tail -c 200
for g in resident 4.8 1.6; do
  if [[ $g == resident ]]; then extra=(--params device); else extra=(--params pinned --max-vram $(python3 -c "print(int($g*2**30))")); fi
  RUST_LOG=sd_exec::execution=debug,sd_exec::eviction=debug timeout 90 $B unet --config qwen-image --weights $W/unet.safetensors --backend CUDA0 --steps 3 "${extra[@]}" > $OUT/q12/$g.json 2> $OUT/q12/$g.err
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], {k: r.get(k) for k in ('step_ms_median','segments','prefetched','h2d_bytes_per_step','peak_device_used_bytes','device_used_peak_bytes','budget_bytes','runtime_reserve_bytes','staging_pool_bytes','engine_max_footprint_bytes')}, r.get('last_step_timing_ms'))" $OUT/q12/$g.json $g
  grep -c "prefetch skipped" $OUT/q12/$g.err; grep "not enough memory" $OUT/q12/$g.err | tail -2 | cut -c1-600
done
gzip -9 $OUT/q12/*.err
cd $OUT && tar czf all.tgz e2e sweep q12 && rm -rf e2e sweep q12
