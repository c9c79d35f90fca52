#!/bin/bash
# Issue 19, the resident gap of the DiTs: ggml's attention kernels alone on the models'
# shapes (`sd-bench attn`: flash attention through permuted views as the models build it,
# per-head contiguous, f16 Q; products and softmax) beside torch's
# scaled_dot_product_attention on the same shapes (scripts/bench/attn_torch.py), then the
# DiT A/B of the twenty-third session's block changes (dit_kernels_ab.sh, DEADLINE from
# this call's start). Results: $OUT/attn.jsonl and what dit_kernels_ab.sh writes.
CALL_T0=$(date +%s)
source scripts/device/stage_module.sh 2>&1 | tail -3
source scripts/device/stage_module.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
$B attn --backend CUDA0 --iters ${ITERS:-10} 2>&1 | tee -a $OUT/attn.jsonl | python3 -c "
import json, sys
for l in sys.stdin:
    if not l.startswith('{'): print(l.rstrip()); continue
    d = json.loads(l)
    print('%-12s %-11s' % (d['shape'], d['variant']), d.get('skipped') or '%8.3f ms %6.1f TFLOP/s' % (d['ms'], d['tflops']))"
timeout 120 python3 scripts/bench/attn_torch.py --iters 20 2>&1 | tee -a $OUT/attn.jsonl | python3 -c "
import json, sys
for l in sys.stdin:
    if not l.startswith('{'): print(l.rstrip()[:200]); continue
    d = json.loads(l)
    print('%-12s torch-%-5s' % (d['shape'], d['variant']), '%8.3f ms %6.1f TFLOP/s' % (d['ms'], d['tflops']))"
echo "attention probes done at $(($(date +%s)-CALL_T0)) s"
CALL_T0=$CALL_T0 bash scripts/device/dit_kernels_ab.sh
