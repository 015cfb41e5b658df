"""Heterogeneous device transfers: tp4:tp2 pushes (into 2 of a decode rank's 4 kv heads)
and tp2:tp4 pushes (2 of the pusher's 4 heads), llama-3-70b per-rank geometry (80
layers, head_dim 128, bf16, 4096 tokens), device pools, over cuda_ipc and over tcp
(pinned staging), against homogeneous pushes of the same bytes (tp4:tp4, whole
blocks), and against the old per-piece path
(PDKV_BENCH_DEVICE_PIECES=1, measured by a child process right after, same machine).

Per line: GB/s (best post of --iters), prepare ms, the extents the transport got, and
a digest check of what landed (the first --check-layers layers: the requested heads of
the target equal the source, bit for bit). Device memory comes from the CUDA driver pdkv
loads ($PDKV_CUDA_DRIVER, else libcuda.so.1), so the same script runs on a GPU
(bench/gpu_check.sh) and, with tiny sizes, on the fake driver:

    PDKV_CUDA_DRIVER=build/fakecuda/libfakecuda-*.so .venv/bin/python bench/gpu_hetero.py \\
        --layers 2 --tokens 256 --iters 2 --out /tmp/h.json

A target is a child process (cuda_ipc cannot map memory of its own process).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

import pdkv
from pdkv.lab.transfer.devmem import DeviceMemory

HEAD_DIM, BT, ITEM = 128, 16, 2  # head_dim, block tokens, bf16


def geometry(layers: int, blocks: int, heads: int) -> pdkv.KVGeometry:
    return pdkv.KVGeometry(layers, blocks, BT, heads, HEAD_DIM, "bfloat16", order="NHD")


def head_digest(mem: DeviceMemory, base: int, geo: pdkv.KVGeometry, layers: int, blocks: list[int], h0: int,
                nh: int) -> str:
    """sha256 of heads [h0, h0 + nh) of `blocks` in the first `layers` layers of a contiguous pool."""
    n = layers * 2 * geo.num_blocks * geo.block_bytes
    a = mem.dtoh(base, n, np.uint8).reshape(layers, 2, geo.num_blocks, BT, geo.kv_heads, HEAD_DIM * ITEM)
    return hashlib.sha256(np.ascontiguousarray(a[:, :, blocks, :, h0:h0 + nh]).tobytes()).hexdigest()


def serve(args) -> None:
    """Target: a zeroed device pool of --heads heads; answers digest requests on stdin."""
    mem = DeviceMemory()
    geo = geometry(args.layers, args.blocks, args.heads)
    base = mem.alloc(geo.pool_bytes)
    if not args.prepare_only:
        mem.htod(base, np.zeros(geo.pool_bytes, np.uint8))
    a = pdkv.Agent(f"hetero-target-{os.getpid()}", secret="s", transports=args.transports.split(","))
    a.register_address(base, geo.pool_bytes, kind="cuda", device=0)
    a.add_layout("kv", pdkv.KVLayout.contiguous(geo, base))
    print(a.address, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps({"digest": head_digest(mem, base, geo, req["layers"], req["blocks"], req["h0"], req["nh"])}),
              flush=True)
    a.close()


def path_name() -> str:
    return "pieces" if os.environ.get("PDKV_BENCH_DEVICE_PIECES") == "1" else "runs"


def measure(args) -> list[dict]:
    mem = DeviceMemory()
    nblocks = args.tokens // BT
    rows = []
    ids = list(range(nblocks))
    rids = list(reversed(range(nblocks)))
    check_layers = min(args.check_layers, args.layers)
    pools = {}
    for h in (2, 4):  # a tp4 rank holds 2 of llama-3-70b's 8 kv heads, a tp2 rank 4
        geo = geometry(args.layers, args.blocks, h)
        pools[h] = (geo, mem.alloc(geo.pool_bytes))
        if not args.prepare_only:
            mem.htod(pools[h][1], np.random.default_rng(h).integers(0, 256, geo.pool_bytes, dtype=np.uint8))
    # name: (local heads, target heads, plan); the pusher's pool is the local one.
    modes = {"tp4:tp2": (2, 4, pdkv.PlanOptions(num_heads=2, local_head_offset=0, remote_head_offset=2)),
             "tp2:tp4": (4, 2, pdkv.PlanOptions(num_heads=2, local_head_offset=2, remote_head_offset=0)),
             "tp4:tp4 (homogeneous)": (2, 2, pdkv.PlanOptions())}
    for transport in args.transport:
        for kind, (lheads, heads, plan) in modes.items():
            src_geo, src = pools[lheads]
            transports = "cuda_ipc,tcp" if transport == "cuda_ipc" else "tcp"
            proc = subprocess.Popen([sys.executable, __file__, "--serve", "--layers", str(args.layers), "--blocks",
                                     str(args.blocks), "--heads", str(heads), "--transports", transports,
                                     *(["--prepare-only"] if args.prepare_only else [])],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                addr = proc.stdout.readline().strip()
                with pdkv.Agent("hetero-init", secret="s", transports=transports.split(",")) as a:
                    a.register_address(src, src_geo.pool_bytes, kind="cuda", device=0)
                    a.add_layout("kv", pdkv.KVLayout.contiguous(src_geo, src))
                    peer = a.connect(addr)
                    used = a.peer_transport(peer)
                    if args.prepare_only:  # best of 5 prepares per op, nothing moved
                        for op in ("write", "read"):
                            best = float("inf")
                            for _ in range(5):
                                t0 = time.perf_counter()
                                prep = a.prepare(op, peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", rids), plan=plan)
                                best = min(best, time.perf_counter() - t0)
                            rows.append(dict(transport=used, mode=kind, op=op, bytes=prep.nbytes,
                                             extents=prep.num_extents, prepare_ms=best * 1e3, gbps=0.0,
                                             bit_exact=True, path=path_name()))
                        continue
                    t0 = time.perf_counter()
                    prep = a.prepare("write", peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", rids), plan=plan)
                    prep_ms = (time.perf_counter() - t0) * 1e3
                    x = prep.post()
                    x.wait(300)
                    best = float("inf")
                    for _ in range(args.iters):
                        t0 = time.perf_counter()
                        prep.post().wait(300)
                        best = min(best, time.perf_counter() - t0)
                    h0 = plan.remote_head_offset
                    proc.stdin.write(json.dumps({"layers": check_layers, "blocks": rids, "h0": h0, "nh": 2}) + "\n")
                    proc.stdin.flush()
                    got = json.loads(proc.stdout.readline())["digest"]
                    want = head_digest(mem, src, src_geo, check_layers, ids, plan.local_head_offset, 2)
                    rows.append(dict(transport=used, mode=kind, op="write", bytes=prep.nbytes,
                                     extents=prep.num_extents, prepare_ms=prep_ms, gbps=prep.nbytes / best / 1e9,
                                     bit_exact=got == want, path=path_name()))
            finally:
                proc.stdin.close()
                proc.wait(120)
    for _, p in pools.values():
        mem.free(p)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=0, help="pool blocks (default: tokens / 16)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--check-layers", type=int, default=4)
    ap.add_argument("--transport", action="append", choices=["cuda_ipc", "tcp"],
                    help="repeatable; default both")
    ap.add_argument("--out", default="gpu_hetero.json")
    ap.add_argument("--no-compare", action="store_true", help="skip the per-piece child run")
    ap.add_argument("--prepare-only", action="store_true",
                    help="only prepare (best of 5, write and read): no bytes move, pools are not filled")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--transports", default="cuda_ipc,tcp", help=argparse.SUPPRESS)
    ap.add_argument("--json-rows", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.blocks = args.blocks or args.tokens // BT
    args.transport = args.transport or ["cuda_ipc", "tcp"]
    if args.serve:
        return serve(args)
    rows = measure(args)
    if args.json_rows:
        print(json.dumps(rows))
        return
    if not args.no_compare:  # the old path, same sizes, right after
        argv = [a for a in sys.argv[1:] if a != "--no-compare"]
        out = subprocess.run([sys.executable, __file__, *argv, "--json-rows", "--no-compare"], check=True,
                             capture_output=True, text=True, env=dict(os.environ, PDKV_BENCH_DEVICE_PIECES="1")).stdout
        rows += json.loads(out.strip().splitlines()[-1])
    print(f"{'transport':<9} {'mode':<22} {'op':<5} {'path':<6} {'MB':>7} {'extents':>8} {'prepare ms':>10} "
          f"{'GB/s':>7} exact")
    for r in rows:
        print(f"{r['transport']:<9} {r['mode']:<22} {r['op']:<5} {r['path']:<6} {r['bytes'] / 1e6:>7.1f} "
              f"{r['extents']:>8} {r['prepare_ms']:>10.2f} {r['gbps']:>7.2f} {r['bit_exact']}")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "layers": args.layers, "tokens": args.tokens,
                   "driver": os.environ.get("PDKV_CUDA_DRIVER", "libcuda.so.1")}, f, indent=2)
    if not all(r["bit_exact"] for r in rows):
        sys.exit("some transfer did not land bit exact")


if __name__ == "__main__":
    main()
