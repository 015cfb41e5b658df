"""Where a small tcp write's latency goes: the Python-level post().wait() time, the transfer's
own elapsed time (native: from its creation in Agent::post to the ack resolving it), and a raw
socket round trip of the same size (C++, the benchmark's sink), each p50 over 3000 writes.

Usage: .venv/bin/python bench/sweeps/tcpperf/latency_split.py [--busy N] [--iters N]
(--busy N: N spinning co-runners pinned round-robin to the CPUs, as pdkv bench transfer --busy;
the initiator is pinned to the first CPU and the target to the second, as pdkv bench transfer does)
"""
import argparse
import time

from pdkv import Agent
from pdkv.lab import _native
from pdkv.lab.transfer import bench as B, models
from pdkv.lab.transfer.busy import BusyLoad
from pdkv.lab.transfer.common import percentile, tcp_options

mine = argparse.ArgumentParser()
mine.add_argument("--busy", type=int, default=0)
mine.add_argument("--iters", type=int, default=3000)
opts = mine.parse_args()
ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
args = ap.parse_args(["--transport", "tcp", "--prepare-blocks", "0"]); args.argv = []
load = BusyLoad(opts.busy).__enter__()
target = B.start_target(args, 64)
bench = _native.module().bench
try:
    with Agent("lat", secret="pdkv-bench", listen="127.0.0.1:0", options=[tcp_options(args)], transports=["tcp"]) as a:
        geo = models.geometry(args.model, 64)
        src, lay = B._pool(a, geo, 0); a.add_layout("kv", lay)
        peer = a.connect(target.address, transport="tcp")
        seg = a.layout("kv").segments[0]; rseg = a.peer_info(peer)["layouts"]["kv"].segments[0]
        for n in (64, 4096, 32768):
            one = a.prepare_extents("write", peer, [(seg["region_id"], seg["region_offset"], rseg["region_id"],
                                                     rseg["region_offset"], n)])
            for rnd in range(2):
                tot, el = [], []
                for i in range(opts.iters):
                    t0 = time.perf_counter(); x = one.post(); x.wait(10); t1 = time.perf_counter()
                    tot.append((t1 - t0) * 1e6); el.append(x.elapsed * 1e6)
                raw = [v / 1000 for v in bench.pingpong(target.sink_host, target.sink_port, n, opts.iters)]
                print(f"{n:6d} B  busy {opts.busy}  post().wait() p50 {percentile(tot, 50):5.1f} us  transfer.elapsed p50 "
                      f"{percentile(el, 50):5.1f} us  raw round trip p50 {percentile(raw, 50):5.1f} us  "
                      f"({percentile(tot, 50) / percentile(raw, 50):.2f}x, native {percentile(el, 50) / percentile(raw, 50):.2f}x)  "
                      f"p99 {percentile(tot, 99):7.1f} vs raw {percentile(raw, 99):7.1f} us",
                      flush=True)
finally:
    target.close()
    load.stop()
