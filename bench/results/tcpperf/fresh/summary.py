"""The issue-29/30 targets from bench/results/tcpperf/fresh/run.sh's JSON files, one column per run."""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))


def rows(name):
    out = []
    for f in sorted(glob.glob(os.path.join(here, f"{name}-[0-9].json"))):
        out.append(json.load(open(f))["results"])
    return out


def col(name, fmt):
    return "  ".join(f"{fmt(r):>14}" for r in rows(name))


def by_payload(rs, size):
    return next(r for r in rs if r["payload_bytes"] == size)


M64, G1 = 64 << 20, 1 << 30
print(f"{'case':48} {'target':>10}  runs")
print(f"{'32K extents GB/s / tuned (64M; 1G)':48} {'>=0.95x':>10}  " + col("tcp-32k", lambda rs: (
    f"{by_payload(rs, M64)['ratios']['socket_tuned']:.2f};{by_payload(rs, G1)['ratios']['socket_tuned']:.2f}")))
print(f"{'32K CPU/GB / tuned (64M; 1G)':48} {'<=1.05x':>10}  " + col("tcp-32k", lambda rs: (
    f"{by_payload(rs, M64)['ratios_cpu']['socket_tuned']:.2f};{by_payload(rs, G1)['ratios_cpu']['socket_tuned']:.2f}")))
print(f"{'4K extents 64 MiB GB/s / tuned':48} {'>=0.9x':>10}  " + col("tcp-4k", lambda rs: f"{rs[0]['ratios']['socket_tuned']:.2f}"))
print(f"{'4K CPU/GB / tuned':48} {'<=1.2x':>10}  " + col("tcp-4k", lambda rs: f"{rs[0]['ratios_cpu']['socket_tuned']:.2f}"))
lat = lambda rs: f"{rs[0]['lat_ratio_vs_raw_rtt']:.2f} ({rs[0]['lat_p50_us']:.0f}/{rs[0]['raw_rtt_p50_us']:.0f})"
print(f"{'32K write p50 / raw RTT p50 (us)':48} {'<=1.5x':>10}  " + col("tcp-32k", lat))
print(f"{'4K write p50 / raw RTT p50 (us)':48} {'<=2x':>10}  " + col("tcp-4k", lat))
print(f"{'--busy 2: 32K write p50 / raw (p99 / raw p99)':48} {'<=2x (10x)':>10}  " + col("tcp-32k-busy2", lambda rs: (
    f"{rs[0]['lat_ratio_vs_raw_rtt']:.2f} ({rs[0]['lat_p99_us'] / rs[0]['raw_rtt_p99_us']:.2f})")))
print(f"{'--busy 2: 64 MiB GB/s / plain':48} {'>=0.8x':>10}  " + col("tcp-32k-busy2", lambda rs: f"{rs[0]['ratios']['socket_plain']:.2f}"))
print(f"{'shm CPU/GB / memcpy (64M; 1G)':48} {'<=1.1x':>10}  " + col("shm", lambda rs: (
    f"{by_payload(rs, M64)['ratios_cpu']['memcpy']:.2f};{by_payload(rs, G1)['ratios_cpu']['memcpy']:.2f}")))
