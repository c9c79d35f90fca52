#!/usr/bin/env python3
"""Pixel checks of generated shape images, and the sampling evaluation of the built-in model.

`classify(img)` reads a 64x64 RGB uint8 image the way the Rust test is meant to: every pixel
is snapped to the nearest palette colour of `make_dataset.COLOURS`; the background colour is
the most common one on the 2-pixel border; the shape colour is the most common one among the
other pixels; the shape is whichever template (circle, axis-aligned square, upward triangle),
of the same area and centroid as the shape-colour pixels, overlaps them best (IoU).

`python3 check.py --selftest` runs the classifier on training drawings (should be ~100%).
"""

import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_dataset as ds  # noqa: E402

# Three colours x two shapes, each colour on its own background.
CHECK_PROMPTS = [
    ("red", "circle", "white"),
    ("red", "square", "white"),
    ("green", "circle", "black"),
    ("green", "square", "black"),
    ("blue", "circle", "yellow"),
    ("blue", "square", "yellow"),
]

PALETTE = np.array([ds.COLOURS[n] for n in ds.COLOUR_NAMES], dtype=np.float32)


def _template(shape, h, w, cx, cy, area):
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    x, y = xs - cx, ys - cy
    if shape == "circle":
        r = math.sqrt(area / math.pi)
        return x * x + y * y <= r * r
    if shape == "square":
        r = math.sqrt(area) / 2
        return (np.abs(x) <= r) & (np.abs(y) <= r)
    r = math.sqrt(area / 2)  # triangle of width 2r, height 2r; centroid r/3 below box centre
    y = y + r / 3
    return (2 * np.abs(x) <= y + r) & (y <= r)


def classify(img):
    """img: [H, W, 3] uint8. Returns dict(fg, bg, shape, iou, fg_fraction)."""
    h, w, _ = img.shape
    d = ((img[:, :, None, :].astype(np.float32) - PALETTE[None, None]) ** 2).sum(-1)
    cls = d.argmin(-1)
    border = np.concatenate([cls[:2].ravel(), cls[-2:].ravel(), cls[:, :2].ravel(), cls[:, -2:].ravel()])
    bg = np.bincount(border, minlength=len(PALETTE)).argmax()
    rest = cls[cls != bg]
    if rest.size == 0:
        return dict(fg=None, bg=ds.COLOUR_NAMES[bg], shape=None, iou={}, fg_fraction=0.0)
    fg = np.bincount(rest, minlength=len(PALETTE)).argmax()
    mask = cls == fg
    area = float(mask.sum())
    ys, xs = np.nonzero(mask)
    cx, cy = xs.mean() + 0.5, ys.mean() + 0.5
    iou = {}
    for s in ds.SHAPES:
        t = _template(s, h, w, cx, cy, area)
        iou[s] = float((t & mask).sum() / max(1, (t | mask).sum()))
    shape = max(iou, key=iou.get)
    return dict(fg=ds.COLOUR_NAMES[fg], bg=ds.COLOUR_NAMES[bg], shape=shape, iou=iou,
                fg_fraction=area / (h * w))


def to_u8(x):
    """[-1, 1] float [B, 3, H, W] -> uint8 [B, H, W, 3]."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def selftest(n=2000):
    g = torch.Generator().manual_seed(123)
    colour, shape, bg, cx, cy, r, jitter = ds.sample_params(n, g)
    imgs = to_u8(ds.render(colour, shape, bg, cx, cy, r, jitter))
    ok = {"fg": 0, "bg": 0, "shape": 0}
    for i in range(n):
        c = classify(imgs[i])
        ok["fg"] += c["fg"] == ds.COLOUR_NAMES[colour[i]]
        ok["bg"] += c["bg"] == ds.COLOUR_NAMES[bg[i]]
        ok["shape"] += c["shape"] == ds.SHAPES[shape[i]]
    print({k: v / n for k, v in ok.items()})
    return ok


@torch.no_grad()
def sample(unet, vae, cond, uncond, sched_cls, sched_cfg, steps, cfg, seeds, dev):
    """Batched classifier-free-guided sampling with a diffusers scheduler. cond: [B, 77, C];
    seeds: [B] ints (each image's initial noise from torch.Generator(cpu).manual_seed(seed))."""
    from diffusers import SchedulerMixin  # noqa: F401

    sched = sched_cls.from_config(sched_cfg)
    sched.set_timesteps(steps, device=dev)
    b = cond.shape[0]
    h = unet.config.sample_size
    lat = torch.stack([torch.randn((4, h, h), generator=torch.Generator().manual_seed(int(s))) for s in seeds]).to(dev)
    lat = lat * sched.init_noise_sigma
    gen = torch.Generator(device=dev).manual_seed(int(seeds[0]))
    ctx = torch.cat([uncond.expand(b, -1, -1), cond])
    for t in sched.timesteps:
        inp = sched.scale_model_input(torch.cat([lat, lat]), t)
        eps_u, eps_c = unet(inp, t, encoder_hidden_states=ctx).sample.chunk(2)
        eps = eps_u + cfg * (eps_c - eps_u)
        lat = sched.step(eps, t, lat, generator=gen).prev_sample
    return vae.decode(lat / vae.config.scaling_factor).sample


def _save_png(u8, path):
    from PIL import Image

    Image.fromarray(u8).save(path)


def _grid(rows):
    """rows: list of lists of uint8 images -> one image, 2x upscaled, 2-px gaps."""
    s = rows[0][0].shape[0] * 2
    n = max(len(r) for r in rows)
    grid = np.full((len(rows) * (s + 2), n * (s + 2), 3), 128, np.uint8)
    for i, r in enumerate(rows):
        for j, im in enumerate(r):
            grid[i * (s + 2): i * (s + 2) + s, j * (s + 2): j * (s + 2) + s] = im.repeat(2, 0).repeat(2, 1)
    return grid


@torch.no_grad()
def evaluate(vae, unet, text, ids, sched_cfg, out, n_seeds, dev, logf=print, broad=True):
    from diffusers import EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, StableDiffusionPipeline

    idx = ds.caption_index()
    sdir = os.path.join(out, "samples")
    os.makedirs(sdir, exist_ok=True)
    emb = lambda i: text(input_ids=ids[i]).last_hidden_state
    uncond = emb(torch.tensor([0], device=dev))
    metrics = {"check_prompts": [], "settings": {}}

    # 1. The six check prompts through diffusers' own StableDiffusionPipeline (Euler, 20, CFG 5).
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text, tokenizer=None, unet=unet,
        scheduler=EulerDiscreteScheduler.from_config(sched_cfg), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    ).to(dev)
    pipe.set_progress_bar_config(disable=True)
    rows = []
    settings = {
        "pipeline_euler_20_cfg5": None,
        "euler_20_cfg7": (EulerDiscreteScheduler, 20, 7.0),
        "euler_a_20_cfg7": (EulerAncestralDiscreteScheduler, 20, 7.0),
        "euler_a_10_cfg5": (EulerAncestralDiscreteScheduler, 10, 5.0),
    }
    totals = {k: [0, 0] for k in settings}
    for c, s, b in CHECK_PROMPTS:
        cap = ds.caption(c, s, b)
        ci = torch.tensor([idx[cap]], device=dev)
        cond = emb(ci)
        entry = {"prompt": cap, "token_ids": ids[idx[cap]].tolist(), "results": {}}
        for name, spec in settings.items():
            seeds = list(range(n_seeds))
            if spec is None:
                imgs = pipe(
                    prompt_embeds=cond.expand(n_seeds, -1, -1), negative_prompt_embeds=uncond.expand(n_seeds, -1, -1),
                    height=ds.SIZE, width=ds.SIZE, num_inference_steps=20, guidance_scale=5.0,
                    generator=[torch.Generator().manual_seed(sd) for sd in seeds], output_type="pt",
                ).images
                u8 = to_u8(imgs * 2 - 1)
                rows.append(list(u8))
                _save_png(u8[0], os.path.join(sdir, cap.replace(" ", "_") + ".png"))
            else:
                sc, steps, g = spec
                u8 = to_u8(sample(unet, vae, cond.expand(n_seeds, -1, -1), uncond, sc, sched_cfg, steps, g, seeds, dev))
            res = [classify(im) for im in u8]
            ok = [r["fg"] == c and r["bg"] == b and r["shape"] == s for r in res]
            entry["results"][name] = {
                "correct": int(sum(ok)), "of": len(ok),
                "fg_ok": int(sum(r["fg"] == c for r in res)),
                "bg_ok": int(sum(r["bg"] == b for r in res)),
                "shape_ok": int(sum(r["shape"] == s for r in res)),
                "wrong": [dict(seed=i, **{k: r[k] for k in ("fg", "bg", "shape")}) for i, (r, o) in enumerate(zip(res, ok)) if not o],
            }
            totals[name][0] += sum(ok)
            totals[name][1] += len(ok)
            logf(f"{name:24s} {cap:40s} {sum(ok)}/{len(ok)} (fg {entry['results'][name]['fg_ok']}, bg {entry['results'][name]['bg_ok']}, shape {entry['results'][name]['shape_ok']})")
        metrics["check_prompts"].append(entry)
    metrics["settings"] = {k: {"correct": v[0], "of": v[1]} for k, v in totals.items()}
    _save_png(_grid(rows), os.path.join(sdir, "check_prompts_grid.png"))

    # 2. Every training caption, 2 seeds each, Euler 20 steps CFG 5: the broad accuracy.
    if not broad:
        return metrics
    caps = ds.all_captions()[1:]
    allres = {"fg": 0, "bg": 0, "shape": 0, "all": 0, "n": 0}
    per_shape = {s: [0, 0] for s in ds.SHAPES}
    for seed in (100, 101):
        for start in range(0, len(caps), 84):
            chunk = caps[start:start + 84]
            ci = torch.tensor([idx[c] for c in chunk], device=dev)
            u8 = to_u8(sample(unet, vae, emb(ci), uncond, EulerDiscreteScheduler, sched_cfg, 20, 5.0,
                              [seed * 1000 + start + i for i in range(len(chunk))], dev))
            for cap, im in zip(chunk, u8):
                words = cap.split()
                c, s, b = words[1], words[2], words[5]
                r = classify(im)
                allres["fg"] += r["fg"] == c
                allres["bg"] += r["bg"] == b
                allres["shape"] += r["shape"] == s
                ok = r["fg"] == c and r["bg"] == b and r["shape"] == s
                allres["all"] += ok
                allres["n"] += 1
                per_shape[s][0] += ok
                per_shape[s][1] += 1
    allres = {k: (v / allres["n"] if k != "n" else v) for k, v in allres.items()}
    allres["per_shape_all_correct"] = {s: v[0] / max(1, v[1]) for s, v in per_shape.items()}
    metrics["all_captions_euler_20_cfg5_2seeds"] = allres
    logf(f"settings {json.dumps(metrics['settings'])}")
    logf(f"all captions {json.dumps(allres)}")
    return metrics


if __name__ == "__main__":
    if "--selftest" in sys.argv:
        selftest()
