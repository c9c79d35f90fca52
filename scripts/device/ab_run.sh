# Sourced by the A/B device scripts (pool_sized_ab.sh, coalesce_ab.sh, async_compute_ab.sh, window_ab.sh, evict_ab.sh, ...,
# pipeline_ab.sh) after stage_module.sh:
# `ab_one LABEL ARGS...` runs `sd-bench unet` on CUDA0 (pinned params unless ARGS name
# --params, STEPS [10] timed steps, runtime reserve 0) with ARGS, appends its JSON line,
# tagged `label`, to $OUT/results.jsonl and prints one summary line. Environment set on the
# call (`SD_BENCH_COALESCE=0 ab_one ...`) reaches sd-bench.
ab_one() {
  local label=$1; shift
  local pa=(--params pinned); [[ " $* " == *" --params "* ]] && pa=()
  $B unet --backend CUDA0 "${pa[@]}" --steps ${STEPS:-10} --runtime-reserve 0 "$@" 2>/dev/null |
    grep '^{' | tail -1 | python3 -c "
import json, sys
d = json.loads(sys.stdin.read()); d['label'] = sys.argv[1]
print(json.dumps(d), file=open(sys.argv[2], 'a'))
t = d.get('last_step_timing_ms', {}); g = lambda k: d.get(k, 0) or 0
print(sys.argv[1], 'step %.1f' % d['step_ms_median'], 'h2d %.2f GB' % (g('h2d_bytes_per_step') / 1e9),
      'segs', g('segments'), 'pre', g('prefetched'), 'ahead', g('max_prefetches_ahead'),
      'overlapped', g('segments_overlapped'), 'behind', g('segments_queued_behind'), 'reused', g('graphs_reused'), 'unmoved %.1f' % g('graphs_unmoved_per_step'), 'pool %.0f MiB' % (g('staging_pool_bytes') / 2**20), 'peak %.0f MiB' % (g('peak_device_used_bytes') / 2**20),
      'budget %.0f MiB' % (g('budget_bytes') / 2**20),
      ' '.join('%s=%.1f' % kv for kv in t.items()))" $label $OUT/results.jsonl
}
# `diffusers_sd15 WEIGHTS`: diffusers' group offload (modes in DIFFUSERS [leaf]) of the SD1.5
# UNet in WEIGHTS, one JSON line each (label sd15-diffusers-MODE) appended to
# $OUT/results.jsonl; needs .whl/ carried and torch on the machine (skipped otherwise).
diffusers_sd15() {
  [ -n "${DIFFUSERS-leaf}" ] && ls .whl/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  for o in ${DIFFUSERS-leaf}; do
    timeout 120 env PYTHONUNBUFFERED=1 python3 scripts/device/diffusers_unet.py "$1" --offload $o --iters 20 --warmup 3 2>&1 | grep '^{' | tail -1 |
      sed "s/^{/{\"label\":\"sd15-diffusers-$o\",/" | tee -a $OUT/results.jsonl | cut -c1-400
  done
}
# `device_header`: the GPU, then the pageable and pinned copy bandwidth (sd-bench copy-bw).
device_header() {
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  $B copy-bw --backend CUDA0 --mib 1024 | tail -1
}
# `bench_model NAME`: writes NAME's (sd15|sdxl) random weights into /tmp/w-NAME, sets W to
# the sd-bench arguments that read them, and runs the resident step (label NAME-resident;
# STEPS set on the call reaches it). `rm -rf /tmp/w-NAME` when done.
bench_model() {
  $B write-weights /tmp/w-$1 --config $1 >/dev/null
  W=(--config $1 --weights /tmp/w-$1/unet.safetensors)
  ab_one $1-resident "${W[@]}" --params device
}
# `late WHAT`: true (and says so) once the call has run DEADLINE [480] s since CALL_T0 (set
# it first thing in the script; else since this file was sourced).
CALL_T0=${CALL_T0:-$(date +%s)}
late() { (( $(date +%s) - CALL_T0 > ${DEADLINE:-480} )) && echo "deadline: skipping $1"; }
# `install_wheels`: the diffusers wheels carried in .whl/ into /tmp/site (PYTHONPATH); false
# without them.
install_wheels() {
  ls .whl/*.whl >/dev/null 2>&1 || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
}
# `peer LABEL ARGS...`: scripts/device/diffusers_unet.py ARGS, its JSON line tagged LABEL
# appended to $OUT/results.jsonl (and printed, cut).
peer() {
  local label=$1; shift
  timeout ${PEER_TIMEOUT:-200} env PYTHONUNBUFFERED=1 python3 scripts/device/diffusers_unet.py "$@" 2>&1 | grep '^{' | tail -1 |
    sed "s/^{/{\"label\":\"$label\",/" | tee -a $OUT/results.jsonl | cut -c1-${PEER_CUT:-300}
}
