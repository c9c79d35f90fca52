#!/usr/bin/env python3
"""The peer of `sd-bench attn`: torch's scaled_dot_product_attention on the same shapes.

One JSON line per shape and dtype: the median ms of ITERS calls (CUDA events), TFLOP/s
(4 n^2 d h B FLOPs), and the backend torch picked where it says (flash, cuDNN,
efficient, math). Shapes as `sd-bench attn --shape`: d,heads,tokens,batch; default the
models' largest attentions (the same list as sd-bench's MODEL_SHAPES).

    python3 scripts/bench/attn_torch.py [--shape 128,24,4608,1 ...] [--iters 20]
"""

import argparse
import json
import statistics

MODEL_SHAPES = [
    ("flux", (128, 24, 4608, 1)),
    ("sd35-large", (64, 38, 4429, 2)),
    ("sdxl-64x64", (64, 10, 4096, 2)),
    ("sdxl-32x32", (64, 20, 1024, 2)),
    ("sd15-64x64", (64, 8, 4096, 2)),
]


def parse_shape(s):
    v = [int(p) for p in s.split(",")]
    if len(v) != 4 or min(v) <= 0:
        raise argparse.ArgumentTypeError(f"shape '{s}': expected d,heads,tokens,batch")
    return v


def time_sdpa(torch, shape, dtype, iters):
    d, h, n, b = shape
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    for _ in range(3):
        f(q, k, v)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        f(q, k, v)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=parse_shape, action="append", default=[])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    import torch

    shapes = [(",".join(map(str, s)), s) for s in args.shape] or MODEL_SHAPES
    for label, shape in shapes:
        d, h, n, b = shape
        flops = 4.0 * n * n * d * h * b
        for name, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
            ms = time_sdpa(torch, shape, dtype, args.iters)
            print(json.dumps({"cmd": "attn", "engine": "torch-sdpa", "torch": torch.__version__,
                              "shape": label, "d": d, "heads": h, "tokens": n, "batch": b,
                              "variant": name, "ms": ms, "tflops": flops / ms / 1e9}),
                  flush=True)


if __name__ == "__main__":
    main()
