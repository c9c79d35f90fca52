#!/usr/bin/env python3
"""Prints how far image B is from reference image A (8-bit RGB): max and mean absolute
difference per channel value, PSNR, and the share of values differing by more than 8.

usage: compare.py A.png B.png"""

import sys

import numpy as np
from PIL import Image

a = np.asarray(Image.open(sys.argv[1]).convert("RGB"), dtype=np.int16)
b = np.asarray(Image.open(sys.argv[2]).convert("RGB"), dtype=np.int16)
if a.shape != b.shape:
    print(f"COMPARE {sys.argv[2]} shape {b.shape} != {a.shape}")
    sys.exit(0)
d = np.abs(a - b)
mse = float((d.astype(np.float64) ** 2).mean())
psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
print(
    f"COMPARE {sys.argv[2].rsplit('/', 1)[-1]} vs {sys.argv[1].rsplit('/', 1)[-1]}: "
    f"max {int(d.max())} mean {d.mean():.3f} psnr {psnr:.1f} dB >8: {(d > 8).mean() * 100:.3f}%"
)
