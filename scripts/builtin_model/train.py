#!/usr/bin/env python3
"""Trains sd-rs's built-in model: a tiny SD1.x-architecture text-to-image model (CLIP text
encoder, UNet2DConditionModel, AutoencoderKL) on the drawings of `make_dataset.py`, with
diffusers, and writes it as ONE original-layout single-file safetensors
(`models/builtin/sd-rs-shapes.safetensors`, f16) plus its config JSON, sample images and
pixel-check metrics.

Stages:
1. VAE (AutoencoderKL, 3 levels: 64x64x3 <-> 16x16x4) trained from scratch: MSE + L1 +
   a small KL term. Its latent space is then rescaled (quant_conv / post_quant_conv folded)
   so that SD1's fixed scaling factor 0.18215 brings the latents to unit std.
2. CLIP text encoder + UNet trained jointly from scratch, eps-prediction, SD1's DDPM
   schedule (scaled_linear, 0.00085..0.012, 1000 steps), 10% empty captions for
   classifier-free guidance, bf16 autocast on CUDA, AdamW, cosine LR, EMA weights.
3. Conversion to the original layout (`convert.py`), f16, saved; the file is loaded back
   into fresh diffusers models and sampled (diffusers' StableDiffusionPipeline, Euler,
   20 steps, CFG 5) for the six check prompts; dominant colours and shape are measured on
   the pixels (`check.py`).

Usage (GPU; the committed model was made with exactly this, on one H200, in 7.5 minutes):
    python3 scripts/builtin_model/make_dataset.py      # only if caption_ids.json must change
    python3 scripts/builtin_model/train.py --out DIR --vae-seconds 75 --diff-seconds 360 --log-every 1000
    cp DIR/{sd-rs-shapes.safetensors,sd-rs-shapes.json,metrics.json,train.log} models/builtin/
    cp -r DIR/samples models/builtin/
Smoke (CPU, ~1 minute):
    python3 scripts/builtin_model/train.py --out /tmp/smoke --smoke

Step counts depend on throughput under a time budget (--*-seconds); the LR schedules follow
the fraction of the budget spent. `--vae-steps N --diff-steps M --vae-seconds 0
--diff-seconds 0` fixes the step counts instead (the committed run: 2982 and 3911).
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import check  # noqa: E402
import convert  # noqa: E402
import make_dataset as ds  # noqa: E402

SCALING_FACTOR = 0.18215  # SD1's; the VAE is rescaled to fit it

CLIP_CONFIG = dict(
    vocab_size=49408,
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    bos_token_id=ds.BOS,
    eos_token_id=ds.EOS,
    pad_token_id=ds.PAD,
    projection_dim=32,
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 3,
    up_block_types=["UpDecoderBlock2D"] * 3,
    block_out_channels=[32, 64, 64],
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=64,
    scaling_factor=SCALING_FACTOR,
)
UNET_CONFIG = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    block_out_channels=[32, 64, 64],
    layers_per_block=2,
    norm_num_groups=8,
    cross_attention_dim=32,
    attention_head_dim=4,  # diffusers' SD1 naming: the number of heads
    use_linear_projection=False,
)
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="epsilon",
    steps_offset=1,
    clip_sample=False,
    set_alpha_to_one=False,
    timestep_spacing="leading",
)


def log(msg, f=None):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if f:
        f.write(line + "\n")
        f.flush()


def caption_ids(device):
    with open(ds.CAPTION_IDS, encoding="utf-8") as f:
        data = json.load(f)
    assert data["captions"] == ds.all_captions(), "caption_ids.json is stale: run make_dataset.py"
    ids = [i + [ds.PAD] * (ds.MAX_LEN - len(i)) for i in data["ids"]]
    return torch.tensor(ids, dtype=torch.long, device=device)


def build_models():
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    vae = AutoencoderKL(**VAE_CONFIG)
    unet = UNet2DConditionModel(**UNET_CONFIG)
    text = CLIPTextModel(CLIPTextConfig(**CLIP_CONFIG))
    return vae, unet, text


def lr_at(p, base, warm):
    if p < warm:
        return base * p / warm
    q = (p - warm) / max(1e-9, 1 - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, q))))


class Budget:
    """Progress in [0, 1] from a step count and/or a time limit (whichever comes first)."""

    def __init__(self, steps, seconds):
        self.steps, self.seconds, self.t0 = steps, seconds, time.time()

    def progress(self, step):
        p = 0.0
        if self.steps:
            p = max(p, step / self.steps)
        if self.seconds:
            p = max(p, (time.time() - self.t0) / self.seconds)
        return p


def train_vae(vae, args, dev, amp, logf):
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    budget = Budget(args.vae_steps, args.vae_seconds)
    vae.train()
    step, t0 = 0, time.time()
    while budget.progress(step) < 1.0:
        for pg in opt.param_groups:
            pg["lr"] = lr_at(budget.progress(step), args.vae_lr, 0.03)
        x, _, _ = ds.batch(args.vae_batch, g, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            post = vae.encode(x).latent_dist
            z = post.sample()
            rec = vae.decode(z).sample
        rec = rec.float()
        mse = F.mse_loss(rec, x)
        l1 = (rec - x).abs().mean()
        kl = post.kl().float().mean() / z[0].numel()
        loss = mse + 0.1 * l1 + args.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            log(f"vae step {step} loss {loss.item():.5f} mse {mse.item():.5f} kl/elem {kl.item():.3f} "
                f"({(time.time() - t0) / max(1, step):.3f} s/step)", logf)
        step += 1
    vae.eval()
    # Rescale the latent space for SD1's scaling factor: z' = k z.
    with torch.no_grad():
        xs = [ds.batch(16 if args.smoke else 256, g, dev)[0] for _ in range(4)]
        zs = torch.cat([vae.encode(x).latent_dist.sample() for x in xs])
        std = zs.float().std().item()
        mean = zs.float().mean().item()
        k = 1.0 / (SCALING_FACTOR * std)
        c = vae.config.latent_channels
        qc, pqc = vae.quant_conv, vae.post_quant_conv
        qc.weight[:c] *= k
        qc.bias[:c] *= k
        qc.bias[c:] += 2 * math.log(k)  # log-variance of k z
        pqc.weight /= k
        zs2 = torch.cat([vae.encode(x).latent_dist.mean for x in xs])
        rec = vae.decode(zs2[: len(xs[0])]).sample
        mse = F.mse_loss(rec.float(), xs[0]).item()
    log(f"vae done: {step} steps, {time.time() - t0:.1f} s; raw latent std {std:.4f} mean {mean:.4f}, "
        f"rescaled by {k:.4f}; scaled latent std {(zs2.std() * SCALING_FACTOR).item():.4f}; "
        f"recon mse {mse:.5f}", logf)
    return dict(steps=step, seconds=time.time() - t0, final_loss=loss.item(), recon_mse=mse,
                raw_latent_std=std, raw_latent_mean=mean, latent_rescale=k)


def train_diffusion(vae, unet, text, args, dev, amp, logf):
    from diffusers import DDPMScheduler

    sched = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    ids = caption_ids(dev)
    params = list(unet.parameters()) + list(text.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99), fused=dev.type == "cuda")
    ema = [p.detach().clone().float() for p in params]
    g = torch.Generator().manual_seed(2)
    gd = torch.Generator(device=dev).manual_seed(3)
    budget = Budget(args.diff_steps, args.diff_seconds)
    unet.train()
    text.train()
    vae.requires_grad_(False)
    acp = sched.alphas_cumprod.to(dev)
    step, t0, run_loss = 0, time.time(), None
    while budget.progress(step) < 1.0:
        p = budget.progress(step)
        for pg in opt.param_groups:
            pg["lr"] = lr_at(p, args.lr, 0.02)
        x, cap, _ = ds.batch(args.batch, g, dev)
        cap = cap.to(dev)
        drop = torch.rand(cap.shape, generator=gd, device=dev) < args.uncond_prob
        cap = torch.where(drop, torch.zeros_like(cap), cap)
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            lat = vae.encode(x).latent_dist.sample(generator=gd).float() * SCALING_FACTOR
        noise = torch.randn(lat.shape, generator=gd, device=dev)
        t = torch.randint(0, 1000, (lat.shape[0],), generator=gd, device=dev)
        a = acp[t].sqrt()[:, None, None, None]
        s = (1 - acp[t]).sqrt()[:, None, None, None]
        noisy = a * lat + s * noise
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            ctx = text(input_ids=ids[cap]).last_hidden_state
            pred = unet(noisy, t, encoder_hidden_states=ctx).sample
        loss = F.mse_loss(pred.float(), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema, [q.detach().float() for q in params], 1 - decay)
        li = loss.item() if step % 10 == 0 else None
        if li is not None:
            run_loss = li if run_loss is None else 0.9 * run_loss + 0.1 * li
        if step % args.log_every == 0:
            log(f"diff step {step} loss {loss.item():.4f} avg {run_loss:.4f} gn {gn.item():.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} ({(time.time() - t0) / max(1, step):.3f} s/step)", logf)
        step += 1
    with torch.no_grad():
        for q, e in zip(params, ema):
            q.copy_(e.to(q.dtype))
    unet.eval()
    text.eval()
    log(f"diffusion done: {step} steps, {time.time() - t0:.1f} s, avg loss {run_loss:.4f}", logf)
    return dict(steps=step, seconds=time.time() - t0, avg_loss=run_loss, batch=args.batch, lr=args.lr,
                ema=args.ema, uncond_prob=args.uncond_prob)


def export(vae, unet, text, path):
    up_attn = [t.startswith("CrossAttn") for t in UNET_CONFIG["up_block_types"]]
    state, back = convert.to_original(
        {k: v.detach().cpu() for k, v in unet.state_dict().items()},
        {k: v.detach().cpu() for k, v in vae.state_dict().items()},
        {k: v.detach().cpu() for k, v in text.state_dict().items()},
        UNET_CONFIG["layers_per_block"],
        up_attn,
        len(VAE_CONFIG["block_out_channels"]),
    )
    from safetensors.torch import save_file

    state = {k: v.to(torch.float16).contiguous() for k, v in sorted(state.items())}
    save_file(state, path, metadata={
        "format": "pt",
        "sd-rs": "built-in model sd-rs-shapes, made by scripts/builtin_model/train.py",
    })
    return back


def load_back(path, back, dev):
    """Loads the single file into fresh diffusers models (f32): what a user of the file gets."""
    from safetensors.torch import load_file

    comps = convert.from_original(load_file(path), back)
    vae, unet, text = build_models()
    vae.load_state_dict(comps["vae"], strict=True)
    unet.load_state_dict(comps["unet"], strict=True)
    missing, unexpected = text.load_state_dict(comps["text_encoder"], strict=False)
    assert not unexpected and all(m.endswith("position_ids") for m in missing), (missing, unexpected)
    return [m.float().to(dev).eval() for m in (vae, unet, text)]


def config_json(vae_stats, diff_stats, file_path):
    ch = VAE_CONFIG["block_out_channels"]
    uch = UNET_CONFIG["block_out_channels"]
    n_params = None
    return {
        "name": "sd-rs-shapes",
        "file": os.path.basename(file_path),
        "architecture": "SD1.x (CLIP text encoder + UNet + AutoencoderKL), tiny, trained from scratch",
        "resolution": [ds.SIZE, ds.SIZE],
        "vae_downsample": 2 ** (len(ch) - 1),
        "latent_shape": [4, ds.SIZE // 2 ** (len(ch) - 1), ds.SIZE // 2 ** (len(ch) - 1)],
        "scaling_factor": SCALING_FACTOR,
        "prediction_type": "epsilon",
        "scheduler": SCHEDULER_CONFIG,
        "clip_skip": 1,
        "tokenizer": {
            "vocabulary": "OpenAI CLIP BPE, 49408 tokens (open_clip bpe_simple_vocab_16e6)",
            "bos": ds.BOS, "eos": ds.EOS, "pad": ds.PAD, "max_length": ds.MAX_LEN,
        },
        "diffusers": {"text_encoder": CLIP_CONFIG, "unet": UNET_CONFIG, "vae": VAE_CONFIG},
        "ldm": {
            "unet": {
                "model_channels": uch[0],
                "channel_mult": [c // uch[0] for c in uch],
                "num_res_blocks": UNET_CONFIG["layers_per_block"],
                "attention_resolutions": [2 ** i for i, t in enumerate(UNET_CONFIG["down_block_types"]) if t.startswith("CrossAttn")],
                "num_heads": UNET_CONFIG["attention_head_dim"],
                "transformer_depth": 1,
                "context_dim": UNET_CONFIG["cross_attention_dim"],
                "use_linear_in_transformer": UNET_CONFIG["use_linear_projection"],
                "norm_groups": UNET_CONFIG["norm_num_groups"],
                "time_embed_dim": 4 * uch[0],
            },
            "vae": {
                "ch": ch[0],
                "ch_mult": [c // ch[0] for c in ch],
                "num_res_blocks": VAE_CONFIG["layers_per_block"],
                "z_channels": VAE_CONFIG["latent_channels"],
                "embed_dim": VAE_CONFIG["latent_channels"],
                "norm_groups": VAE_CONFIG["norm_num_groups"],
                "attn_resolutions": [],
                "mid_attention": True,
            },
            "clip": {k: CLIP_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings", "hidden_act", "layer_norm_eps")},
        },
        "captions": "'<a|an> <colour> <shape> on <a|an> <colour> background', colours "
        + ", ".join(ds.COLOUR_NAMES) + "; shapes " + ", ".join(ds.SHAPES),
        "training": {"vae": vae_stats, "diffusion": diff_stats},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="a few CPU steps of everything")
    ap.add_argument("--vae-steps", type=int, default=0)
    ap.add_argument("--vae-seconds", type=float, default=75)
    ap.add_argument("--vae-batch", type=int, default=128)
    ap.add_argument("--vae-lr", type=float, default=1e-3)
    ap.add_argument("--vae-kl", type=float, default=1e-4)
    ap.add_argument("--diff-steps", type=int, default=0)
    ap.add_argument("--diff-seconds", type=float, default=330)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--uncond-prob", type=float, default=0.1)
    ap.add_argument("--seeds", type=int, default=8, help="samples per check prompt")
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--keep-vae", action="store_true", help="also save the trained VAE (diffusers names)")
    args = ap.parse_args()
    if args.smoke:
        args.vae_steps, args.vae_seconds, args.vae_batch = 3, 0, 8
        args.diff_steps, args.diff_seconds, args.batch = 3, 0, 8
        args.seeds, args.log_every = 2, 1

    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "train.log"), "w", encoding="utf-8")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = dev.type == "cuda"
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log(f"device {torch.cuda.get_device_name()}", logf)
    import diffusers
    import transformers

    log(f"torch {torch.__version__} diffusers {diffusers.__version__} transformers {transformers.__version__}", logf)

    vae, unet, text = build_models()
    counts = {n: sum(p.numel() for p in m.parameters()) for n, m in (("vae", vae), ("unet", unet), ("text_encoder", text))}
    log(f"parameters {counts}", logf)
    vae, unet, text = vae.to(dev), unet.to(dev), text.to(dev)

    t_all = time.time()
    vae_stats = train_vae(vae, args, dev, amp, logf)
    torch.save(vae.state_dict(), os.path.join(args.out, "vae_diffusers.pt")) if args.keep_vae else None
    diff_stats = train_diffusion(vae, unet, text, args, dev, amp, logf)

    path = os.path.join(args.out, "sd-rs-shapes.safetensors")
    back = export(vae, unet, text, path)
    size = os.path.getsize(path)
    log(f"wrote {path}: {size} bytes", logf)

    vae2, unet2, text2 = load_back(path, back, dev)
    metrics = check.evaluate(vae2, unet2, text2, caption_ids(dev), SCHEDULER_CONFIG, args.out, args.seeds, dev, logf=lambda m: log(m, logf), broad=not args.smoke)
    cfg = config_json(vae_stats, diff_stats, path)
    cfg["parameters"] = counts
    cfg["file_bytes"] = size
    cfg["training"]["total_seconds"] = time.time() - t_all
    cfg["training"]["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    with open(os.path.join(args.out, "sd-rs-shapes.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "metrics.json"), "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=1)
        f.write("\n")
    log("done", logf)


if __name__ == "__main__":
    main()
