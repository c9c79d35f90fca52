#!/usr/bin/env python3
"""Writes a random full-size SD1.5 checkpoint in the original (LDM / stable-diffusion.cpp)
single-file layout, f16, for end-to-end runs where no real weights can be fetched.

The tensor names and shapes are the name fixtures of `crates/sd-formats/tests/fixtures/names/`
(`sd15_unet_original`, `sd15_clip_original`, `sd_vae_original`, made from the real diffusers /
transformers models by `scripts/fixtures/make_name_fixtures.py`). Values: weights normal with
std 1/sqrt(fan_in) (so activations stay in f16 range), norm scales 1, biases 0; seeded.

usage: random_sd15.py OUT.safetensors [--seed 0] [--names DIR]
Needs numpy and safetensors only (both on the GPU machine's image); about 2.1 GB written.
"""

import argparse
import os

import numpy as np
from safetensors.numpy import save_file

NAMES = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "../../crates/sd-formats/tests/fixtures/names",
)
FIXTURES = ["sd15_unet_original", "sd15_clip_original", "sd_vae_original"]


def entries(names):
    for fx in FIXTURES:
        with open(os.path.join(names, fx + ".txt")) as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                name, shape = line.rstrip("\n").split("\t")
                yield name, tuple(int(d) for d in shape.split(",") if d)


def value(rng, name, shape):
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return np.zeros(shape, np.float16)
    if len(shape) == 1:  # norm scales
        return np.ones(shape, np.float16)
    if "embedding" in name:
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
    fan_in = int(np.prod(shape[1:]))
    std = 1.0 / np.sqrt(fan_in)
    return (rng.standard_normal(shape, np.float32) * std).astype(np.float16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--names", default=NAMES, help="the name fixtures' directory")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    sd = {name: value(rng, name, shape) for name, shape in entries(a.names)}
    save_file(sd, a.out)
    total = sum(t.nbytes for t in sd.values())
    print(f"wrote {a.out}: {len(sd)} tensors, {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
