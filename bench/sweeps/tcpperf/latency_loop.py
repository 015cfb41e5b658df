"""p50 of a 32 KiB tcp write (post().wait(), N writes after 200 of warm-up), initiator and target
processes pinned to different cores as pdkv bench transfer does. Env: IT (writes, default 20000),
N (bytes, default 32768), WS (the initiator agent's wait_spin_us, default 50).

Usage: IT=3000 .venv/bin/python bench/sweeps/tcpperf/latency_loop.py
"""
import argparse, sys, time, os
import numpy as np
from pdkv import Agent, Blocks
from pdkv.lab import _native
from pdkv.lab.transfer import bench as B, models
from pdkv.lab.transfer.common import pool_blocks, tcp_options, percentile
ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
n = int(os.environ.get("N", "32768")); iters = int(os.environ.get("IT", "20000"))
args = ap.parse_args(["--transport", "tcp", "--prepare-blocks", "0"]); args.argv = []
target = B.start_target(args, 64)
try:
    with Agent("lat", secret="pdkv-bench", listen="127.0.0.1:0", options=[tcp_options(args)], transports=["tcp"], wait_spin_us=int(os.environ.get("WS", "50"))) as a:
        geo = models.geometry(args.model, 64)
        src, lay = B._pool(a, geo, 0); a.add_layout("kv", lay)
        peer = a.connect(target.address, transport="tcp")
        seg = a.layout("kv").segments[0]; rseg = a.peer_info(peer)["layouts"]["kv"].segments[0]
        one = a.prepare_extents("write", peer, [(seg["region_id"], seg["region_offset"], rseg["region_id"], rseg["region_offset"], n)])
        B.latency_us(one, 200)
        print(f"PIDS {os.getpid()} {target.proc.pid if hasattr(target,'proc') else target.pid}", flush=True)
        time.sleep(1.0)
        lat = B.latency_us(one, iters)
        print(f"p50 {percentile(lat,50):.1f}", flush=True)
finally:
    target.close()
