"""Summarizes streaming_sweep.sh's results.jsonl: a markdown table per model and the raw
lines in the shape docs/bench/ keeps (one object per run with model, engine,
budget_fraction, step_ms, floor_ms, ratio, peak_mib, budget_mib, ...).

floor = max(the engine's resident step, bytes uploaded per step / pinned host->device
bandwidth), all measured in the same call; ratio = step / floor. Peaks: sd-rs's from
cudaMemGetInfo sampled by the engine (the whole device's used memory, the CUDA runtime
included), diffusers' from torch (allocated and reserved: the runtime's own memory is not
in them), and both from nvidia-smi sampled every 50 ms (smi_peak_mib, minus idle).

usage: python3 summarize_sweep.py results.jsonl summary.md runs.jsonl
"""

import json
import sys


def main():
    src, md_path, out_path = sys.argv[1:4]
    rows = [json.loads(l) for l in open(src) if l.strip().startswith("{")]
    by = {r["label"]: r for r in rows}
    bw = (by.get("copy-bw", {}).get("results", {}) or {}).get("pinned", {}).get("gb_per_s")
    mib = lambda b: None if b is None else b / 2**20
    md, runs = [], []
    p = md.append
    if bw:
        p(f"Pinned host->device copy: {bw:.1f} GB/s.\n")
    for model in ("sd15", "sdxl"):
        res = by.get(f"{model}-resident")
        if not res:
            continue
        resident = res.get("step_ms_median")
        p(f"\n**{model}** (weights {res.get('weight_bytes', 0) / 1e9:.2f} GB)\n")
        p("| run | step ms | segments (prefetched) | uploaded / step | floor ms | step / floor | device peak MiB (smi) | budget MiB |")
        p("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            if r.get("model") != model or r.get("rc", 0) != 0:
                continue
            label = r["label"]
            if r.get("cmd") == "diffusers-unet":
                step = r.get("step_ms_median")
                peak = mib(r.get("peak_allocated_bytes"))
                p(f"| {label} | {step:.1f} | – | – | – | – | {peak:.0f} alloc / {mib(r.get('peak_reserved_bytes')):.0f} reserved ({r.get('smi_peak_mib')}) | – |")
                runs.append(dict(model=model, engine="diffusers", label=label, offload=r.get("offload"),
                                 budget_fraction=None, step_ms=step, floor_ms=None, ratio=None,
                                 peak_mib=peak, smi_peak_mib=r.get("smi_peak_mib"), budget_mib=None))
                continue
            if r.get("cmd") == "unet-direct":
                step = r.get("step_ms_median")
                p(f"| {label} (bare graph) | {step:.1f} | 1 | 0 | – | – | ({r.get('smi_peak_mib')}) | – |")
                runs.append(dict(model=model, engine="sd-rs bare graph", label=label, budget_fraction=None,
                                 step_ms=step, floor_ms=None, ratio=None, peak_mib=None,
                                 smi_peak_mib=r.get("smi_peak_mib"), budget_mib=None))
                continue
            if r.get("cmd") != "unet":
                continue
            step = r.get("step_ms_median")
            h2d = r.get("h2d_bytes_per_step") or 0
            floor = max(resident, h2d / (bw * 1e9) * 1e3) if bw and resident else None
            ratio = step / floor if floor else None
            frac = None
            for part in label.split("-"):
                try:
                    frac = float(part)
                    break
                except ValueError:
                    pass
            budget = mib(r.get("budget_bytes"))
            peak = mib(r.get("device_used_peak_bytes"))
            t = r.get("last_step_timing_ms") or {}
            parts = " ".join(f"{k} {v:.1f}" for k, v in t.items() if v >= 0.05 and k != "total")
            p(f"| {label} | {step:.1f} | {r.get('segments')} ({r.get('prefetched')}, ahead {r.get('max_prefetches_ahead')}) | {h2d / 1e9:.2f} GB | "
              f"{floor:.1f} | {ratio:.2f} | {peak or 0:.0f} ({r.get('smi_peak_mib')}) | "
              f"{budget if budget is None else round(budget)} |")
            p(f"|  ↳ last step: {parts}; graphs reused {r.get('graphs_reused')} | | | | | | | |")
            runs.append(dict(model=model, engine="sd-rs", label=label, params=r.get("params"),
                             budget_fraction=frac, runtime_reserve_bytes=r.get("runtime_reserve_bytes"),
                             step_ms=step, h2d_bytes_per_step=h2d, floor_ms=floor, ratio=ratio,
                             segments=r.get("segments"), prefetched=r.get("prefetched"),
                             prefetch_depth=r.get("prefetch_depth"),
                             prefetches_ahead=r.get("max_prefetches_ahead"),
                             graphs_reused=r.get("graphs_reused"), peak_mib=peak,
                             smi_peak_mib=r.get("smi_peak_mib"), budget_mib=budget,
                             last_step_timing_ms=t))
    open(md_path, "w").write("\n".join(md) + "\n")
    with open(out_path, "w") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
