"""Summarizes cuda_run.sh's results.jsonl: a markdown table and a plot.

The floor of a budgeted step is max(resident step time, bytes uploaded per step / pinned
host->device bandwidth), all measured in the same call; ratio = step time / floor.

usage: python3 summarize.py results.jsonl summary.md benchmarks.png
"""

import json
import sys


def main():
    src, md_path, png_path = sys.argv[1:4]
    rows = [json.loads(l) for l in open(src) if l.strip()]
    by = {r["label"]: r for r in rows}
    bw = by.get("copy-bw", {}).get("results", {})
    pinned_bw = (bw.get("pinned") or {}).get("gb_per_s")
    pageable_bw = (bw.get("pageable") or {}).get("gb_per_s")
    res = by.get("resident")
    dif = by.get("diffusers")
    mib = lambda b: b / 2**20
    out = []
    p = out.append
    gpu = dif.get("gpu") if dif else "CUDA0"
    p(f"GPU: {gpu}. One SD1.5 UNet step, f16 weights, batch 2, 64x64 latents (512x512), context 77x768.\n")
    if pinned_bw:
        p(f"Host->device copy bandwidth (1 GiB tensor, best of 5): pinned {pinned_bw:.1f} GB/s, "
          f"pageable {pageable_bw:.1f} GB/s.\n")
    if res:
        p("| engine | attention | step ms (median) | peak device MiB |")
        p("| --- | --- | ---: | ---: |")
        for key in ("resident", "resident-noflash"):
            r = by.get(key)
            if r:
                dims = r.get("flash_attn_head_dims") or []
                att = (f"flash_attn_ext for head widths {dims}, mul_mat + softmax for the rest"
                       if dims else "mul_mat + softmax")
                p(f"| sd-rs (ggml CUDA, resident) | {att} | {r['step_ms_median']:.2f} | "
                  f"{mib(r['peak_device_used_bytes']):.0f} |")
        d = by.get("direct")
        if d:
            p(f"| sd-rs graph without the engine (one allocation, compute only) | same as first row | "
              f"{d['step_ms_median']:.2f} | - |")
        if dif:
            p(f"| diffusers {dif.get('torch','')} | {dif['attn_processor']} | "
              f"{dif['step_ms_median']:.2f} | {mib(dif['peak_allocated_bytes']):.0f} (allocator peak) |")
            p("")
            p(f"sd-rs / diffusers step time: **{res['step_ms_median'] / dif['step_ms_median']:.2f}x**.")
            if "rel_l2_sdrs_vs_f32_ref" in dif:
                p(f" Same inputs, relative L2 error against diffusers in f32: sd-rs "
                  f"{dif['rel_l2_sdrs_vs_f32_ref']:.2e}, diffusers f16 "
                  f"{dif['rel_l2_diffusers_f16_vs_f32_ref']:.2e}.")
        p("")
    budget_rows = [r for r in rows if r["label"].startswith("budget-")]
    plot = []
    if budget_rows and res:
        t_res = res["step_ms_median"]
        p("| params | --max-vram | budget MiB | step ms | uploaded MiB/step | floor ms | ratio | "
          "peak device MiB | engine peak MiB | segments (prefetched) |")
        p("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in budget_rows:
            frac = r["label"].split("-")[1]
            reserve = r.get("runtime_reserve_bytes") or 0
            up = r["h2d_bytes_per_step"]
            floor = max(t_res, up / (pinned_bw * 1e9) * 1e3) if pinned_bw else t_res
            ratio = r["step_ms_median"] / floor
            over = r["peak_device_used_bytes"] > r["budget_bytes"]
            p(f"| {r['params']}{f', reserve {mib(reserve):.0f} MiB' if reserve else ''} | {float(frac):.0%} | {mib(r['budget_bytes']):.0f} | "
              f"{r['step_ms_median']:.2f} | {mib(up):.0f} | {floor:.2f} | {ratio:.2f} | "
              f"{mib(r['peak_device_used_bytes']):.0f}{' **over**' if over else ''} | "
              f"{mib(r['engine_max_footprint_bytes']):.0f} | {r['segments']} ({r['prefetched']}) |")
            plot.append((f"{r['params']}{'+rsv' if reserve else ''}\n{float(frac):.0%}", r["step_ms_median"], floor,
                         mib(r["peak_device_used_bytes"]), mib(r["budget_bytes"])))
        p("")
        p("floor = max(resident step, uploaded bytes / pinned bandwidth); ratio = step / floor. "
          "Peak device memory: lowest cudaMemGetInfo free memory during the run (sampled every "
          "0.2 ms) below the free memory before it; it includes cuBLAS workspaces and ggml's "
          "CUDA pool, which the engine's own accounting (engine peak) does not see.")
    open(md_path, "w").write("\n".join(out) + "\n")
    print("\n".join(out))
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        xs = range(len(plot))
        a.bar([x - 0.2 for x in xs], [q[1] for q in plot], 0.4, label="step time")
        a.bar([x + 0.2 for x in xs], [q[2] for q in plot], 0.4, label="floor")
        a.axhline(res["step_ms_median"], color="k", ls="--", lw=1, label="resident step")
        if dif:
            a.axhline(dif["step_ms_median"], color="r", ls=":", lw=1, label="diffusers resident")
        a.set_xticks(list(xs), [q[0] for q in plot], fontsize=8)
        a.set_ylabel("ms")
        a.set_title("SD1.5 UNet step under --max-vram")
        a.legend(fontsize=8)
        b.bar([x - 0.2 for x in xs], [q[3] for q in plot], 0.4, label="peak device used")
        b.bar([x + 0.2 for x in xs], [q[4] for q in plot], 0.4, label="budget")
        b.set_xticks(list(xs), [q[0] for q in plot], fontsize=8)
        b.set_ylabel("MiB")
        b.set_title("peak device memory vs budget (cudaMemGetInfo)")
        b.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main()
