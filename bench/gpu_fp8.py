"""FP8 compression of GPU pools over tcp, on a real GPU: bit-exact vs the host codec, and GB/s.

    python bench/gpu_fp8.py --out gpu_fp8.json [--mib 128] [--repeats 3]

Three agents on loopback: one sends device memory plain, one with
``TcpCompression(mode="fp8")`` (quantized by pdkv_fp8_quantize on the GPU), one receives
into device memory (dequantized by pdkv_fp8_dequantize). The pool is SmolLM2-135M-shaped
KV (3 kv heads x 64 dims, 16-token blocks, bfloat16) filled with KV-like values. It
measures the effective GB/s (raw bytes delivered per second) of the plain and the fp8
write of the same scattered blocks in the same run, and checks every landed byte of the
fp8 writes (device->device, device->host, host->device) against
``pdkv.codec.Codec("fp8")``'s round trip of each block. Uses the CUDA driver through
ctypes (no torch). Prints and writes one JSON object; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import pdkv
from pdkv.lab.transfer.devmem import DeviceMemory
from pdkv.codec import Codec

HEADS, DIM, TOKENS = 3, 64, 16


def kv_like(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 2, n))).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bfloat16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="bytes per write (MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="gpu_fp8.json")
    args = ap.parse_args()

    block_bytes = TOKENS * HEADS * DIM * 2
    blocks = max(2, (args.mib << 20) // (2 * 30 * block_bytes) * 2)
    geom = pdkv.KVGeometry(num_layers=30, num_blocks=blocks, block_tokens=TOKENS, kv_heads=HEADS, head_dim=DIM,
                           dtype="bfloat16")
    mem = DeviceMemory()
    n = geom.pool_bytes
    host_src = kv_like(n // 2, 1)
    fp8 = pdkv.TcpCompression(mode="fp8", dtype="bfloat16", fp8_heads=HEADS, fp8_head_dim=DIM,
                              fp8_rows_per_group=TOKENS)
    senders = {"plain": pdkv.Agent("gpu-plain", secret="s", transports=["tcp"]),
               "fp8": pdkv.Agent("gpu-fp8", secret="s", transports=["tcp"], options=[pdkv.TcpOptions(compress=fp8)])}
    rx = pdkv.Agent("gpu-rx", secret="s", transports=["tcp"])
    src_dev, dst_dev = mem.alloc(n), mem.alloc(n)
    mem.htod(src_dev, host_src)
    dst_host = np.zeros(n, np.uint8)
    for a in senders.values():
        a.register_address(src_dev, n, kind="cuda", device=0)
        a.register(host_src)
        a.add_layout("dev", pdkv.KVLayout.contiguous(geom, src_dev))
        a.add_layout("host", pdkv.KVLayout.contiguous(geom, host_src))
    rx.register_address(dst_dev, n, kind="cuda", device=0)
    rx.register(dst_host)
    rx.add_layout("dev", pdkv.KVLayout.contiguous(geom, dst_dev))
    rx.add_layout("host", pdkv.KVLayout.contiguous(geom, dst_host))
    rng = np.random.default_rng(7)
    lids = [int(i) for i in rng.permutation(blocks)]
    rids = [int(i) for i in rng.permutation(blocks)]
    raw_bytes = blocks * 30 * 2 * block_bytes

    codec = Codec("fp8", heads=HEADS, head_dim=DIM, rows_per_group=TOKENS)
    parts = host_src.reshape(60, blocks, block_bytes)
    want = np.stack([np.stack([np.frombuffer(codec.decode(codec.encode(parts[p, i].tobytes(), "bfloat16"),
                                                          "bfloat16"), np.uint8) for i in lids])
                     for p in range(60)])

    def landed(where: str) -> np.ndarray:
        pool = mem.dtoh(dst_dev, n, np.uint8) if where == "dev" else dst_host.copy()
        return pool.reshape(60, blocks, block_bytes)[:, rids, :]

    result: dict = {"raw_bytes": raw_bytes, "geometry": f"30 layers x {blocks} blocks x [{TOKENS},{HEADS},{DIM}] bf16",
                    "gbps": {}, "bit_exact": {}}
    for name, a in senders.items():
        peer = a.connect(rx.address)
        prep = a.prepare("write", peer, pdkv.Blocks("dev", lids), pdkv.Blocks("dev", rids))
        prep.post().wait(120)  # warm-up (kernels load, buffers, link measurement)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            x = prep.post()
            x.wait(300)
            times.append(time.perf_counter() - t0)
        result["gbps"][name] = raw_bytes / min(times) / 1e9
        if name == "fp8":
            result["wire_ratio"] = raw_bytes / x.wire_bytes
            result["bit_exact"]["dev->dev"] = bool(np.array_equal(landed("dev"), want))
            for src, dst in (("dev", "host"), ("host", "dev")):
                a.write(peer, pdkv.Blocks(src, lids), pdkv.Blocks(dst, rids)).wait(300)
                result["bit_exact"][f"{src}->{dst}"] = bool(np.array_equal(landed(dst), want))
    result["ratios"] = {"fp8_vs_plain": result["gbps"]["fp8"] / result["gbps"]["plain"]}
    for a in [*senders.values(), rx]:
        a.close()
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if not all(result["bit_exact"].values()):
        raise SystemExit("fp8 of device memory differs from the host codec's round trip")


if __name__ == "__main__":
    main()
