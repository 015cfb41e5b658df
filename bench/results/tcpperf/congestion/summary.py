"""pdkv GB/s, and over the tuned pair, per congestion control and run (bench/results/tcpperf/congestion/run.sh)."""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
print(f"{'cc':6} {'run':>3}  {'64 MiB: pdkv GB/s (/tuned, CPU /tuned)':>40}  {'1 GiB: pdkv GB/s (/tuned, CPU /tuned)':>40}  32K p50 us / raw")
for cc in ("bbr", "cubic", "reno"):
    for f in sorted(glob.glob(os.path.join(here, f"{cc}-[0-9].json"))):
        rs = json.load(open(f))["results"]
        cells = [f"{r['gbps']:.2f} ({r['ratios']['socket_tuned']:.2f}x, {r['ratios_cpu']['socket_tuned']:.2f}x)" for r in rs]
        print(f"{cc:6} {f[-6]:>3}  {cells[0]:>40}  {cells[1]:>40}  {rs[0]['lat_p50_us']:.0f} / {rs[0]['raw_rtt_p50_us']:.0f}")
