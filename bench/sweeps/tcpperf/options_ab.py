"""TcpOptions variants at one model and payload, each an agent of its own, alternating round by
round in one process beside the tuned socket pair; medians and spread of each over the pair.

Usage: .venv/bin/python bench/sweeps/tcpperf/options_ab.py MODEL PAYLOAD_MIB ROUNDS NAME=FIELD:VALUE[,FIELD:VALUE] ...
  e.g. ... llama-3-70b-tp8 64 3 gather=gather_below_bytes:8192 nogather=gather_below_bytes:4096
"""
import argparse, sys
import numpy as np
from pdkv import Agent, Blocks, TcpOptions
from pdkv.lab import _native
from pdkv.lab.transfer import bench as B, models
from pdkv.lab.transfer.common import pool_blocks, tcp_options
ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
args = ap.parse_args(["--transport", "tcp", "--prepare-blocks", "0", "--model", sys.argv[1]]); args.argv = []
payload = int(sys.argv[2]) << 20; rounds = int(sys.argv[3])
variants = {}
for v in sys.argv[4:]:
    name, _, kv = v.partition("=")
    kw = {}
    for item in filter(None, kv.split(",")):
        k, _, val = item.partition(":"); kw[k] = int(val)
    variants[name] = kw
args.remote_blocks = args.local_blocks = pool_blocks(args.model, [payload])
target = B.start_target(args, args.remote_blocks)
bench = _native.module().bench
iters = max(3, (2 << 30) // payload)
agents = []
res = {k: [] for k in [*variants, "tuned"]}
try:
    preps = {}
    for name, kw in variants.items():
        base = tcp_options(args)
        for k, val in kw.items(): setattr(base, k, val)
        a = Agent(f"ab-{name}", secret="pdkv-bench", listen="127.0.0.1:0", options=[base], transports=["tcp"])
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
    for rnd in range(rounds):
        line = []
        for k, p in preps.items():
            with meter.measure() as c:
                s = B.time_transfers(p, iters)
            res[k].append((iters*payload/s/1e9, c.per_gb(iters*payload)))
        with meter.measure() as c:
            s = bench.stream(target.sink_host, target.sink_port, 1, iters * payload, payload, True, args.rcvlowat or 0)
        res["tuned"].append((iters*payload/s/1e9, c.per_gb(iters*payload)))
        t = res["tuned"][-1]
        print(f"round {rnd}: " + "  ".join(f"{k} {g:.2f}GB/s {c:.3f}s/GB ({g/t[0]:.2f}x, cpu {c/t[1]:.2f}x)" for k, (g, c) in ((k, v[-1]) for k, v in res.items())), flush=True)
    import statistics as st
    t = res["tuned"]
    for k, v in res.items():
        rg = [a[0]/b[0] for a, b in zip(v, t)]; rc = [a[1]/b[1] for a, b in zip(v, t)]
        print(f"{k:24} GB/s {st.median(x[0] for x in v):5.2f}  CPU {st.median(x[1] for x in v):.3f} s/GB  /tuned {st.median(rg):.2f}x ({min(rg):.2f}-{max(rg):.2f})  CPU/tuned {st.median(rc):.2f}x ({min(rc):.2f}-{max(rc):.2f})", flush=True)
finally:
    for a in agents:
        a.close()
    target.close()
