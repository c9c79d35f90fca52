#!/usr/bin/env python3
"""Generates images from the single-file built-in model with diffusers (CPU is fine: the
model is tiny), as a reference for the Rust pipeline.

The file is loaded back into diffusers models through the inverse of `convert.py`'s
mapping; prompts are tokenized with the real CLIP BPE (open_clip's, if installed) or looked
up in `caption_ids.json` (the training captions). Each image is also pixel-checked.

Usage:
    python3 scripts/builtin_model/sample.py "a red circle on a blue background" -o out.png
    python3 scripts/builtin_model/sample.py --check   # the six check prompts, 4 seeds each
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check  # noqa: E402
import convert  # noqa: E402
import make_dataset as ds  # noqa: E402
import train  # noqa: E402

DEFAULT_MODEL = os.path.join(HERE, "..", "..", "models", "builtin", "sd-rs-shapes.safetensors")


def load(path, dev="cpu"):
    vae, unet, text = train.build_models()
    up_attn = [t.startswith("CrossAttn") for t in train.UNET_CONFIG["up_block_types"]]
    _, back = convert.to_original(unet.state_dict(), vae.state_dict(), text.state_dict(),
                                  train.UNET_CONFIG["layers_per_block"], up_attn,
                                  len(train.VAE_CONFIG["block_out_channels"]))
    return train.load_back(path, back, dev)


def tokenize(prompt):
    try:
        from open_clip.tokenizer import SimpleTokenizer

        ids = [ds.BOS] + SimpleTokenizer().encode(prompt)[: ds.MAX_LEN - 2] + [ds.EOS]
    except ImportError:
        data = json.load(open(ds.CAPTION_IDS, encoding="utf-8"))
        ids = data["ids"][data["captions"].index(prompt)]
    return ids + [ds.PAD] * (ds.MAX_LEN - len(ids))


@torch.no_grad()
def generate(models, prompt, seed=0, steps=20, cfg=5.0, ancestral=False):
    from diffusers import EulerAncestralDiscreteScheduler, EulerDiscreteScheduler

    vae, unet, text = models
    ids = torch.tensor([tokenize(prompt), tokenize("")])
    emb = text(input_ids=ids).last_hidden_state
    sc = EulerAncestralDiscreteScheduler if ancestral else EulerDiscreteScheduler
    img = check.sample(unet, vae, emb[:1], emb[1:], sc, train.SCHEDULER_CONFIG, steps, cfg, [seed], "cpu")
    return check.to_u8(img)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt", nargs="?", default="a red circle on a blue background")
    ap.add_argument("-o", "--output", default="sd-rs-shapes.png")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=5.0)
    ap.add_argument("--ancestral", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    models = load(args.model)
    if args.check:
        ok = n = 0
        for c, s, b in check.CHECK_PROMPTS:
            p = ds.caption(c, s, b)
            for seed in range(4):
                r = check.classify(generate(models, p, seed, args.steps, args.cfg, args.ancestral))
                good = (r["fg"], r["shape"], r["bg"]) == (c, s, b)
                ok, n = ok + good, n + 1
                print(f"{p:40s} seed {seed}: {r['fg']} {r['shape']} on {r['bg']} {'ok' if good else 'WRONG'}")
        print(f"{ok}/{n} correct")
        return
    from PIL import Image

    im = generate(models, args.prompt, args.seed, args.steps, args.cfg, args.ancestral)
    Image.fromarray(im).save(args.output)
    r = check.classify(im)
    print(f"{args.output}: {r['fg']} {r['shape']} on {r['bg']}")


if __name__ == "__main__":
    main()
