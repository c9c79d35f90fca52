#!/usr/bin/env python3
"""The peer of `cargo run --release -p sd-tensor --example amx_probe 2 flux`: FLUX.1's linear
layers over the 1536 tokens of a 512x512 image (bf16 `F.linear` with bias, best of three) and its
attention (24 heads of 128, bf16 `scaled_dot_product_attention`) on PyTorch's CPU.

    python3 scripts/bench/flux_products_torch.py [threads]
"""
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
shapes = [(3072, 3072, 1536), (3072, 12288, 1024), (12288, 3072, 1024), (3072, 21504, 1536), (15360, 3072, 1536)]
for k, n, m in shapes:
    w = torch.randn(n, k).to(torch.bfloat16); x = torch.randn(m, k).to(torch.bfloat16); b = torch.randn(n).to(torch.bfloat16)
    lin = lambda: torch.nn.functional.linear(x, w, b)
    lin()
    best = 1e9
    for _ in range(3):
        t = time.perf_counter(); lin(); best = min(best, time.perf_counter() - t)
    print(f"torch bf16 {k}->{n} x{m}: {2*k*n*m/best/1e9:.0f} GFLOP/s ({best*1e3:.1f} ms)")
q = torch.randn(1, 24, 1536, 128).to(torch.bfloat16)
f = lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)
f(); best = 1e9
for _ in range(3):
    t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
print(f"torch bf16 sdpa 24x128 over 1536 (batch 1): {4*24*1536*1536*128/best/1e9:.0f} GFLOP/s ({best*1e3:.1f} ms)")
