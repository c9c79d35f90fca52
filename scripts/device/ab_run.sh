# Sourced by the A/B device scripts (pool_sized_ab.sh, coalesce_ab.sh) after stage_module.sh:
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
      'overlapped', g('segments_overlapped'), 'behind', g('segments_queued_behind'), 'pool %.0f MiB' % (g('staging_pool_bytes') / 2**20), 'peak %.0f MiB' % (g('peak_device_used_bytes') / 2**20),
      'budget %.0f MiB' % (g('budget_bytes') / 2**20),
      ' '.join('%s=%.1f' % kv for kv in t.items()))" $label $OUT/results.jsonl
}
