"""tcp throughput by extent size, beside the raw socket pairs, in one run.

    PDKV_LOG=error .venv/bin/python bench/tcp_small_extents.py [--sizes 256,1024,4096,32768]
        [--payload 64M] [--iters N]

For each extent size, a write of ``payload`` bytes as that many scattered extents
(seeded random, non-adjacent slots on both sides: nothing coalesces) from this
process into a target process over tcp, then the same bytes through a plain and a
tuned socket pair (the ``pdkv bench transfer`` ceilings). Every size is verified by
reading the destination back. This is what the re-layout planner's many 256-byte
extents (NHD <-> HND) and TP-8 4 KiB block-halves look like on the wire.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import pdkv
from pdkv.lab import _native
from pdkv.lab.transfer.common import human, parse_size

SECRET = "tcp-small-extents"


def serve(pool_bytes: int) -> None:
    bench = _native.module().bench
    with pdkv.Agent("target", secret=SECRET, transports=["tcp"]) as agent:
        pool = np.zeros(pool_bytes, np.uint8)
        region = agent.register(pool)
        sink = bench.Sink("127.0.0.1", 0)
        print(json.dumps({"address": agent.address, "region": region.id, "sink": sink.port}), flush=True)
        sys.stdin.read()
        sink.stop()


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of process `pid` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scattered(n: int, size: int, slots: int, rng) -> np.ndarray:
    """n distinct slot indices out of `slots`, none adjacent to another (no coalescing)."""
    picks = rng.permutation(slots // 2)[:n] * 2
    return picks.astype(np.int64) * size


def run(args) -> None:
    bench = _native.module().bench
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    payload = parse_size(args.payload)
    pool_bytes = 4 * payload
    target = subprocess.Popen([sys.executable, __file__, "--serve", str(pool_bytes)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    info = json.loads(target.stdout.readline())
    rng = np.random.default_rng(1)
    try:
        with pdkv.Agent("initiator", secret=SECRET, transports=["tcp"]) as agent:
            src = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
            back = np.zeros(pool_bytes, np.uint8)
            rs, rb = agent.register(src, remote_access=False), agent.register(back, remote_access=False)
            peer = agent.connect(info["address"])
            print(f"{'extent':>7} {'extents':>8} {'pdkv':>7} {'plain':>7} {'tuned':>7} {'/plain':>7} {'/tuned':>7}"
                  "  verified  (GB/s; CPU ms per GB: sender, receiver)")
            for size in sizes:
                n = payload // size
                lo = scattered(n, size, pool_bytes // size, rng)
                ro = scattered(n, size, pool_bytes // size, rng)
                ext = [(rs.id, int(a), info["region"], int(b), size) for a, b in zip(lo, ro)]
                prep = agent.prepare_extents("write", peer, ext)
                prep.post(timeout=120).wait(120)  # warm-up
                iters = args.iters or max(3, (1 << 30) // (n * size))
                c0, t_c0 = cpu_seconds(os.getpid()), cpu_seconds(target.pid)
                t0 = time.perf_counter()
                for _ in range(iters):
                    prep.post(timeout=120).wait(120)
                secs = time.perf_counter() - t0
                gb = n * size * iters / 1e9
                cpu = ((cpu_seconds(os.getpid()) - c0) / gb * 1e3, (cpu_seconds(target.pid) - t_c0) / gb * 1e3)
                total = n * size * iters
                plain = tuned = float("nan")
                if not args.no_ceilings:
                    plain = total / bench.stream("127.0.0.1", info["sink"], 1, total, n * size, False) / 1e9
                    tuned = total / bench.stream("127.0.0.1", info["sink"], 1, total, n * size, True, 1 << 20) / 1e9
                got = total / secs / 1e9
                # Verify: read the destination extents back into a contiguous area of `back`.
                back[:] = 0
                rd = [(rb.id, i * size, info["region"], int(b), size) for i, b in enumerate(ro)]
                agent.prepare_extents("read", peer, rd).post(timeout=120).wait(120)
                expect = np.concatenate([src[a:a + size] for a in lo])
                ok = np.array_equal(back[:n * size], expect)
                print(f"{human(size):>7} {n:>8} {got:7.2f} {plain:7.2f} {tuned:7.2f} {got / plain:6.2f}x "
                      f"{got / tuned:6.2f}x  {ok}  {cpu[0]:.0f} {cpu[1]:.0f}", flush=True)
    finally:
        target.stdin.close()
        target.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,1024,4096,32768")
    p.add_argument("--payload", default="64M")
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--no-ceilings", action="store_true", help="skip the socket pairs (profiling pdkv alone)")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
    else:
        run(args)


if __name__ == "__main__":
    main()
