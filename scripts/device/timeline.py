#!/usr/bin/env python3
"""Reads `sd-bench unet --timeline on` JSON lines (files or stdin) and says where the last
step's device time went: per segment its compute on the device (from the later of its
launch and the previous segment's end to its end), the idle gap before it and what the
host was doing meanwhile, and how busy the transfer threads kept the link.

usage: timeline.py results.jsonl [--segments]"""
import json
import sys


def analyse(d, per_segment):
    t = d.get("last_step_timeline")
    if not t:
        return
    segs, ups, end = t["segments"], t["uploads"], t["end"]
    label = d.get("label", "")
    prev_done = 0.0
    busy = idle = 0.0
    rows = []
    # Idle device time by what the host was doing: starting the step (before segment 0),
    # staging a segment's weights synchronously, waiting for a transfer job that ended in
    # the gap, or other work.
    split = {"start": 0.0, "staging": 0.0, "upload": 0.0, "other": 0.0}
    for k, mb, prepared, staging, launched, returned, done in segs:
        if done is None:
            print(f"{label}: segment {k} has no device end (timeline off or not queued)")
            return
        start = max(launched, prev_done)
        gap = max(0.0, launched - prev_done)
        # Host between the previous segment's end and this launch: waiting for its
        # weights (a transfer job ending in the gap) or its own work.
        upload_end = max(
            (u[3] for u in ups if prev_done < u[3] <= launched), default=None
        )
        rows.append((k, mb, done - start, gap, prepared - prev_done, staging, upload_end))
        if k == 0:
            split["start"] += gap
        elif staging > 0.1:
            split["staging"] += gap
        elif upload_end is not None:
            split["upload"] += gap
        else:
            split["other"] += gap
        busy += done - start
        idle += gap
        prev_done = done
    tail = end - prev_done
    split["other"] += tail
    copy = 0.0
    for mb, queued, started, finished in ups:
        lo, hi = max(started, 0.0), min(finished, end)
        if hi > lo:
            copy += hi - lo
    mb_step = sum(u[0] for u in ups if 0.0 <= u[3] <= end)
    print(
        f"{label}: step {end:.1f} ms, device busy {busy:.1f}, idle {idle:.1f} before segments"
        f" + {tail:.1f} after the last; transfer threads copying {copy:.1f} ms"
        f" ({mb_step:.0f} MB finished in the step), {len(segs)} segments; idle: "
        + ", ".join(f"{k} {v:.1f}" for k, v in split.items())
    )
    if per_segment:
        print("   k     MB  compute   gap  prep-after-prev  staging  upload-ended-in-gap")
        for k, mb, comp, gap, prep, staging, up in rows:
            u = "" if up is None else f"{up:8.2f}"
            print(f"{k:4d} {mb:6.1f} {comp:8.2f} {gap:6.2f} {prep:16.2f} {staging:8.2f} {u}")


def main():
    per_segment = "--segments" in sys.argv
    files = [a for a in sys.argv[1:] if not a.startswith("--")]
    streams = [open(f) for f in files] or [sys.stdin]
    for s in streams:
        for line in s:
            line = line.strip()
            if line.startswith("{"):
                analyse(json.loads(line), per_segment)


if __name__ == "__main__":
    main()
