#!/usr/bin/env python3
"""One DiT step in diffusers on a GPU or the CPU: the peer of `sd-bench unet --config
sd35-large` (and `sd35-medium`, `flux-dev`, `qwen-image`; on the CPU, of `cargo xtask bench
dit`).

The transformer is built from its published `transformer/config.json` values with random
weights (diffusers' default initialisation; values do not change the work) directly on the
device in the chosen dtype: SD3.5 Large (`SD3Transformer2DModel`, 38 blocks of 2432, QK
RMS norm, a 192x192 position table), SD3.5 Medium (24 blocks of 1536, MMDiT-X attention in
blocks 0-12, 384x384 table), FLUX.1-dev (`FluxTransformer2DModel`, 19 + 38 blocks of 3072),
Qwen-Image (`QwenImageTransformer2DModel`, 60 blocks of 3072; one pass of CFG's two: batch 1,
a 64x64 grid of patches, 128 text tokens of 3584).
Inputs as sd-bench builds them: a 1024x1024 image (128x128 latents; `--latent N` as sd-bench's
`--latent`), SD3 with CFG (batch 2, 333 context tokens of 4096, pooled 2048), FLUX without
(batch 1, 512 T5 tokens, guidance 3.5). `--device cpu` runs it on PyTorch's CPU with
`--threads` threads (`--dtype f32` there is the reference's own precision). `--offload leaf|block` runs diffusers' group offloading (`enable_group_offload`, CUDA
streams, weights in pinned CPU memory) instead of the resident model.

Prints `RESULT key=value` lines: `step_ms` (best of `--reps` after a warm-up),
`step_ms_median`, `peak_mib` (`torch.cuda.max_memory_allocated`; 0 on the CPU), `params_b`.

    python3 scripts/bench/dit_step_diffusers.py --model sd35-large --dtype bf16 --reps 5
"""

import argparse
import time

import torch

SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38,
                  attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                  caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
                  pos_embed_max_size=192, qk_norm="rms_norm")
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                   pos_embed_max_size=384, qk_norm="rms_norm",
                   dual_attention_layers=tuple(range(13)))
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                  attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                  axes_dims_rope=(16, 56, 56))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["sd35-large", "sd35-medium", "flux-dev", "qwen-image"], default="sd35-large")
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--latent", type=int, default=128,
                    help="the latent side (128: 1024x1024); FLUX and Qwen-Image take (N/2)^2 tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--offload", choices=["none", "leaf", "block"], default="none")
    ap.add_argument("--smoke", action="store_true", help="2 blocks on the CPU (checks the script)")
    ap.add_argument("--blocks", type=int, default=0,
                    help="N blocks (FLUX: N double and 2N single, as sd-bench --blocks)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, one step under torch.profiler: `DIFF ms count kernel` lines")
    args = ap.parse_args()
    if args.blocks > 0:
        for c in (SD35_LARGE, SD35_MEDIUM, QWEN_IMAGE):
            c.update(num_layers=args.blocks)
        FLUX_DEV.update(num_layers=args.blocks, num_single_layers=2 * args.blocks)
    if args.latent <= 0 or args.latent % 2:
        ap.error(f"--latent {args.latent}: a positive even number")
    cpu = args.smoke or args.device == "cpu"
    dev = torch.device("cpu" if cpu else "cuda")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if cpu:
        torch.cuda.synchronize = lambda: None
        torch.cuda.reset_peak_memory_stats = lambda: None
        torch.cuda.max_memory_allocated = lambda: 0
    if args.smoke:
        for c in (SD35_LARGE, SD35_MEDIUM):
            c.update(num_layers=2, dual_attention_layers=(0,) if "dual_attention_layers" in c else ())
        FLUX_DEV.update(num_layers=1, num_single_layers=1)
        QWEN_IMAGE.update(num_layers=1)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    flux = args.model == "flux-dev"
    qwen = args.model == "qwen-image"
    if flux:
        from diffusers import FluxTransformer2DModel as Model
        cfg = FLUX_DEV
    elif qwen:
        from diffusers import QwenImageTransformer2DModel as Model
        cfg = QWEN_IMAGE
    else:
        from diffusers import SD3Transformer2DModel as Model
        cfg = SD35_LARGE if args.model == "sd35-large" else SD35_MEDIUM
    build_on = torch.device("cpu") if args.offload != "none" else dev
    # Built in the target dtype (a FLUX.1-dev in f32 on the CPU would take 48 GB first).
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with build_on:
            net = Model(**cfg).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
    if args.offload != "none":
        net.enable_group_offload(onload_device=dev, offload_device=torch.device("cpu"),
                                 offload_type=f"{args.offload}_level", num_blocks_per_group=1,
                                 use_stream=True)
    n = sum(p.numel() for p in net.parameters())
    print(f"diffusers {args.model}: {n / 1e9:.2f} B parameters in {args.dtype}, offload "
          f"{args.offload}, built in {time.perf_counter() - t0:.1f} s, torch {torch.__version__}")
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(s, generator=g).to(dtype).to(dev)
    side = args.latent // 2
    if flux:
        tokens = side * side
        ids = torch.zeros((tokens, 3))
        ids[:, 1] = torch.arange(side).repeat_interleave(side)
        ids[:, 2] = torch.arange(side).repeat(side)
        kw = dict(hidden_states=r(1, tokens, 64), encoder_hidden_states=r(1, 512, 4096),
                  pooled_projections=r(1, 768), timestep=torch.tensor([0.7], device=dev, dtype=dtype),
                  guidance=torch.tensor([3.5], device=dev, dtype=dtype), img_ids=ids.to(dev),
                  txt_ids=torch.zeros((512, 3), device=dev))
    elif qwen:
        kw = dict(hidden_states=r(1, side * side, 64), encoder_hidden_states=r(1, 128, 3584),
                  encoder_hidden_states_mask=torch.ones((1, 128), dtype=torch.long, device=dev),
                  timestep=torch.tensor([0.7], device=dev, dtype=dtype), img_shapes=[[(1, side, side)]])
    else:
        kw = dict(hidden_states=r(2, 16, args.latent, args.latent), encoder_hidden_states=r(2, 333, 4096),
                  pooled_projections=r(2, 2048), timestep=torch.tensor([700.0, 700.0], device=dev))
    torch.cuda.reset_peak_memory_stats()
    times = []
    with torch.inference_mode():
        for i in range(args.reps + 1):
            torch.cuda.synchronize()
            s = time.perf_counter()
            out = net(**kw, return_dict=False)[0]
            torch.cuda.synchronize()
            dt = (time.perf_counter() - s) * 1e3
            print(f"{'warm-up' if i == 0 else 'timed'} step: {dt:.1f} ms")
            if i > 0:
                times.append(dt)
    assert torch.isfinite(out.float()).all()
    if args.profile and not cpu:
        import collections
        from torch.profiler import ProfilerActivity, profile
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            net(**kw, return_dict=False)
            torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name[:90]][0] += e.device_time_total / 1000.0
                agg[e.name[:90]][1] += 1
        for name, (ms, k) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:30]:
            print(f"DIFF {ms:8.3f} ms {k:5d}  {name}")
        print(f"DIFF total kernel ms {sum(v for v, _ in agg.values()):.3f}")
    times.sort()
    print(f"RESULT step_ms={times[0]:.2f}")
    print(f"RESULT step_ms_median={times[len(times) // 2]:.2f}")
    print(f"RESULT peak_mib={torch.cuda.max_memory_allocated() / 2**20:.0f}")
    print(f"RESULT params_b={n / 1e9:.3f}")


if __name__ == "__main__":
    main()
