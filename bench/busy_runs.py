"""Many `pdkv bench transfer` runs beside busy co-runners: does any collapse?

Issue 30's throughput criterion: no run below 0.8x its same-run plain socket pair with
co-runners on every core. Each run is one `pdkv bench transfer ... --out run-K.json`;
this prints one line per run (the load, pdkv and plain GB/s, the run's ratio and its
worst round, the slowest single transfer and the 32 KiB write latency) and writes
the lines to OUT/summary.json.

    .venv/bin/python bench/busy_runs.py --runs 10 --out bench/results/busy/runs-X -- \\
        --transport tcp --payload 64M --lat-iters 500 --busy 2 --busy-threads 2 --busy-churn import,alloc

Everything after ``--`` goes to `pdkv bench transfer` unchanged (``--out`` is added).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


_TCP_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "PruneCalled", "TCPBacklogDrop",
                 "TCPRcvQDrop", "TCPOFODrop", "TCPMemoryPressures", "TCPRcvCollapsed")


def tcp_counters() -> dict[str, int]:
    """The host's TCP loss and recovery counters (/proc/net/snmp, /proc/net/netstat):
    machine-wide, so other work on the host counts too."""
    out: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for head, vals in zip(lines[::2], lines[1::2]):
            for k, v in zip(head.split()[1:], vals.split()[1:]):
                if k in _TCP_COUNTERS:
                    out[k] = int(v)
    return out


def one(pdkv: list[str], bench_args: list[str], out: str) -> dict:
    before, c0 = load(), tcp_counters()
    t0 = time.time()
    p = subprocess.run(pdkv + ["bench", "transfer", *bench_args, "--out", out], capture_output=True, text=True)
    c1 = tcp_counters()
    row = {"load_before": before, "load_after": load(), "wall_s": round(time.time() - t0, 1), "rc": p.returncode,
           "tcp_counters_delta": {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] - c0.get(k, 0)}}
    if p.returncode != 0:
        row["error"] = p.stderr[-1500:]
        return row
    with open(out) as f:
        results = json.load(f)["results"]
    row["payloads"] = []
    for r in results:
        rounds = r.get("per_round", [])
        each = [ms for rd in rounds for ms in rd.get("pdkv_transfer_ms", [])]
        row["payloads"].append({
            "payload_bytes": r["payload_bytes"], "gbps": r["gbps"], "plain_gbps": r["ceilings"]["socket_plain"],
            "ratio_plain": r["ratios"]["socket_plain"],
            "ratio_plain_rounds": [rd["ratios"]["socket_plain"] for rd in rounds],
            "transfer_ms_median": statistics.median(each) if each else None,
            "transfer_ms_max": max(each) if each else None,
            "lat_p50_us": r.get("lat_p50_us"), "lat_p99_us": r.get("lat_p99_us"),
            "raw_rtt_p50_us": r.get("raw_rtt_p50_us"), "raw_rtt_p99_us": r.get("raw_rtt_p99_us"),
            "busy": r.get("busy"),
        })
    return row


def fmt_counters(d: dict[str, int]) -> str:
    short = {"RetransSegs": "retr", "TCPTimeouts": "rto", "TCPLossProbes": "tlp", "TCPFastRetrans": "fr",
             "PruneCalled": "prune", "TCPBacklogDrop": "bldrop", "TCPRcvQDrop": "rqdrop", "TCPOFODrop": "ofodrop",
             "TCPMemoryPressures": "mempress", "TCPRcvCollapsed": "collapsed"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in sorted(d.items()))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", required=True, help="folder for run-K.json and summary.json")
    ap.add_argument("--pdkv", default=os.path.join(os.path.dirname(sys.executable), "pdkv"),
                    help="the pdkv command (default: beside this interpreter)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    os.makedirs(args.out, exist_ok=True)
    cmd = " ".join([sys.executable, *sys.argv])
    rows = []
    print(f"# {cmd}\n# pdkv bench transfer {' '.join(rest)}")
    print(f"{'run':>3} {'load':>5} {'payload':>8} {'pdkv':>6} {'plain':>6} {'/plain':>6} {'worst rnd':>9} "
          f"{'xfer ms med':>11} {'max':>7} {'p50 us':>7} {'p99 us':>8} {'raw p50':>7} {'raw p99':>7}  host tcp counters",
          flush=True)
    for k in range(args.runs):
        row = one([args.pdkv], rest, os.path.join(args.out, f"run-{k + 1}.json"))
        rows.append(row)
        if "error" in row:
            print(f"{k + 1:>3} {row['load_before']:5.2f} failed: {row['error'].strip().splitlines()[-1:]}", flush=True)
            continue
        for p in row["payloads"]:
            f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
            print(f"{k + 1:>3} {row['load_before']:5.2f} {p['payload_bytes'] >> 20:>6}Mi {p['gbps']:6.2f} "
                  f"{p['plain_gbps']:6.2f} {p['ratio_plain']:6.2f} {min(p['ratio_plain_rounds']):9.2f} "
                  f"{f(p['transfer_ms_median'], '11.1f')} {f(p['transfer_ms_max'], '7.1f')} "
                  f"{f(p['lat_p50_us'], '7.1f')} {f(p['lat_p99_us'], '8.1f')} {f(p['raw_rtt_p50_us'], '7.1f')} "
                  f"{f(p['raw_rtt_p99_us'], '7.1f')}  {fmt_counters(row['tcp_counters_delta'])}", flush=True)
    ok = [p for r in rows for p in r.get("payloads", [])]
    below = [p for p in ok if p["ratio_plain"] < 0.8]
    print(f"# {len(ok)} results, {len(below)} below 0.8x plain (run median); worst round "
          f"{min((min(p['ratio_plain_rounds']) for p in ok), default=float('nan')):.2f}x; failed runs: "
          f"{sum('error' in r for r in rows)}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"command": cmd, "bench_args": rest, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
