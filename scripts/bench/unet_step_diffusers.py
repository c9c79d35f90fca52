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

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json: three levels (320/640/1280),
# transformer depth [0, 2, 10], 64-wide heads, 2048-wide context, `text_time` embedding
# (pooled 1280 + 6 x 256 = 2816). Latents [2, 4, 128, 128] (1024x1024 with CFG).
SDXL_UNET = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    block_out_channels=[320, 640, 1280],
    layers_per_block=2,
    transformer_layers_per_block=[1, 2, 10],
    attention_head_dim=[5, 10, 20],
    cross_attention_dim=2048,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    norm_num_groups=32,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", choices=["sd15", "sdxl"], default="sd15")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (timed with synchronize)")
    ap.add_argument("--latent", type=int, default=0, help="latent side (0: the model's sample size)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    from diffusers import UNet2DConditionModel

    t0 = time.perf_counter()
    cfg = SDXL_UNET if args.model == "sdxl" else SD15_UNET
    with dev:  # built where it runs: a 2.6 B-parameter f32 init on the CPU takes minutes
        unet = UNet2DConditionModel(**cfg).to(dtype).eval()
    n = sum(p.numel() for p in unet.parameters())
    print(f"diffusers {args.model} UNet: {n / 1e6:.0f} M parameters in {args.dtype} on {dev}, built "
          f"in {time.perf_counter() - t0:.1f} s, torch {torch.__version__}, {args.threads} threads")
    g = torch.Generator().manual_seed(7)
    side = args.latent or cfg["sample_size"]
    x = torch.randn((2, 4, side, side), generator=g).to(dtype).to(dev)
    ctx = torch.randn((2, 77, cfg["cross_attention_dim"]), generator=g).to(dtype).to(dev)
    t = torch.tensor([500.0, 500.0]).to(dev)
    added = None
    if args.model == "sdxl":
        added = {
            "text_embeds": torch.randn((2, 1280), generator=g).to(dtype).to(dev),
            "time_ids": torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]] * 2).to(dtype).to(dev),
        }
    times, cpu = [], 0.0
    with torch.inference_mode():
        for i in range(args.reps + 1):
            sync()
            s, c = time.perf_counter(), time.process_time()
            out = unet(x, t, encoder_hidden_states=ctx, added_cond_kwargs=added).sample
            sync()
            dt = time.perf_counter() - s
            if i > 0:
                cpu += time.process_time() - c
            print(f"{'warm-up' if i == 0 else 'timed'} step: {dt:.4f} s")
            if i > 0:
                times.append(dt)
    assert torch.isfinite(out.float()).all()
    times.sort()
    print(f"RESULT torch_{args.dtype}_seconds={times[0]:.4f}")
    print(f"RESULT torch_{args.dtype}_cpu_seconds={cpu / args.reps:.4f}")
    print(f"RESULT torch_{args.dtype}_seconds_median={times[len(times) // 2]:.4f}")


if __name__ == "__main__":
    main()
