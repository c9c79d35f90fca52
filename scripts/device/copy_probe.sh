#!/bin/bash
# The second call of the twenty-second session (issue 19), first: what slows a budgeted step's
# uploads (40-50 GB/s inside a step against 55 alone). `sd-bench copy-bw --contention on`:
# pinned copies of 1 / 4 / 16 / 64 MiB pieces, and 64 MiB copies on a thread alone, while the
# backend computes long products, and while it computes graphs of 2000 tiny adds; with
# ggml's CUDA graphs (the tiny graph then replays) and without (every add launched). Run from
# the checkout root with stage/ (sd-bench.xz and the module in stage/mod/).
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$B copy-bw --backend CUDA0 --mib 1024 --contention on 2>/dev/null | grep '^{' | sed 's/^{/{"label":"graphs",/' | tee -a $OUT/results.jsonl
GGML_CUDA_DISABLE_GRAPHS=1 $B copy-bw --backend CUDA0 --mib 1024 --contention on 2>/dev/null | grep '^{' | sed 's/^{/{"label":"no-graphs",/' | tee -a $OUT/results.jsonl
# Then where the host's part of SD1.5's budgeted steps goes (SD_BENCH_SPAN_TIMES=1: the
# engine's spans per timed step in the JSON line's `span_times`).
source scripts/device/ab_run.sh
bench_model sd15
for f in 0.75 0.5 0.25; do
  SD_BENCH_SPAN_TIMES=1 ab_one sd15-$f-spans "${W[@]}" --max-vram $f
  tail -1 $OUT/results.jsonl | python3 -c "
import json, sys
d = json.loads(sys.stdin.read())
for k, v in list(d['span_times'].items())[:14]:
    print('  %-24s n %6.1f total %7.2f self %7.2f' % (k, v['count'], v['total_ms'], v['self_ms']))"
done
ab_one sd15-0.5-base "${W[@]}" --max-vram 0.5
