#!/usr/bin/env python3
"""Peer side of `cargo xtask bench upscale`: the same tiled x4 upscale with spandrel's
RRDBNet (Real-ESRGAN x4plus size: 23 blocks, 64 features, random weights) on PyTorch CPU.

The tiling is sd-rs's (`sd_pipeline::upscale`): square tiles of `--tile` input pixels
overlapping by a quarter, the last tile moved back to the border, outputs blended with
weights zero in the outer quarter of each overlap and ramping over its middle half; so both
sides compute the same convolutions. Prints one JSON line.

Usage: python3 scripts/bench/upscale_bench.py [--size 512] [--threads 2] [--tile 128]
"""

import argparse
import json
import time

import numpy as np
import torch
from spandrel.architectures.ESRGAN import ESRGAN


def tile_starts(length, tile, overlap):
    if tile == 0 or length <= tile:
        return [0]
    stride = max(tile - min(overlap, tile - 1), 1)
    starts, s = [], 0
    while s + tile < length:
        starts.append(s)
        s += stride
    starts.append(length - tile)
    return starts


def axis_weights(n, overlap, before, after):
    margin, ramp = overlap / 4.0, max(overlap / 2.0, 1.0)
    o = np.arange(n, dtype=np.float32)
    w = np.ones(n, dtype=np.float32)
    if before:
        w *= np.clip((o + 0.5 - margin) / ramp, 0.0, 1.0)
    if after:
        w *= np.clip((n - o - 0.5 - margin) / ramp, 0.0, 1.0)
    return w


def upscale(model, x, tile, scale):
    _, c, h, w = x.shape
    overlap = tile // 4
    th, tw = min(tile, h), min(tile, w)
    ys, xs = tile_starts(h, th, overlap), tile_starts(w, tw, overlap)
    acc = np.zeros((3, h * scale, w * scale), dtype=np.float32)
    wsum = np.zeros((h * scale, w * scale), dtype=np.float32)
    for iy, y0 in enumerate(ys):
        wy = axis_weights(th * scale, overlap * scale, iy > 0, iy + 1 < len(ys))
        for ix, x0 in enumerate(xs):
            wx = axis_weights(tw * scale, overlap * scale, ix > 0, ix + 1 < len(xs))
            with torch.no_grad():
                out = model(x[:, :, y0:y0 + th, x0:x0 + tw])[0].numpy()
            wgt = wy[:, None] * wx[None, :]
            ys_, xs_ = slice(y0 * scale, (y0 + th) * scale), slice(x0 * scale, (x0 + tw) * scale)
            acc[:, ys_, xs_] += out * wgt
            wsum[ys_, xs_] += wgt
    return acc / wsum


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tile", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = ESRGAN(in_nc=3, out_nc=3, num_filters=64, num_blocks=23, scale=4).eval()
    x = torch.rand((1, 3, a.size, a.size))
    t0 = time.perf_counter()
    y = upscale(model, x, a.tile, 4)
    secs = time.perf_counter() - t0
    n_tiles = len(tile_starts(a.size, min(a.tile, a.size), a.tile // 4)) ** 2
    print(json.dumps({
        "impl": f"spandrel {__import__('spandrel').__version__} / torch {torch.__version__} CPU",
        "size": a.size, "out": y.shape[-1], "threads": a.threads, "tile": a.tile,
        "tiles": n_tiles, "params": sum(p.numel() for p in model.parameters()),
        "seconds": round(secs, 3),
    }))


if __name__ == "__main__":
    main()
