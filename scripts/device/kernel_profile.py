"""Per-kernel GPU time of one SD1.5 UNet step (512x512, batch 2, f16) in diffusers, from
torch.profiler: the peer's side of kernel_census.sh. Prints the kernels grouped by a short
name with total ms, then the step's total, as `DIFF name ms count` lines.

usage: python3 kernel_profile.py [sdxl]   (SDXL: 1024x1024, batch 2, 77x2048 context)
"""

import collections
import importlib.util
import os
import sys

import torch
from diffusers import UNet2DConditionModel
from torch.profiler import ProfilerActivity, profile

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "unet_step_diffusers.py")
spec = importlib.util.spec_from_file_location("u", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
dev = torch.device("cuda")
xl = sys.argv[1:2] == ["sdxl"]
with dev:
    unet = UNet2DConditionModel(**(mod.SDXL_UNET if xl else mod.SD15_UNET)).to(torch.float16).eval()
side, ctx_dim = (128, 2048) if xl else (64, 768)
x = torch.randn(2, 4, side, side, device=dev, dtype=torch.float16)
t = torch.tensor([999.0, 499.0], device=dev)
c = torch.randn(2, 77, ctx_dim, device=dev, dtype=torch.float16)
extra = {}
if xl:
    extra["added_cond_kwargs"] = {
        "text_embeds": torch.zeros(2, 1280, device=dev, dtype=torch.float16),
        "time_ids": torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]] * 2, device=dev, dtype=torch.float16),
    }
with torch.no_grad():
    for _ in range(5):
        unet(x, t, encoder_hidden_states=c, **extra)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        unet(x, t, encoder_hidden_states=c, **extra)
        torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0.0, 0])
total = 0.0
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        name = e.name[:90]
        agg[name][0] += e.device_time_total / 1000.0
        agg[name][1] += 1
        total += e.device_time_total / 1000.0
for name, (ms, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:30]:
    print(f"DIFF {ms:8.3f} ms {n:5d}  {name}")
print(f"DIFF total kernel ms {total:.3f}")
