#!/usr/bin/env bash
# Builds ggml's CUDA backend as a loadable module on the GPU machine, checks that sd-bench
# loads it and matches the CPU, and times the UNet step (resident vs diffusers, then under
# --max-vram budgets with params in pinned RAM / pageable RAM / on disk). One call, logs in
# LOGDIR:
#   log.txt        everything printed (environment, build, each run)
#   results.jsonl  one JSON object per measurement (sd-bench and diffusers_unet.py)
#   summary.md     the table for docs/benchmarks.md;  benchmarks.png  the plot
#   module-*.part  (SAVE_MODULE=1) the built module, gzip'd and split, to carry next time
#
# usage: scripts/device/cuda_run.sh LOGDIR
# environment (defaults in brackets):
#   SD_BENCH     the sd-bench binary, built on the CPU machine [target/release/sd-bench]
#   GGML_SRC     ggml source: llama-cpp-sys-2's llama.cpp/ggml (with a stub ggml.pc.in)
#   MODULE_DIR   a dir holding a prebuilt module (libggml-cuda.so, .so.xz, or the
#                module-*.part of an earlier SAVE_MODULE=1 run) to use instead of building
#   WHEELS       diffusers wheels to install [.whl]
#   PHASES       which phases to run [build,check,bw,resident,diffusers,budgets]; also
#                `ab`: coalesced vs per-tensor weight uploads, interleaved;
#                `async`: prefetch uploads on a copy stream vs a transfer thread
#                (`sd-bench unet --async-upload on|off`), interleaved, at ASYNC_BUDGETS
#                [0.5 0.35], pinned params, after a resident run (the floor)
#   BUDGETS      --max-vram fractions [0.75 0.5 0.25 0.1];  MODES  [pinned disk]
#   STEPS        timed steps per budgeted run [10];  DEADLINE  seconds to stop starting runs [540]
#   CONFIG       the UNet: sd15 or sdxl [sd15] (the `diffusers` phase runs the SD1.5 peer only;
#                for SDXL run scripts/bench/unet_step_diffusers.py --model sdxl --device cuda)
#
# Linking: libggml-cuda.so NEEDs libggml-base.so.0. sd-bench has ggml statically linked and
# exports its symbols (-Wl,--export-dynamic), so the module is given an EMPTY stub of that
# name: every ggml symbol the module uses then binds to sd-bench's single copy, and a
# missing one fails the load (ggml dlopens with RTLD_NOW) instead of silently loading a
# second ggml.
set -uo pipefail
LOG=${1:?usage: cuda_run.sh LOGDIR}
mkdir -p "$LOG"
LOG=$(cd "$LOG" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
SD_BENCH=${SD_BENCH:-target/release/sd-bench}
GGML_SRC=${GGML_SRC:-}
WHEELS=${WHEELS:-.whl}
PHASES=${PHASES:-build,check,bw,resident,diffusers,budgets}
BUDGETS=${BUDGETS:-0.75 0.5 0.25 0.1}
MODES=${MODES:-pinned disk}
STEPS=${STEPS:-10}
DEADLINE=${DEADLINE:-540}
CONFIG=${CONFIG:-sd15}
WORK=${WORK:-/tmp/sdrs-cuda}
RESULTS=$LOG/results.jsonl
T0=$(date +%s)
: >"$RESULTS"
exec > >(tee -a "$LOG/log.txt") 2>&1

phase() { [[ ",$PHASES," == *",$1,"* ]]; }
elapsed() { echo $(($(date +%s) - T0)); }
say() { echo "[$(elapsed)s] $*"; }
# run_json LABEL CMD...: runs CMD, appends its JSON lines (tagged) to results.jsonl
run_json() {
    local label=$1
    shift
    if (($(elapsed) > DEADLINE)); then
        say "SKIP $label (past DEADLINE=${DEADLINE}s)"
        return 0
    fi
    say "RUN $label: $*"
    local out rc
    out=$("$@" 2> >(tail -n 20 >&2))
    rc=$?
    echo "$out"
    echo "$out" | grep '^{' | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line); d["label"] = sys.argv[1]; print(json.dumps(d))' "$label" >>"$RESULTS"
    ((rc == 0)) || say "FAILED $label (exit $rc)"
    return $rc
}

say "== environment"
uname -a
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,driver_version --format=csv
nvcc --version | tail -2
cmake --version | head -1
ldd --version | head -1
nproc

MOD=$WORK/module
mkdir -p "$MOD"
if [[ -n "${MODULE_DIR:-}" && -f "$MODULE_DIR/libggml-cuda.so" ]]; then
    cp "$MODULE_DIR/libggml-cuda.so" "$MOD/"
    say "using prebuilt module $MODULE_DIR/libggml-cuda.so"
elif [[ -n "${MODULE_DIR:-}" && -f "$MODULE_DIR/libggml-cuda.so.xz" ]]; then
    xz -d -c "$MODULE_DIR/libggml-cuda.so.xz" >"$MOD/libggml-cuda.so"
    say "using prebuilt module $MODULE_DIR/libggml-cuda.so.xz"
elif [[ -n "${MODULE_DIR:-}" && -n "$(ls "$MODULE_DIR"/module-*.part 2>/dev/null)" ]]; then
    cat "$MODULE_DIR"/module-*.part | gunzip >"$MOD/libggml-cuda.so"
    say "using prebuilt module from $MODULE_DIR/module-*.part"
elif phase build; then
    say "== building libggml-cuda.so (sm_90, GGML_BACKEND_DL) from $GGML_SRC"
    [[ -f "$GGML_SRC/CMakeLists.txt" ]] || { say "no ggml source at GGML_SRC=$GGML_SRC"; exit 1; }
    [[ -f "$GGML_SRC/ggml.pc.in" ]] || touch "$GGML_SRC/ggml.pc.in"
    B=$WORK/build
    tb=$(date +%s)
    cmake -S "$GGML_SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU=OFF -DGGML_NATIVE=OFF \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA_ALL_QUANTS=OFF \
        -DGGML_CUDA_NCCL=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_BUILD_TESTS=OFF \
        -DCMAKE_SKIP_RPATH=ON >"$WORK/configure.log" 2>&1 || { tail -30 "$WORK/configure.log"; exit 1; }
    cmake --build "$B" --target ggml-cuda -j "$(nproc)" >"$WORK/build.log" 2>&1 || { grep -m5 -A5 error "$WORK/build.log"; tail -20 "$WORK/build.log"; exit 1; }
    say "module built in $(($(date +%s) - tb)) s"
    cp "$(find "$B" -name 'libggml-cuda.so' | head -1)" "$MOD/"
    if [[ "${SAVE_MODULE:-0}" == 1 ]]; then
        gzip -1 -c "$MOD/libggml-cuda.so" | split -b 15M -d - "$LOG/module-" --additional-suffix=.part
        ls -la "$LOG"/module-*.part
    fi
fi
[[ -f "$MOD/libggml-cuda.so" ]] || { say "no module"; exit 1; }
ls -la "$MOD/libggml-cuda.so"
echo 'int sdrs_ggml_base_stub;' >"$WORK/stub.c"
gcc -shared -fPIC -Wl,-soname,libggml-base.so.0 -o "$MOD/libggml-base.so.0" "$WORK/stub.c"
readelf -d "$MOD/libggml-cuda.so" | grep NEEDED
export LD_LIBRARY_PATH=$MOD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SD_BACKEND_MODULES=$MOD/libggml-cuda.so
BENCH=$(realpath "$SD_BENCH")

if phase check; then
    say "== symbol binding: where the module's ggml symbols resolve"
    LD_DEBUG=bindings LD_DEBUG_OUTPUT=$WORK/ldbind "$BENCH" copy-bw --backend CUDA0 --mib 8 >/dev/null 2>&1
    cat "$WORK"/ldbind.* 2>/dev/null | grep "binding file .*libggml-cuda.so" | grep -o "to [^ ]*" | sort | uniq -c | sort -rn | head
    say "== check: tiny UNet on CUDA0 vs CPU"
    run_json check "$BENCH" check --backend CUDA0 || say "CHECK FAILED: timings below are of a backend that does not match the CPU"
fi
phase bw && run_json copy-bw "$BENCH" copy-bw --backend CUDA0 --mib 1024

W=$WORK/weights
if phase resident || phase diffusers || phase budgets || phase ab || phase async; then
    run_json write-weights "$BENCH" write-weights "$W" --config "$CONFIG" || exit 1
fi
if phase resident; then
    run_json resident "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params device --steps 20 --dump "$WORK/dump"
    run_json resident-noflash "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params device --steps 10 --flash-attn off
    run_json direct "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --direct on --steps 20
fi
if phase diffusers; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl &&
        export PYTHONPATH=/tmp/site
    run_json diffusers env PYTHONUNBUFFERED=1 python3 "$HERE/diffusers_unet.py" "$W/unet.safetensors" --dump "$WORK/dump" --iters 50 --warmup 10
fi
if phase budgets; then
    for f in $BUDGETS; do
        for m in $MODES; do
            run_json "budget-$f-$m" "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params "$m" --max-vram "$f" --steps "$STEPS"
        done
    done
    # The CUDA runtime's own allocations (cuBLAS, kernels, ggml's temporary pool; about 245
    # MiB measured) are outside the engine's accounting; sd-bench leaves 320 MiB of every
    # budget to them by default (CUDA_RUNTIME_RESERVE_BYTES). The same 50% run without that
    # reserve shows what it is for.
    # NORESERVE_BUDGETS [0.5]: budgets run without it (the engine's own floor at budgets
    # below what the CUDA runtime itself takes).
    for f in ${NORESERVE_BUDGETS-0.5}; do
        run_json "budget-$f-pinned-noreserve" "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params pinned --max-vram "$f" --runtime-reserve 0 --steps "$STEPS"
    done
    [[ -n "${RAM_BUDGET:-0.5}" ]] && run_json "budget-${RAM_BUDGET:-0.5}-ram" "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params ram --max-vram "${RAM_BUDGET:-0.5}" --steps "$STEPS"
fi
if phase ab; then
    # A/B of the coalesced weight uploads (SD_BENCH_COALESCE=0: one copy per tensor),
    # interleaved to see the run-to-run spread.
    for rep in a b; do
        for c in 1 0; do
            SD_BENCH_COALESCE=$c run_json "ab-0.75-pinned-c$c-$rep" "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params pinned --max-vram 0.75 --steps "$STEPS"
        done
    done
    for c in 1 0; do
        SD_BENCH_COALESCE=$c run_json "ab-0.5-ram-c$c" "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params ram --max-vram 0.5 --steps "$STEPS"
    done
    grep '"label": "ab-' "$RESULTS" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["label"], round(r["step_ms_median"], 2), r["coalesced_uploads"])'
fi
if phase async; then
    run_json "async-resident" "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params device --steps "$STEPS"
    for f in ${ASYNC_BUDGETS:-0.5 0.35}; do
        for rep in a b; do
            for au in on off; do
                run_json "async-$f-$au-$rep" "$BENCH" unet --config "$CONFIG" --weights "$W/unet.safetensors" --backend CUDA0 --params pinned --max-vram "$f" --steps "$STEPS" --async-upload "$au"
            done
        done
    done
    grep '"label": "async-' "$RESULTS" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); t = r.get("last_step_timing_ms", {})
    print(r["label"], round(r["step_ms_median"], 1), "copy_stream", r.get("copy_stream"),
          "segments", r.get("segments"), "prefetched", r.get("prefetched"),
          " ".join(f"{k} {v:.1f}" for k, v in t.items()))'
fi
say "== summary"
python3 "$HERE/summarize.py" "$RESULTS" "$LOG/summary.md" "$LOG/benchmarks.png"
say "done in $(elapsed) s"
