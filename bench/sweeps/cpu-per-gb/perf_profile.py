"""perf profile of pdkv's tcp write and of the tuned socket pair, same processes, same bytes.

Usage (root, Debian's linux-perf): .venv/bin/python bench/sweeps/cpu-per-gb/perf_profile.py OUTDIR [SECONDS] [bench flags]
  e.g. ... /tmp/perf 8                             (llama-3-8b, 32 KiB extents, 1 GiB writes)
       ... /tmp/perf 6 --model llama-3-70b-tp8      (4 KiB extents)
Writes OUTDIR/pdkv.data and OUTDIR/tuned.data (perf record -g -p initiator,target), prints GB/s and
CPU s/GB of each; read with: perf report -i OUTDIR/pdkv.data -n --no-children --sort pid,dso,sym -g none
"""
import argparse, os, signal, subprocess, sys, time
import numpy as np
from pdkv import Agent, Blocks
from pdkv.lab import _native
from pdkv.lab.transfer import bench as B, models
from pdkv.lab.transfer.common import pool_blocks, tcp_options

out = sys.argv[1]
secs = float(sys.argv[2]) if len(sys.argv) > 2 else 8
extra = sys.argv[3:]
ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
args = ap.parse_args(["--transport", "tcp", "--payload", "1G", "--prepare-blocks", "0", *extra]); args.argv = []
payload = 1 << 30
args.remote_blocks = args.local_blocks = pool_blocks(args.model, [payload])
target = B.start_target(args, args.remote_blocks)
bench = _native.module().bench
def perf(name):
    return subprocess.Popen(["perf", "record", "-F", "999", "-g", "-o", f"{out}/{name}.data", "-p",
                             f"{os.getpid()},{target.proc.pid}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def stop(p):
    p.send_signal(signal.SIGINT); p.wait()
try:
    with Agent("prof-initiator", secret="pdkv-bench", listen="127.0.0.1:0", options=[tcp_options(args)],
               transports=["tcp"]) as agent:
        geo = models.geometry(args.model, args.local_blocks)
        src, lay = B._pool(agent, geo, 0)
        agent.add_layout("kv", lay)
        peer = agent.connect(target.address, transport="tcp")
        g1 = models.geometry(args.model, 1)
        nblocks = payload // (g1.num_layers * g1.kv_parts * g1.block_bytes)
        rng = np.random.default_rng(0)
        lids = rng.permutation(args.local_blocks)[:nblocks].astype(np.uint32)
        rids = rng.permutation(args.remote_blocks)[:nblocks].astype(np.uint32)
        prep = agent.prepare("write", peer, Blocks("kv", lids), Blocks("kv", rids))
        B.time_transfers(prep, 1)
        meter = target.cpu_meter()
        p = perf("pdkv"); time.sleep(1.0)
        n, t0 = 0, time.perf_counter()
        with meter.measure() as c:
            while time.perf_counter() - t0 < secs:
                B.time_transfers(prep, 1); n += 1
        dt = time.perf_counter() - t0
        stop(p)
        print(f"pdkv: {n} x 1 GiB in {dt:.2f} s = {n*payload/dt/1e9:.2f} GB/s; cpu {c.by_process} = {c.per_gb(n*payload):.3f} s/GB")
        total = n * payload
        p = perf("tuned"); time.sleep(1.0)
        with meter.measure() as c:
            s = bench.stream(target.sink_host, target.sink_port, args.conns, total, payload, True, args.rcvlowat or 0)
        stop(p)
        print(f"tuned: {total/s/1e9:.2f} GB/s; cpu {c.by_process} = {c.per_gb(total):.3f} s/GB")
finally:
    target.close()
