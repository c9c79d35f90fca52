#!/usr/bin/env python3
"""Peer side of `cargo xtask bench e2e`: one txt2img run with stable-diffusion.cpp through
its Python binding (`pip install stable-diffusion-cpp-python`, which builds it from source
for this CPU), on the checkpoint `sd` reads: 512x512, CFG 7, Euler, seed 42.

stable-diffusion.cpp's own log goes to stderr (its `sampling completed, taking S s` line is
what xtask reads); this script prints `RESULT load_seconds=` and `RESULT generate_seconds=`.

Usage: python3 scripts/bench/sdcpp_txt2img.py --model CK.safetensors [--prompt P]
       [--steps 2] [--threads 2] [--out out.png]
"""

import argparse
import time

from stable_diffusion_cpp import StableDiffusion


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", default="a photograph of an astronaut riding a horse")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="sdcpp.png")
    args = ap.parse_args()
    t0 = time.time()
    sd = StableDiffusion(model_path=args.model, n_threads=args.threads, verbose=True)
    t1 = time.time()
    images = sd.generate_image(
        prompt=args.prompt,
        width=512,
        height=512,
        cfg_scale=7.0,
        sample_method="euler",
        sample_steps=args.steps,
        seed=42,
    )
    t2 = time.time()
    images[0].save(args.out)
    print(f"RESULT load_seconds={t1 - t0:.3f}")
    print(f"RESULT generate_seconds={t2 - t1:.3f}")


if __name__ == "__main__":
    main()
