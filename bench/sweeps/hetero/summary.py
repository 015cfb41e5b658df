"""Prints the table of docs/benchmarks.md ("Heterogeneous transfers") from the JSON that
bench/sweeps/hetero/run.sh wrote (bench/results/hetero, or the directory given as the
first argument, e.g. the run's OUT)."""

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench", "results", "hetero")
print("| transport | model | spec | mode | transfers | extents hetero / homog. | hetero GB/s | homog. GB/s | ratio "
      "| prepare 4K-token request hetero / homog. | verified |")
print("|---|---|---|---|--:|--:|--:|--:|--:|--:|---|")
for f in sorted(glob.glob(os.path.join(HERE, "*.json"))):
    for r in json.load(open(f))["results"]:
        q = r.get("prepare_request", {})
        print(f"| {r['transport']} | {r['model']} | {r['hetero']} | {r.get('mode', 'push')} | "
              f"{len(r.get('transfers', r.get('pushes', [])))} | "
              f"{r['extents']['hetero']:,} / {r['extents']['homogeneous']:,} | {r['gbps']:.2f} | "
              f"{r['homogeneous_gbps']:.2f} | {r['ratios']['homogeneous']:.2f}x | "
              f"{q.get('hetero_ms', float('nan')):.1f} / {q.get('homogeneous_ms', float('nan')):.1f} ms | "
              f"{r['verified']} |")
