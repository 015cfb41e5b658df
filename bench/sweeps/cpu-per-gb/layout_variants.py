"""CPU s/GB of pdkv tcp writes, scattered vs contiguous sources and destinations, beside the
tuned socket pair, alternating in one process (two rounds, 1 GiB, 3 iterations each).

Usage: .venv/bin/python bench/sweeps/cpu-per-gb/layout_variants.py [bench flags, e.g. --model llama-3-70b-tp8]
"""
import argparse, sys, time
import numpy as np
from pdkv import Agent, Blocks
from pdkv.lab import _native
from pdkv.lab.transfer import bench as B, models
from pdkv.lab.transfer.common import pool_blocks, tcp_options

extra = sys.argv[1:]
ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
args = ap.parse_args(["--transport", "tcp", "--prepare-blocks", "0", *extra]); args.argv = []
payload = 1 << 30
args.remote_blocks = args.local_blocks = pool_blocks(args.model, [payload])
target = B.start_target(args, args.remote_blocks)
bench = _native.module().bench
iters = 3
try:
    with Agent("var-initiator", secret="pdkv-bench", listen="127.0.0.1:0", options=[tcp_options(args)],
               transports=["tcp"]) as agent:
        geo = models.geometry(args.model, args.local_blocks)
        src, lay = B._pool(agent, geo, 0)
        agent.add_layout("kv", lay)
        peer = agent.connect(target.address, transport="tcp")
        g1 = models.geometry(args.model, 1)
        n = payload // (g1.num_layers * g1.kv_parts * g1.block_bytes)
        rng = np.random.default_rng(0)
        perm_l = rng.permutation(args.local_blocks)[:n].astype(np.uint32)
        perm_r = rng.permutation(args.remote_blocks)[:n].astype(np.uint32)
        seq = np.arange(n, dtype=np.uint32)
        cases = {"scattered->scattered": (perm_l, perm_r), "contig->scattered": (seq, perm_r),
                 "scattered->contig": (perm_l, seq), "contig->contig": (seq, seq)}
        preps = {k: agent.prepare("write", peer, Blocks("kv", l), Blocks("kv", r)) for k, (l, r) in cases.items()}
        meter = target.cpu_meter()
        for k, p in preps.items():
            B.time_transfers(p, 1)
        for rnd in range(2):
            for k, p in preps.items():
                with meter.measure() as c:
                    s = B.time_transfers(p, iters)
                pg = c.per_gb_by_process(iters * payload)
                print(f"{k:22} extents {p.num_extents:6d} {iters*payload/s/1e9:5.2f} GB/s cpu {c.per_gb(iters*payload):.3f} s/GB (init {pg['initiator']:.3f} tgt {pg['target']:.3f})", flush=True)
            with meter.measure() as c:
                s = bench.stream(target.sink_host, target.sink_port, args.conns, iters * payload, payload, True, args.rcvlowat or 0)
            pg = c.per_gb_by_process(iters * payload)
            print(f"{'tuned pair':22} {'':13} {iters*payload/s/1e9:5.2f} GB/s cpu {c.per_gb(iters*payload):.3f} s/GB (init {pg['initiator']:.3f} tgt {pg['target']:.3f})", flush=True)
finally:
    target.close()
