# Sourced by the device scripts (dit_run.sh, async_ab.sh), run from the checkout root with
# OUT set: unpacks stage/sd-bench, builds ggml's CUDA module into /tmp/mod unless a warm
# machine kept it or stage/mod/ carries one (SAVE_MODULE=1 saves a built one to $SAVE_TO or $OUT, xz in 15 MB parts), gives it the empty libggml-base stub (see cuda_run.sh), and sets
# ROOT, S (stage), M (module dir), B (sd-bench), T0 and the loader environment.
ROOT=$(pwd)
S=$ROOT/stage
M=/tmp/mod
mkdir -p $M "$OUT"
T0=$(date +%s)
[[ -f $S/sd-bench || ! -f $S/sd-bench.xz ]] || xz -d -k $S/sd-bench.xz
chmod +x $S/sd-bench $S/xtask 2>/dev/null
# A module carried from an earlier call (stage/mod/libggml-cuda.so.xz, saved by SAVE_MODULE=1).
if [[ ! -f $M/libggml-cuda.so && -n "$(ls $S/mod/libggml-cuda.so.xz.* 2>/dev/null)" ]]; then
  cat $S/mod/libggml-cuda.so.xz.* | xz -d -T0 >$M/libggml-cuda.so && echo "module from stage/mod"
fi
if [[ ! -f $M/libggml-cuda.so ]]; then
  mkdir -p /tmp/ggml && tar -xzf $S/ggml.tgz -C /tmp/ggml
  CARGO_TARGET_DIR=/tmp/xt $S/xtask build-cuda --arch 90 --no-sd --ggml-src /tmp/ggml --out $M -- -DGGML_CUDA_GRAPHS=ON >/tmp/build-cuda.log 2>&1 || { tail -30 /tmp/build-cuda.log; exit 1; }
  echo "module built in $(($(date +%s) - T0)) s"
  # SAVE_MODULE=1: the module back in $OUT (xz; carry it as stage/mod/ next time).
  [[ ${SAVE_MODULE:-0} == 1 ]] && xz -T0 -3 -c $M/libggml-cuda.so | split -b 15M -d - "${SAVE_TO:-$OUT}/libggml-cuda.so.xz." && ls -la "${SAVE_TO:-$OUT}"/libggml-cuda.so.xz.*
fi
echo 'int sdrs_ggml_base_stub;' > /tmp/stub.c
gcc -shared -fPIC -Wl,-soname,libggml-base.so.0 -o $M/libggml-base.so.0 /tmp/stub.c
export LD_LIBRARY_PATH=$M SD_BACKEND_MODULES=$M/libggml-cuda.so
B=$S/sd-bench
