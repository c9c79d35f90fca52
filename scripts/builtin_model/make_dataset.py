#!/usr/bin/env python3
"""The drawings the built-in model `models/builtin/sd-rs-shapes.safetensors` is trained on.

Every image is 64x64 RGB: one flat-coloured shape (circle, square or triangle) on a flat
background of another colour, at a random size and position, rendered analytically with
1-pixel anti-aliased edges. Its caption is "a <colour> <shape> on a <colour> background" ("an" before
"orange").
Everything is a pure function of a seed (torch's CPU generator), so the stream the trainer
draws from is reproducible, and the same code renders on the CPU or on a GPU.

The captions come from a closed set (8 shape colours x 3 shapes x 7 background colours = 168
captions, plus the empty caption used for classifier-free guidance). They are tokenized once
here with the real CLIP BPE tokenizer (the vocabulary shipped by `open-clip-torch`, which is
OpenAI's 49408-token CLIP vocabulary) and written to `caption_ids.json`, so the trainer
needs no tokenizer. Token ids: `<|startoftext|>` 49406, the words, `<|endoftext|>` 49407,
then padded to 77 with 49407 (SD1's tokenizer convention).

Usage:
    pip install open-clip-torch
    python3 scripts/builtin_model/make_dataset.py            # writes caption_ids.json
    python3 scripts/builtin_model/make_dataset.py --preview out.png --n 64
    python3 scripts/builtin_model/make_dataset.py --dump DIR --n 1000  # PNGs + captions.jsonl
"""

import argparse
import json
import math
import os

import torch

SIZE = 64
MAX_LEN = 77
BOS, EOS, PAD = 49406, 49407, 49407

# name -> sRGB (0..255). Chosen far apart so the dominant colour of a pixel is unambiguous.
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "purple": (140, 40, 180),
    "orange": (250, 140, 20),
}
COLOUR_NAMES = list(COLOURS)
SHAPES = ["circle", "square", "triangle"]
# Fraction of its bounding box a shape covers (used by the pixel checks).
FILL = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTION_IDS = os.path.join(HERE, "caption_ids.json")


def article(word):
    return "an" if word[0] in "aeiou" else "a"


def caption(colour, shape, background):
    return f"{article(colour)} {colour} {shape} on {article(background)} {background} background"


def all_captions():
    """The closed caption set, index 0 the empty caption."""
    caps = [""]
    for c in COLOUR_NAMES:
        for s in SHAPES:
            for b in COLOUR_NAMES:
                if b != c:
                    caps.append(caption(c, s, b))
    return caps


def caption_index():
    return {c: i for i, c in enumerate(all_captions())}


def render(colour_idx, shape_idx, bg_idx, cx, cy, r, jitter):
    """Renders a batch of drawings. All arguments are 1-D tensors of the batch size on one
    device: colour/shape/background indices, centre (pixels), half-size r (pixels) and a
    per-image colour jitter of shape [B, 2, 3] (shape, background; in 0..255 units).
    Returns float images in [-1, 1], [B, 3, SIZE, SIZE]."""
    dev = cx.device
    pal = torch.tensor([COLOURS[n] for n in COLOUR_NAMES], dtype=torch.float32, device=dev)
    ys, xs = torch.meshgrid(
        torch.arange(SIZE, device=dev, dtype=torch.float32) + 0.5,
        torch.arange(SIZE, device=dev, dtype=torch.float32) + 0.5,
        indexing="ij",
    )
    x = xs[None] - cx[:, None, None]
    y = ys[None] - cy[:, None, None]
    rr = r[:, None, None]
    # Signed distances (negative inside), in pixels.
    d_circle = torch.sqrt(x * x + y * y) - rr
    d_square = torch.maximum(x.abs(), y.abs()) - rr
    # Upward isosceles triangle inscribed in the box [-r, r]^2: apex (0, -r), base y = r.
    k = 2.0  # half-width over height ratio of each side's slope: |x| = (y + r) / 2
    d_side = (2.0 * x.abs() - (y + rr)) / math.sqrt(1.0 + k * k)
    d_tri = torch.maximum(d_side, y - rr)
    d = torch.where(
        shape_idx[:, None, None] == 0,
        d_circle,
        torch.where(shape_idx[:, None, None] == 1, d_square, d_tri),
    )
    alpha = (0.5 - d).clamp(0.0, 1.0)[:, None]  # [B, 1, H, W]
    fg = (pal[colour_idx] + jitter[:, 0]).clamp(0, 255)[:, :, None, None]
    bg = (pal[bg_idx] + jitter[:, 1]).clamp(0, 255)[:, :, None, None]
    img = alpha * fg + (1 - alpha) * bg
    return img / 127.5 - 1.0


def sample_params(n, generator):
    """Random drawing parameters for n images (on the CPU, from `generator`)."""
    g = generator
    nc = len(COLOUR_NAMES)
    colour = torch.randint(0, nc, (n,), generator=g)
    # Background: any colour but the shape's.
    bg = (colour + torch.randint(1, nc, (n,), generator=g)) % nc
    shape = torch.randint(0, len(SHAPES), (n,), generator=g)
    r = 9.0 + 11.0 * torch.rand(n, generator=g)  # half-size 9..20 px (18..40 px wide)
    margin = r + 2.0
    cx = margin + (SIZE - 2 * margin) * torch.rand(n, generator=g)
    cy = margin + (SIZE - 2 * margin) * torch.rand(n, generator=g)
    jitter = 12.0 * (2 * torch.rand(n, 2, 3, generator=g) - 1)
    return colour, shape, bg, cx, cy, r, jitter


def batch(n, generator, device="cpu"):
    """n random drawings: (images [-1, 1] [n, 3, 64, 64] on `device`, caption indices [n]
    into `all_captions()`, captions)."""
    colour, shape, bg, cx, cy, r, jitter = sample_params(n, generator)
    idx = caption_index()
    caps = [
        caption(COLOUR_NAMES[c], SHAPES[s], COLOUR_NAMES[b])
        for c, s, b in zip(colour.tolist(), shape.tolist(), bg.tolist())
    ]
    cap_idx = torch.tensor([idx[c] for c in caps])
    imgs = render(*(t.to(device) for t in (colour, shape, bg, cx, cy, r, jitter)))
    return imgs, cap_idx, caps


def tokenize_all():
    """Token ids of every caption with the real CLIP BPE (open_clip's SimpleTokenizer)."""
    from open_clip.tokenizer import SimpleTokenizer

    tok = SimpleTokenizer()
    assert tok.encoder["<start_of_text>"] == BOS and tok.encoder["<end_of_text>"] == EOS
    assert len(tok.encoder) == 49408
    # Sanity check against a known OpenAI CLIP tokenization.
    assert tok.encode("a photo of a cat") == [320, 1125, 539, 320, 2368]
    out = []
    for c in all_captions():
        ids = [BOS] + tok.encode(c) + [EOS]
        ids = ids + [PAD] * (MAX_LEN - len(ids))
        out.append(ids)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preview", help="write a grid PNG of --n drawings")
    ap.add_argument("--dump", help="write --n PNGs and captions.jsonl to this folder")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if not args.preview and not args.dump:
        ids = tokenize_all()
        caps = all_captions()
        with open(CAPTION_IDS, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "tokenizer": "CLIP BPE (open_clip bpe_simple_vocab_16e6, 49408 tokens)",
                    "bos": BOS,
                    "eos": EOS,
                    "pad": PAD,
                    "max_length": MAX_LEN,
                    "captions": caps,
                    "ids": [i[: i.index(EOS) + 1] for i in ids],
                },
                f,
                indent=0,
            )
            f.write("\n")
        print(f"{CAPTION_IDS}: {len(caps)} captions")
        return

    import numpy as np
    from PIL import Image

    g = torch.Generator().manual_seed(args.seed)
    imgs, _, caps = batch(args.n, g)
    u8 = ((imgs + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    if args.preview:
        cols = int(math.ceil(math.sqrt(args.n)))
        rows = int(math.ceil(args.n / cols))
        grid = np.zeros((rows * SIZE, cols * SIZE, 3), np.uint8)
        for i, im in enumerate(u8):
            grid[(i // cols) * SIZE : (i // cols + 1) * SIZE, (i % cols) * SIZE : (i % cols + 1) * SIZE] = im
        Image.fromarray(grid).save(args.preview)
        print(args.preview)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, "captions.jsonl"), "w", encoding="utf-8") as f:
            for i, (im, c) in enumerate(zip(u8, caps)):
                name = f"{i:06d}.png"
                Image.fromarray(im).save(os.path.join(args.dump, name))
                f.write(json.dumps({"file": name, "caption": c}) + "\n")


if __name__ == "__main__":
    main()
