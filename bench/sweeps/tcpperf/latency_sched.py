"""Per-write CPU time and run-queue wait of every thread of the initiator and target, for a small tcp
write (post().wait()) and for the raw socket round trip of the same size, from /proc/<pid>/task/*/schedstat
(on-CPU ns, run-queue wait ns, timeslices) before and after N writes. Initiator and target pinned to
different cores as pdkv bench transfer does.

Usage: N=32768 IT=5000 BUSY=0 .venv/bin/python bench/sweeps/tcpperf/latency_sched.py
(BUSY=n: n spinning co-runners pinned round-robin to the CPUs, as pdkv bench transfer --busy n)
"""
import argparse, os, time
from pdkv import Agent
from pdkv.lab import _native
from pdkv.lab.transfer import bench as B, models
from pdkv.lab.transfer.busy import BusyLoad
from pdkv.lab.transfer.common import tcp_options, percentile


def snap(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, slices = map(int, f.read().split())
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[tid] = (name, run, wait, slices)
    return out


def diff(a, b, n):
    rows = []
    for tid, (name, run, wait, sl) in b.items():
        r0, w0, s0 = a.get(tid, (name, 0, 0, 0))[1:]
        if run - r0 > 0:
            rows.append(f"{name}/{tid}: cpu {(run - r0) / n / 1e3:5.2f} us  rq-wait {(wait - w0) / n / 1e3:5.2f} us  "
                        f"slices {(sl - s0) / n:4.2f}")
    return rows


ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
n = int(os.environ.get("N", "32768")); iters = int(os.environ.get("IT", "5000"))
args = ap.parse_args(["--transport", "tcp", "--prepare-blocks", "0"]); args.argv = []
load = BusyLoad(int(os.environ.get("BUSY", "0"))).__enter__()
target = B.start_target(args, 64)  # pins this process to the first CPU, the target to the second
tpid = target.proc.pid
bench = _native.module().bench
try:
    with Agent("lat", secret="pdkv-bench", listen="127.0.0.1:0", options=[tcp_options(args)], transports=["tcp"]) as a:
        geo = models.geometry(args.model, 64)
        src, lay = B._pool(a, geo, 0); a.add_layout("kv", lay)
        peer = a.connect(target.address, transport="tcp")
        seg = a.layout("kv").segments[0]; rseg = a.peer_info(peer)["layouts"]["kv"].segments[0]
        one = a.prepare_extents("write", peer, [(seg["region_id"], seg["region_offset"], rseg["region_id"],
                                                 rseg["region_offset"], n)])
        B.latency_us(one, 300)
        for rnd in range(2):
            s0 = (snap(os.getpid()), snap(tpid))
            lat = B.latency_us(one, iters)
            s1 = (snap(os.getpid()), snap(tpid))
            print(f"pdkv {n} B p50 {percentile(lat, 50):.1f} us  p99 {percentile(lat, 99):.1f} us; per write:")
            for side, i in (("initiator", 0), ("target", 1)):
                for row in diff(s0[i], s1[i], iters + 20):
                    print(f"  {side} {row}")
            s0 = (snap(os.getpid()), snap(tpid))
            raw = [v / 1000 for v in bench.pingpong(target.sink_host, target.sink_port, n, iters)]
            s1 = (snap(os.getpid()), snap(tpid))
            print(f"raw  {n} B p50 {percentile(raw, 50):.1f} us  p99 {percentile(raw, 99):.1f} us; per trip:")
            for side, i in (("initiator", 0), ("target", 1)):
                for row in diff(s0[i], s1[i], iters + 20):
                    print(f"  {side} {row}")
finally:
    target.close()
    load.stop()
