"""Plots the twentieth session's H100 budget runs: SD1.5 UNet step ms against the budget (MiB)
(final_ab.sh's runs as `sd` runs them, or band_ab2.sh's per band divisor), the floor (max of
the bare graph and the bytes streamed over the pinned link) and diffusers' leaf-level group
offload (from the same file, else the second) at its allocated and reserved peaks.

usage: python3 plot_bands.py RESULTS.jsonl OTHER.jsonl OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINK_GB_S = 55.4


def rows(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def main():
    second, first, out = sys.argv[1:4]
    runs = rows(second)
    bare = next(r["step_ms_median"] for r in runs if r.get("label") == "sd15-bare")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    import re

    plain = sorted(
        (r["budget_bytes"] / 2**20, r["step_ms_median"])
        for r in runs
        if re.fullmatch(r"sd15-[0-9.]+", r.get("label", ""))
    )
    if plain:
        ax.plot(*zip(*plain), "o-", label="sd-rs (as sd runs it)")
    for d, style in (("8", "o-"), ("16", "s--"), ("0", "^:")):
        pts = sorted(
            (r["budget_bytes"] / 2**20, r["step_ms_median"])
            for r in runs
            if r.get("label", "").startswith("sd15-") and r.get("label", "").endswith(f"-bands{d}")
        )
        if pts:
            ax.plot(*zip(*pts), style, label=f"sd-rs, band divisor {d if d != '0' else 'off'}")
    floor = sorted(
        (r["budget_bytes"] / 2**20, max(bare, r["h2d_bytes_per_step"] / LINK_GB_S / 1e6))
        for r in runs
        if re.fullmatch(r"sd15-[0-9.]+(-bands8)?", r.get("label", ""))
    )
    ax.plot(*zip(*floor), "k-", lw=0.8, label="floor: max(bare graph, bytes / 55.4 GB/s)")
    leaf = next((r for r in runs + rows(first) if r.get("label") == "sd15-diffusers-leaf"), None)
    if leaf:
        for peak, name, dy in ((leaf["peak_allocated_bytes"], "allocated", -16), (leaf["peak_reserved_bytes"], "reserved", 8)):
            ax.plot([peak / 2**20], [leaf["step_ms_median"]], "rx", ms=9)
            ax.annotate(f"diffusers leaf offload, {name} peak", (peak / 2**20, leaf["step_ms_median"]),
                        textcoords="offset points", xytext=(8, dy), fontsize=8)
    ax.set_xlabel("budget (MiB); diffusers: its peak")
    ax.set_ylabel("SD1.5 UNet step, ms (512x512, batch 2, f16)")
    ax.set_title("H100: SD1.5 UNet step under a device budget (2026-12-07)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
