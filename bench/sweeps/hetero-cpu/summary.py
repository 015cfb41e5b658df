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


def ratios(outdir):
    got = defaultdict(list)
    for path in glob.glob(os.path.join(outdir, "*.json")):
        m = re.match(r"(tcp|shm)-(.+)-(push|pull)-(\d+)\.json$", os.path.basename(path))
        if m:
            r = json.load(open(path))["results"][0]
            got[(m[1], m[2], m[3])].append(r["cpu_s_per_gb"] / r["homogeneous_cpu_s_per_gb"])
    return got


if len(sys.argv) > 2:  # summary.py AFTER BEFORE: a markdown table of both (min-max over the runs)
    after, before = ratios(sys.argv[1]), ratios(sys.argv[2])
    print("\n| case | tcp before | tcp after | shm before | shm after |\n|---|--:|--:|--:|--:|")
    specs = sorted({(s, m) for _, s, m in after}, key=lambda x: (["tp2-tp4", "tp4-tp2", "nhd-hnd", "bs16-bs32"].index(x[0]), x[1] == "pull"))
    rng = lambda v: f"{min(v):.2f}-{max(v):.2f}x" if v else "-"
    for s, m in specs:
        print(f"| {s.replace('-', ':')} {m} | {rng(before.get(('tcp', s, m), []))} | {rng(after.get(('tcp', s, m), []))} | "
              f"{rng(before.get(('shm', s, m), []))} | {rng(after.get(('shm', s, m), []))} |")
