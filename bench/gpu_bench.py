"""cuda_ipc GB/s vs a device-to-device copy of the same bytes, measured in one run;
then device memory over tcp (pinned staging) vs host memory over tcp, same payload.

Two processes on one GPU (the target spawned here), llama-3-8b blocks (32 KiB
block-halves) with permuted destinations. The cuda_ipc ceiling is this process copying
the same scattered extents between two of its own device buffers with cudaMemcpyAsync
(torch's copy_ on views), which is what cuda_ipc does across processes. The tcp
comparison forces transports=["tcp"] on both sides and moves the same blocks from
device pools and from host pools: the ratio is what staging costs over loopback.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time

import torch

import pdkv

TARGET = textwrap.dedent("""
    import sys, torch, pdkv
    blocks, dev, transports = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    pool = torch.zeros(32, 2, blocks, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    a = pdkv.Agent("gpu-target", secret="s", transports=transports)
    a.register(pool)
    a.add_layout("kv", pdkv.KVLayout.from_tensors([pool[l, 0] for l in range(32)], [pool[l, 1] for l in range(32)]))
    print(a.address, flush=True)
    sys.stdin.read()
""")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=512, help="blocks per transfer (2 MiB each)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    n = args.blocks
    res = cuda_ipc(n, args.iters)
    res["tcp"] = {dev: tcp_gbps(n, args.iters, dev) for dev in ("cuda", "cpu")}
    res["tcp"]["staged_vs_host"] = res["tcp"]["cuda"] / res["tcp"]["cpu"]
    print(json.dumps(res, indent=2))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


def tcp_gbps(n: int, iters: int, dev: str) -> float:
    """GB/s of writing n blocks over tcp between two processes, pools on `dev`."""
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(n), dev, "tcp"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        addr = proc.stdout.readline().strip()
        pool = torch.randn(32, 2, n, 16, 8, 128, dtype=torch.bfloat16, device=dev)
        with pdkv.Agent("tcp-init", secret="s", transports=["tcp"]) as a:
            a.register(pool)
            a.add_layout("kv", pdkv.KVLayout.from_tensors([pool[l, 0] for l in range(32)],
                                                          [pool[l, 1] for l in range(32)]))
            peer = a.connect(addr)
            assert a.peer_transport(peer) == "tcp"
            prep = a.prepare("write", peer, pdkv.Blocks("kv", list(range(n))),
                             pdkv.Blocks("kv", torch.randperm(n).tolist()))
            prep.post().wait(120)
            t0 = time.perf_counter()
            for _ in range(iters):
                prep.post().wait(120)
            return prep.nbytes * iters / (time.perf_counter() - t0) / 1e9
    finally:
        proc.stdin.close()
        proc.wait(60)


def cuda_ipc(n: int, iters: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(n), "cuda", "cuda_ipc,shm,tcp"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    args = argparse.Namespace(iters=iters)
    try:
        addr = proc.stdout.readline().strip()
        pool = torch.randn(32, 2, n, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        other = torch.zeros_like(pool)
        perm = torch.randperm(n).tolist()
        with pdkv.Agent("gpu-init", secret="s") as a:
            a.register(pool)
            a.add_layout("kv", pdkv.KVLayout.from_tensors([pool[l, 0] for l in range(32)],
                                                          [pool[l, 1] for l in range(32)]))
            peer = a.connect(addr)
            prep = a.prepare("write", peer, pdkv.Blocks("kv", list(range(n))), pdkv.Blocks("kv", perm))
            prep.post().wait(60)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                prep.post().wait(60)
            pdkv_s = time.perf_counter() - t0
            nbytes = prep.nbytes * args.iters
            # Ceiling: the same 32 KiB extents copied device to device in one process.
            src_views = [pool[l, p, b] for l in range(32) for p in range(2) for b in range(n)]
            dst_views = [other[l, p, b] for l in range(32) for p in range(2) for b in perm]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                for s, d in zip(src_views, dst_views):
                    d.copy_(s, non_blocking=True)
            torch.cuda.synchronize()
            d2d_s = time.perf_counter() - t0
            lat = []
            one = a.prepare("write", peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1]))
            for i in range(220):
                t1 = time.perf_counter()
                one.post().wait(10)
                if i >= 20:
                    lat.append((time.perf_counter() - t1) * 1e6)
        lat.sort()
        res = {"transport": "cuda_ipc", "payload_bytes": prep.nbytes, "extents": prep.num_extents,
               "gbps": nbytes / pdkv_s / 1e9, "ceilings": {"d2d_copy": nbytes / d2d_s / 1e9},
               "block_write_p50_us": lat[len(lat) // 2], "device": torch.cuda.get_device_name()}
        res["ratios"] = {"d2d_copy": res["gbps"] / res["ceilings"]["d2d_copy"]}
        return res
    finally:
        proc.stdin.close()
        proc.wait(60)


if __name__ == "__main__":
    main()
