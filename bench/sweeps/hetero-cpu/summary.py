"""Summary of bench/sweeps/hetero-cpu/run.sh: CPU/GB ratio hetero / homogeneous per case and run.

Usage: python bench/sweeps/hetero-cpu/summary.py OUTDIR
"""
import glob
import json
import os
import re
import sys
from collections import defaultdict

out = sys.argv[1]
rows = defaultdict(list)
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    m = re.match(r"(tcp|shm)-(.+)-(push|pull)-(\d+)\.json$", os.path.basename(path))
    if not m:
        continue
    d = json.load(open(path))
    r = d["results"][0] if "results" in d else d
    het, hom = r["cpu_s_per_gb"], r["homogeneous_cpu_s_per_gb"]
    by = r.get("cpu_s_per_gb_by_process", {})
    rows[(m[1], m[2], m[3])].append((het, hom, het / hom, by))
print(f"{'transport':9} {'spec':10} {'mode':5} {'runs':>4}  CPU s/GB hetero/homog (ratio) per run; max ratio")
for (t, spec, mode), v in sorted(rows.items()):
    runs = "  ".join(f"{h:.3f}/{o:.3f} ({r:.2f}x)" for h, o, r, _ in v)
    print(f"{t:9} {spec:10} {mode:5} {len(v):>4}  {runs}   max {max(x[2] for x in v):.2f}x")
