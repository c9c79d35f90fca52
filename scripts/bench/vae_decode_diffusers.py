#!/usr/bin/env python3
"""One SD1.5 VAE decode in diffusers on the CPU: the PyTorch half of `cargo xtask bench vae`
(the Rust half is `crates/sd-models/benches/vae_decode.rs`).

Same work as the Rust side: diffusers' `AutoencoderKL` in the SD1.5 configuration
(block_out_channels 128/256/512/512, 2 layers per block, 4 latent channels, 32 groups: the
`runwayml/stable-diffusion-v1-5` vae/config.json values), random weights (diffusers' default
initialisation), latents [1, 4, side, side] (64: a 512x512 image), `vae.decode(z)` under
`torch.inference_mode()`, `torch.set_num_threads(threads)`, in f32 (`--dtype f32`) or bf16.

Prints `RESULT key=value` lines: `torch_vae_<dtype>_seconds` (best of `--reps` timed
decodes after one warm-up) and `torch_vae_<dtype>_cpu_seconds` (process CPU time per decode).

    python3 scripts/bench/vae_decode_diffusers.py --threads 2 --dtype f32 --reps 2
"""

import argparse
import time

import torch

SD15_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=512,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--latent", type=int, default=64, help="latent side (64: 512x512)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    from diffusers import AutoencoderKL

    t0 = time.perf_counter()
    vae = AutoencoderKL(**SD15_VAE).to(dtype).eval()
    print(f"diffusers SD1.5 VAE in {args.dtype}, built in {time.perf_counter() - t0:.1f} s, "
          f"torch {torch.__version__}, {args.threads} threads")
    g = torch.Generator().manual_seed(7)
    z = torch.randn((1, 4, args.latent, args.latent), generator=g).to(dtype)
    times, cpu = [], 0.0
    with torch.inference_mode():
        for i in range(args.reps + 1):
            s, c = time.perf_counter(), time.process_time()
            out = vae.decode(z).sample
            dt = time.perf_counter() - s
            if i > 0:
                cpu += time.process_time() - c
                times.append(dt)
            print(f"{'warm-up' if i == 0 else 'timed'} decode: {dt:.4f} s")
    assert torch.isfinite(out.float()).all()
    times.sort()
    print(f"RESULT torch_vae_{args.dtype}_seconds={times[0]:.4f}")
    print(f"RESULT torch_vae_{args.dtype}_cpu_seconds={cpu / args.reps:.4f}")


if __name__ == "__main__":
    main()
