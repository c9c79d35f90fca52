"""Summarizes an Nsight Compute CSV (`ncu --metrics gpu__time_duration.sum --csv --print-units
base`): the second half of the kernels (a warm-up step runs first), summed by kernel name, as
`GGML ms count name` lines after a total. Used by kernel_census.sh, flux_census.sh and
dit_kernels_ab.sh.

usage: python3 ncu_census.py NCU.CSV [TOP]
"""

import collections
import csv
import sys

rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 45
hdr, rows = rows[0], rows[1:]
iname, ival, iid = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("ID")
ks = sorted((int(r[iid]), r[iname], float(r[ival].replace(",", ""))) for r in rows if r[ival])
half = ks[len(ks) // 2:]
agg = collections.defaultdict(lambda: [0.0, 0])
for _, n, v in half:
    key = n.split("(")[0][:110]
    agg[key][0] += v / 1e6
    agg[key][1] += 1
tot = sum(v for v, _ in agg.values())
print(f"GGML kernels {len(ks)} total, timed half {len(half)}: {tot:.3f} ms")
for k, (ms, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"GGML {ms:8.3f} ms {n:5d}  {k}")
