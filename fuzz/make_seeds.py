"""Writes the metadata fuzzer's seed corpus, fuzz/corpus/metadata/: real blobs from
``pdkv.Agent.metadata()`` (several transports, regions and layouts) plus a few
near-valid variants (truncated, wrong version, corrupted count). Seeds named ``v1_*``
(version-1 blobs written by an older pdkv; this one writes version 2) and
``regression_*`` (inputs the fuzzer once failed on) are kept.

Run from the repository root after ``make install``; commit what it writes:

    .venv/bin/python fuzz/make_seeds.py

The seeds are deterministic except for addresses, ports, pids and instance ids, so a
re-run rewrites them all (old files are removed first).
"""

from __future__ import annotations

import os
import struct
import sys

import numpy as np

import pdkv

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "metadata")


def blobs() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    keep = []  # arrays must outlive the agents that registered them

    # No regions, no layouts: the smallest real blob.
    with pdkv.Agent("empty", secret="s", transports=["tcp"]) as a:
        out["empty_tcp"] = a.metadata()

    # One contiguous pool (K/V per layer), tcp + shm endpoints, an unexported region.
    with pdkv.Agent("prefill-0", secret="s", transports=["shm", "tcp"]) as a:
        geo = pdkv.KVGeometry(num_layers=2, num_blocks=8, block_tokens=4, kv_heads=2, head_dim=8, dtype="float16")
        pool = np.zeros(geo.pool_bytes, np.uint8)
        keep.append(pool)
        a.register(pool)
        a.register(np.zeros(64, np.uint8), remote_access=False)
        a.add_layout("kv", pdkv.KVLayout.contiguous(geo, pool))
        out["contiguous_shm_tcp"] = a.metadata()

    # Interleaved pool in shareable memory (shm flag set), plus a per-layer HND pool
    # and a latent (kv_parts=1) pool: three layouts over four regions.
    with pdkv.Agent("decode-1", secret="s", transports=["shm", "tcp"]) as a:
        geo = pdkv.KVGeometry(3, 4, 16, 1, 64, "bfloat16")
        shared = a.alloc(geo.pool_bytes)
        a.add_layout("interleaved", pdkv.KVLayout.contiguous(geo, shared.array(), interleaved=True))
        ks = [np.zeros((4, 2, 4, 8), np.float32) for _ in range(2)]
        vs = [np.zeros((4, 2, 4, 8), np.float32) for _ in range(2)]
        keep += ks + vs
        for t in ks + vs:
            a.register(t)
        a.add_layout("hnd", pdkv.KVLayout.from_tensors(ks, vs, order="HND"))
        latent = np.zeros((8, 16, 1, 32), np.uint8)
        keep.append(latent)
        a.register(latent)
        a.add_layout("mla", pdkv.KVLayout.from_tensors([latent], None, dtype="float8_e4m3fn"))
        out["three_layouts_shared"] = a.metadata()

    # Engine layouts described by strides: vLLM CPU (K and V interleaved per head) and
    # a SGLang-style token pool.
    with pdkv.Agent("strided", secret="s", transports=["tcp"]) as a:
        cpu = [np.zeros((4, 2, 8, 2 * 16), np.uint16) for _ in range(2)]
        pool_k, pool_v = np.zeros((33, 2, 16), np.float16), np.zeros((33, 2, 16), np.float16)
        keep += cpu + [pool_k, pool_v]
        for t in cpu + [pool_k, pool_v]:
            a.register(t)
        a.add_layout("vllm-cpu", pdkv.KVLayout.from_vllm(cpu, dtype="bfloat16"))
        a.add_layout("pages", pdkv.KVLayout.from_token_pool([pool_k], [pool_v], page_size=8))
        out["strided_layouts"] = a.metadata()
    return out


def near_valid(good: bytes) -> dict[str, bytes]:
    """Variants a fuzzer would take long to find from scratch."""
    body_len_at = 8 + 2
    return {
        "truncated_half": good[: len(good) // 2],
        "version_next": good[:8] + struct.pack("<H", 3) + good[10:],
        "body_len_plus_one": good[:body_len_at] + struct.pack("<I", len(good) - 14 + 1) + good[14:],
        "trailing_byte": good[:body_len_at] + struct.pack("<I", len(good) - 14 + 1) + good[14:] + b"\0",
        "magic_only": good[:8],
    }


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        if not f.startswith(("v1_", "regression_")):
            os.remove(os.path.join(OUT, f))
    seeds = blobs()
    seeds.update(near_valid(seeds["contiguous_shm_tcp"]))
    for name, data in sorted(seeds.items()):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
