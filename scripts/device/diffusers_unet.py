"""The PyTorch/diffusers peer of `sd-bench unet`: the same SD1.5 UNet step on the same GPU with
the same weights and inputs.

Reads the LDM-layout safetensors that `sd-bench write-weights` wrote, converts it to the
diffusers layout with diffusers' own `convert_ldm_unet_checkpoint`, loads it into
`UNet2DConditionModel` (SD1.5 config) in f16, and times one step (batch 2, 64x64 latents,
77x768 context) with CUDA events (warm-up, median of --iters). `--offload leaf|block` runs
diffusers' own group offloading (`enable_group_offload`, CUDA streams, weights in pinned host
memory): the peer of `sd-bench unet --max-vram`. `--model sdxl` times the SDXL UNet (random
weights, 128x128 latents, 77x2048 context) instead of the file's. With --dump DIR (the inputs
and output `sd-bench unet --dump DIR` wrote: raw little-endian f32) it runs the same inputs
and prints the relative L2 error of sd-rs's output and of diffusers' f16 output against a
diffusers f32 reference. Prints one JSON line.

usage: python3 diffusers_unet.py WEIGHTS.safetensors [--dump DIR] [--iters N] [--warmup N]
                                 [--offload none|leaf|block] [--model sd15|sdxl]
"""

import argparse
import json
import sys

import numpy as np
import torch
from safetensors.torch import load_file


def bench_configs():
    """The SD1.5 and SDXL UNet configs of scripts/bench/unet_step_diffusers.py (one copy of
    the published configs for every diffusers peer)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "unet_step_diffusers.py")
    spec = importlib.util.spec_from_file_location("unet_step_diffusers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SD15_UNET, mod.SDXL_UNET


def unet_of(config, dtype):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**config).to(dtype)


def rel_l2(a, r):
    a = a.double().flatten()
    r = r.double().flatten()
    return float((a - r).norm() / r.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("weights")
    ap.add_argument("--dump")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--offload", choices=["none", "leaf", "block"], default="none")
    ap.add_argument("--model", choices=["sd15", "sdxl"], default="sd15")
    args = ap.parse_args()
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    dev = torch.device(args.device)
    xl = args.model == "sdxl"
    sd15_config, sdxl_config = bench_configs()
    if xl:
        torch.manual_seed(0)
        with dev if args.offload == "none" else torch.device("cpu"):
            unet = unet_of(sdxl_config, torch.float16).eval()
    else:
        ldm = load_file(args.weights)
        unet = unet_of(sd15_config, torch.float16)
        sd = convert_ldm_unet_checkpoint(ldm, unet.config)
        unet.load_state_dict(sd, strict=True)
        del ldm
    weight_bytes = sum(p.numel() * p.element_size() for p in unet.parameters())
    if args.offload == "none":
        unet = unet.to(dev).eval()
    else:
        unet.eval().enable_group_offload(
            onload_device=dev, offload_device=torch.device("cpu"),
            offload_type=f"{args.offload}_level", num_blocks_per_group=1, use_stream=True)

    b, n_ctx = 2, 77
    side, ctx_dim = (128, 2048) if xl else (64, 768)
    extra = {}
    if xl:
        extra["added_cond_kwargs"] = {
            "text_embeds": torch.zeros(b, 1280, device=dev, dtype=torch.float16),
            "time_ids": torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]] * b, device=dev, dtype=torch.float16),
        }
    if args.dump and not xl:
        rd = lambda n: torch.from_numpy(np.fromfile(f"{args.dump}/{n}", dtype="<f4"))
        x = rd("x.f32").reshape(b, 4, 64, 64)
        t = rd("t.f32").reshape(b)
        c = rd("ctx.f32").reshape(b, n_ctx, 768)
        ours = rd("out.f32").reshape(b, 4, 64, 64)
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(b, 4, side, side, generator=g) * 2 - 1
        t = torch.tensor([999.0, 499.0])
        c = torch.rand(b, n_ctx, ctx_dim, generator=g) * 2 - 1
        ours = None
    x16, t16, c16 = x.to(dev, torch.float16), t.to(dev), c.to(dev, torch.float16)

    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(args.warmup):
            out16 = unet(x16, t16, encoder_hidden_states=c16, **extra).sample
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            unet(x16, t16, encoder_hidden_states=c16, **extra)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    res = {
        "cmd": "diffusers-unet",
        "model": args.model,
        "offload": args.offload,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "device_used_bytes_after": total - free,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "weight_bytes": weight_bytes,
        "step_ms_median": float(np.median(times)),
        "step_ms_min": float(np.min(times)),
        "iters": args.iters,
        "peak_allocated_bytes": peak,
        "attn_processor": type(next(iter(unet.attn_processors.values()))).__name__,
    }
    if ours is not None and args.offload == "none":
        unet32 = unet.float()
        with torch.no_grad():
            ref = unet32(x.to(dev), t.to(dev), encoder_hidden_states=c.to(dev)).sample.cpu()
        res["rel_l2_sdrs_vs_f32_ref"] = rel_l2(ours, ref)
        res["rel_l2_diffusers_f16_vs_f32_ref"] = rel_l2(out16.float().cpu(), ref)
        res["rel_l2_sdrs_vs_diffusers_f16"] = rel_l2(ours, out16.float().cpu())
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    sys.exit(main())
