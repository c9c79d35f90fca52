#!/usr/bin/env bash
# End to end through `sd` itself on a GPU machine: builds the backend module with the same
# command users type (`xtask build-cuda` / `build-vulkan`, here the prebuilt xtask binary with
# --no-sd), checks `sd --list-devices` and a tiny run against the CPU, then a random full-size
# SD1.5 checkpoint (original layout, made by random_sd15.py) at 512x512, CFG 7, 12 steps:
# resident, then --max-vram budgets with and without --vae-tiling. For each run: whole-run
# wall time, the device's peak memory.used sampled by nvidia-smi every 50 ms (minus the idle
# value before the run), and the image's difference to the resident run.
#
# usage: sd_e2e.sh LOGDIR      (run from a folder holding: sd, xtask, ggml.tgz, random_sd15.py
#                               with names/, and optionally mods-cuda/ with a built module)
# environment: PHASES [cuda-build,list,tiny,e2e]  (+ vulkan-build, vulkan-e2e)
#   BUDGETS [1.2G 0.8G 0.6G]  DEADLINE seconds after which no run starts [520]
set -uo pipefail
LOG=$(mkdir -p "$1" && cd "$1" && pwd)
PHASES=${PHASES:-cuda-build,list,tiny,e2e}
BUDGETS=${BUDGETS:-1.2 0.8 0.6}
DEADLINE=${DEADLINE:-520}
HERE=$(pwd)
PNG=/tmp/png
mkdir -p $PNG
T0=$(date +%s)
exec > >(tee -a "$LOG/log.txt") 2>&1
phase() { [[ ",$PHASES," == *",$1,"* ]]; }
say() { echo "[$(($(date +%s) - T0))s] $*"; }
late() { (($(date +%s) - T0 > DEADLINE)); }

say "== environment"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
nvcc --version | tail -1
nproc
[[ -f sd || ! -f sd.xz ]] || xz -d -k sd.xz
chmod +x sd xtask
[[ -f /tmp/ggml/CMakeLists.txt || ! -f ggml.tgz ]] || { mkdir -p /tmp/ggml && tar -xzf ggml.tgz -C /tmp/ggml; }

if phase cuda-build && [[ ! -f mods-cuda/libggml-cuda.so ]]; then
    say "== xtask build-cuda --arch 90"
    tb=$(date +%s)
    CARGO_TARGET_DIR=/tmp/xt ./xtask build-cuda --arch 90 --no-sd --ggml-src /tmp/ggml \
        --out "$HERE/mods-cuda" >/tmp/build-cuda.log 2>&1 || { tail -40 /tmp/build-cuda.log; exit 1; }
    say "module built in $(($(date +%s) - tb)) s"
    ls -la mods-cuda
    readelf -d mods-cuda/libggml-cuda.so | grep -E 'NEEDED|RUNPATH|RPATH'
    gzip -1 -c mods-cuda/libggml-cuda.so | split -b 15M -d - "$LOG/cuda-" --additional-suffix=.part
fi
if [[ ! -f mods-cuda/libggml-cuda.so && -n "$(ls mods-cuda/cuda-*.part 2>/dev/null)" ]]; then
    cat mods-cuda/cuda-*.part | gunzip >mods-cuda/libggml-cuda.so
fi
if [[ ! -f mods-cuda/libggml-cuda.so && -f mods-cuda/libggml-cuda.so.xz ]]; then
    xz -d -T0 -c mods-cuda/libggml-cuda.so.xz >mods-cuda/libggml-cuda.so && rm mods-cuda/libggml-cuda.so.xz
fi

if phase vulkan-build && [[ ! -f mods-vulkan/libggml-vulkan.so ]]; then
    say "== xtask build-vulkan (Vulkan headers, glslc, SPIRV-Headers from Debian packages)"
    V=/tmp/vk
    mkdir -p $V
    if [[ -f vk.txz ]]; then tar -xJf vk.txz -C $V; else for f in vk/*.deb; do dpkg -x "$f" $V; done; fi
    export LD_LIBRARY_PATH=$V/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PATH=$V/usr/bin:$PATH
    tb=$(date +%s)
    CARGO_TARGET_DIR=/tmp/xtv timeout "${VK_TIMEOUT:-420}" ./xtask build-vulkan --no-sd --ggml-src /tmp/ggml \
        --out "$HERE/mods-vulkan" -- -DCMAKE_PREFIX_PATH=$V/usr \
        -DVulkan_INCLUDE_DIR=$V/usr/include \
        -DVulkan_LIBRARY=$V/usr/lib/x86_64-linux-gnu/libvulkan.so.1 \
        -DVulkan_GLSLC_EXECUTABLE=$V/usr/bin/glslc >/tmp/build-vk.log 2>&1 ||
        { grep -m10 -B2 -A6 -i 'error' /tmp/build-vk.log; tail -15 /tmp/build-vk.log; }
    say "vulkan build ended after $(($(date +%s) - tb)) s"
    ls -la mods-vulkan 2>/dev/null && [[ ${SAVE_VK:-1} == 1 ]] &&
        gzip -1 -c mods-vulkan/libggml-vulkan.so | split -b 15M -d - "$LOG/vulkan-" --additional-suffix=.part
fi
if [[ ! -f mods-vulkan/libggml-vulkan.so && -n "$(ls mods-vulkan/vulkan-*.part 2>/dev/null)" ]]; then
    cat mods-vulkan/vulkan-*.part | gunzip >mods-vulkan/libggml-vulkan.so
fi

export SD_BACKEND_MODULES=$HERE/mods-cuda
phase vulkan-e2e && export SD_BACKEND_MODULES=$HERE/mods-cuda:$HERE/mods-vulkan
if phase list; then
    say "== sd --list-devices (SD_BACKEND_MODULES=$SD_BACKEND_MODULES)"
    ./sd --list-devices
    say "== next to the executable (SD_BACKEND_MODULES unset)"
    mkdir -p /tmp/inst && cp sd mods-cuda/* /tmp/inst/ && (unset SD_BACKEND_MODULES; /tmp/inst/sd --list-devices)
    say "== an incompatible module: a clear message"
    mkdir -p /tmp/bad && cp mods-cuda/libggml-cuda.so /tmp/bad/ &&
        SD_BACKEND_MODULES=/tmp/bad ./sd --list-devices; echo "exit $?"
fi

# peak MEM: samples memory.used (MiB) every 50 ms while "$@" runs; prints wall and peak-idle.
measure() {
    local label=$1
    shift
    local idle
    idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 >"/tmp/mem-$label" 2>/dev/null &
    local smi=$!
    local t0 t1 rc
    t0=$(date +%s.%N)
    "$@" >"/tmp/run-$label.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    kill $smi 2>/dev/null
    wait $smi 2>/dev/null
    local peak
    peak=$(sort -n "/tmp/mem-$label" | tail -1)
    python3 -c "import sys; print(f'RESULT {sys.argv[1]} rc={sys.argv[2]} wall_s={float(sys.argv[4])-float(sys.argv[3]):.2f} peak_mib={int(sys.argv[5])-int(sys.argv[6])} idle_mib={sys.argv[6]}')" \
        "$label" "$rc" "$t0" "$t1" "${peak:-0}" "$idle" | tee -a "$LOG/results.txt"
    ((rc == 0)) || tail -15 "/tmp/run-$label.log"
}

if phase tiny; then
    say "== tiny run: built-in model on CUDA0 and on the CPU"
    M=$HERE/../models/builtin/sd-rs-shapes.safetensors
    for b in cpu CUDA0; do
        measure "tiny-$b" ./sd -m "$M" -p "a red circle on a white background" -s 3 --backend "$b" -o "$PNG/tiny-$b.png"
    done
    python3 compare.py "$PNG/tiny-cpu.png" "$PNG/tiny-CUDA0.png" | tee -a "$LOG/results.txt"
fi

CK=/tmp/sd15-random.safetensors
gen() {
    phase "$1" || return 0
    [[ -f $CK ]] || { say "== random SD1.5 checkpoint"; python3 random_sd15.py $CK --names ../crates/sd-formats/tests/fixtures/names; }
    local dev=$2 tag=$3
    local common=(-m $CK -p "a photograph of an astronaut riding a horse" -W 512 -H 512
        --cfg-scale 7 --steps 12 -s 42 --backend "$dev")
    say "== e2e on $dev"
    measure "$tag-resident" ./sd "${common[@]}" -o "$PNG/$tag-resident.png" -v
    grep -iE 'segment|peak|total|took|step' "/tmp/run-$tag-resident.log" | tail -6
    # The tiled VAE decode changes pixels by itself: tiled runs compare to a tiled resident run.
    measure "$tag-resident-tiling-on" ./sd "${common[@]}" --vae-tiling -o "$PNG/$tag-resident-on.png"
    python3 compare.py "$PNG/$tag-resident.png" "$PNG/$tag-resident-on.png" | tee -a "$LOG/results.txt"
    for bud in ${4:-$BUDGETS}; do
        for tile in off on; do
            late && { say "SKIP $tag $bud (past DEADLINE)"; continue; }
            local extra=()
            [[ $tile == on ]] && extra=(--vae-tiling)
            measure "$tag-$bud-tiling-$tile" ./sd "${common[@]}" --max-vram "$bud" "${extra[@]}" \
                -o "$PNG/$tag-$bud-$tile.png"
            local ref=$PNG/$tag-resident.png
            [[ $tile == on ]] && ref=$PNG/$tag-resident-on.png
            [[ -f $PNG/$tag-$bud-$tile.png ]] &&
                python3 compare.py "$ref" "$PNG/$tag-$bud-$tile.png" | tee -a "$LOG/results.txt"
        done
    done
}
gen e2e CUDA0 cuda
gen vulkan-e2e Vulkan0 vulkan "${VK_BUDGETS:-0.8}"
if phase vulkan-e2e && [[ -f $PNG/cuda-resident.png && -f $PNG/vulkan-resident.png ]]; then
    python3 compare.py "$PNG/cuda-resident.png" "$PNG/vulkan-resident.png" | tee -a "$LOG/results.txt"
fi
for f in cuda-resident vulkan-resident cuda-0.6-on; do
    [[ -f $PNG/$f.png ]] && cp "$PNG/$f.png" "$LOG/"
done
say "done"
