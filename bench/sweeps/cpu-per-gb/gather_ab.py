"""The sender gathering small extents (default TcpOptions.gather_below_bytes) vs not
(gather_below_bytes=4096), two agents in one process alternating round by round, beside the tuned pair.

Usage: .venv/bin/python bench/sweeps/cpu-per-gb/gather_ab.py MODEL PAYLOAD_MIB   (e.g. llama-3-70b-tp8 64)
"""
import argparse, sys
import numpy as np
from pdkv import Agent, Blocks
from pdkv.lab import _native
from pdkv.lab.transfer import bench as B, models
from pdkv.lab.transfer.common import pool_blocks, tcp_options

ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
args = ap.parse_args(["--transport", "tcp", "--prepare-blocks", "0", "--model", sys.argv[1]]); args.argv = []
payload = int(sys.argv[2]) << 20
args.remote_blocks = args.local_blocks = pool_blocks(args.model, [payload])
target = B.start_target(args, args.remote_blocks)
bench = _native.module().bench
iters = max(3, (2 << 30) // payload)
agents = []
try:
    preps = {}
    for name, gb in (("gather (default)", args.gather_below), ("no gather", 4096)):
        args.gather_below = gb
        a = Agent(f"g-{gb}", secret="pdkv-bench", listen="127.0.0.1:0", options=[tcp_options(args)], transports=["tcp"])
        agents.append(a)
        geo = models.geometry(args.model, args.local_blocks)
        src, lay = B._pool(a, geo, 0)
        a.add_layout("kv", lay)
        peer = a.connect(target.address, transport="tcp")
        g1 = models.geometry(args.model, 1)
        n = payload // (g1.num_layers * g1.kv_parts * g1.block_bytes)
        rng = np.random.default_rng(0)
        lids = rng.permutation(args.local_blocks)[:n].astype(np.uint32)
        rids = rng.permutation(args.remote_blocks)[:n].astype(np.uint32)
        preps[name] = a.prepare("write", peer, Blocks("kv", lids), Blocks("kv", rids))
        B.time_transfers(preps[name], 1)
    meter = target.cpu_meter()
    for rnd in range(3):
        for k, p in preps.items():
            with meter.measure() as c:
                s = B.time_transfers(p, iters)
            pg = c.per_gb_by_process(iters * payload)
            print(f"{k:18} {iters*payload/s/1e9:5.2f} GB/s cpu {c.per_gb(iters*payload):.3f} s/GB (init {pg['initiator']:.3f} tgt {pg['target']:.3f})", flush=True)
        with meter.measure() as c:
            s = bench.stream(target.sink_host, target.sink_port, 1, iters * payload, payload, True, args.rcvlowat or 0)
        pg = c.per_gb_by_process(iters * payload)
        print(f"{'tuned pair':18} {iters*payload/s/1e9:5.2f} GB/s cpu {c.per_gb(iters*payload):.3f} s/GB (init {pg['initiator']:.3f} tgt {pg['target']:.3f})", flush=True)
finally:
    for a in agents:
        a.close()
    target.close()
