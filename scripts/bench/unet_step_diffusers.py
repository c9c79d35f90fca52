#!/usr/bin/env python3
"""One SD1.5 UNet step in diffusers on the CPU: the PyTorch half of `cargo xtask bench unet`
(the Rust half is `crates/sd-models/benches/unet_step.rs`).

Same step as the Rust side: diffusers' `UNet2DConditionModel` in the SD1.5 configuration
(block_out_channels 320/640/1280/1280, 2 layers per block, 8 heads, cross_attention_dim 768,
the `runwayml/stable-diffusion-v1-5` unet/config.json values), random weights (diffusers'
default initialisation; values do not change the work), latents [2, 4, 64, 64] (a 512x512
image with classifier-free guidance), timestep 500, context [2, 77, 768], under
`torch.inference_mode()`, `torch.set_num_threads(threads)`.

dtype policy: ggml keeps f16 weights and computes in f32 (f16 inside its matmuls); PyTorch's
CPU kernels have no fast f16 path, so the peer runs in f32 (`--dtype f32`, its default CPU
inference dtype, weights 3.4 GB) and optionally bf16 (`--dtype bf16`, oneDNN on CPUs with
AVX512-BF16 / AMX). Attention is diffusers' default (`F.scaled_dot_product_attention`, whose
CPU backend is a fused flash-attention kernel).

Prints `RESULT key=value` lines (`torch_<dtype>_seconds`, the best of `--reps` timed steps
after one warm-up, and
`torch_<dtype>_cpu_seconds`, the process CPU time per timed step).

    python3 scripts/bench/unet_step_diffusers.py --threads 2 --dtype f32 --reps 2
"""

import argparse
import time

import torch

SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    block_out_channels=[320, 640, 1280, 1280],
    layers_per_block=2,
    attention_head_dim=8,
    cross_attention_dim=768,
    norm_num_groups=32,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    from diffusers import UNet2DConditionModel

    t0 = time.perf_counter()
    unet = UNet2DConditionModel(**SD15_UNET).to(dtype).eval()
    n = sum(p.numel() for p in unet.parameters())
    print(f"diffusers SD1.5 UNet: {n / 1e6:.0f} M parameters in {args.dtype}, built in "
          f"{time.perf_counter() - t0:.1f} s, torch {torch.__version__}, {args.threads} threads")
    g = torch.Generator().manual_seed(7)
    x = torch.randn((2, 4, 64, 64), generator=g).to(dtype)
    ctx = torch.randn((2, 77, 768), generator=g).to(dtype)
    t = torch.tensor([500.0, 500.0])
    times, cpu = [], 0.0
    with torch.inference_mode():
        for i in range(args.reps + 1):
            s, c = time.perf_counter(), time.process_time()
            out = unet(x, t, encoder_hidden_states=ctx).sample
            dt = time.perf_counter() - s
            if i > 0:
                cpu += time.process_time() - c
            print(f"{'warm-up' if i == 0 else 'timed'} step: {dt:.2f} s")
            if i > 0:
                times.append(dt)
    assert torch.isfinite(out.float()).all()
    times.sort()
    print(f"RESULT torch_{args.dtype}_seconds={times[0]:.4f}")
    print(f"RESULT torch_{args.dtype}_cpu_seconds={cpu / args.reps:.4f}")
    print(f"RESULT torch_{args.dtype}_seconds_median={times[len(times) // 2]:.4f}")


if __name__ == "__main__":
    main()
