"""Summarises the JSON of bench/sweeps/cpu-per-gb/run.sh: GB/s and CPU s/GB of pdkv
beside each ceiling, peer and homogeneous transfer, one line per result.

Usage: python bench/sweeps/cpu-per-gb/summary.py [DIR]   (default bench/results/cpu-per-gb)
"""

import glob
import json
import os
import sys


def f(v, fmt=".3f"):
    return "-" if v is None else format(v, fmt)


def main(folder: str) -> None:
    print(f"{'file':34} {'payload':>7}  {'GB/s':>5} {'/tuned':>6} | {'CPU s/GB':>8} {'plain':>6} {'tuned':>6} "
          f"{'memcpy':>6} | {'/plain':>6} {'/tuned':>6} {'/memcpy':>7} | initiator+target")
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        name = os.path.basename(path)[:-5]
        for r in json.load(open(path))["results"]:
            mib = f"{r['payload_bytes'] / 2**20:.0f}M"
            if "hetero" in r:
                split = r["cpu_s_per_gb_by_process"]
                print(f"{name:34} {mib:>7}  {r['gbps']:5.2f} hom {r['homogeneous_gbps']:.2f} ({r['ratios']['homogeneous']:.2f}x)"
                      f" | CPU s/GB hetero {f(r['cpu_s_per_gb'])} homogeneous {f(r['homogeneous_cpu_s_per_gb'])}"
                      f" ({f(r['ratios_cpu']['homogeneous'], '.2f')}x) | hetero {f(split['hetero']['initiator'])}"
                      f"+{f(split['hetero']['target'])}, homogeneous {f(split['homogeneous']['initiator'])}"
                      f"+{f(split['homogeneous']['target'])}")
                continue
            c, q, s = r["ceilings_cpu_s_per_gb"], r["ratios_cpu"], r["cpu_s_per_gb_by_process"]["pdkv"]
            print(f"{name:34} {mib:>7}  {r['gbps']:5.2f} {r['ratios']['socket_tuned']:5.2f}x | {f(r['cpu_s_per_gb']):>8} "
                  f"{f(c.get('socket_plain')):>6} {f(c.get('socket_tuned')):>6} {f(c.get('memcpy')):>6} | "
                  f"{f(q.get('socket_plain'), '.2f'):>5}x {f(q.get('socket_tuned'), '.2f'):>5}x "
                  f"{f(q.get('memcpy'), '.2f'):>6}x | {f(s['initiator'])}+{f(s['target'])}")
            for peer, p in r.get("peers", {}).items():
                if "cpu_s_per_gb" in p:
                    print(f"{'':34} {peer:>7}  {p['gbps']:5.2f}        | {f(p['cpu_s_per_gb']):>8}  pdkv/{peer} "
                          f"{f(p['ratio_cpu_pdkv_over_peer'], '.2f')}x | "
                          f"{f(p['cpu_s_per_gb_by_process']['initiator'])}+{f(p['cpu_s_per_gb_by_process']['target'])}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/cpu-per-gb")
