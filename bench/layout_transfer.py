"""GB/s of an NHD -> HND transfer (staged through a local buffer) beside the homogeneous
transfer of the same bytes and the direct (row by row) plan, in the same run.

32 layers x 8 kv heads x head_dim 128, bf16, 1024 tokens in 16-token blocks (128 MiB),
between two agents of this process, best of 5 posts each.

    .venv/bin/python bench/layout_transfer.py [write|read]
"""

from __future__ import annotations

import sys
import time

import numpy as np

import pdkv

LAYERS, T, H, D, TOKENS = 32, 16, 8, 128, 1024
BLOCKS = TOKENS // T


def best_seconds(prep, n: int = 5) -> float:
    prep.post().wait(60)  # warm-up: connections, page faults
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        prep.post().wait(60)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    op = sys.argv[1] if len(sys.argv) > 1 else "write"
    for transport in ("tcp", "shm"):
        with pdkv.Agent("a", secret="s", transports=[transport]) as a, \
                pdkv.Agent("b", secret="s", transports=[transport]) as b:
            keep = []
            for name, agent, order in (("src", a, "NHD"), ("nhd", b, "NHD"), ("hnd", b, "HND")):
                geo = pdkv.KVGeometry(LAYERS, BLOCKS, T, H, D, "bfloat16", order=order)
                buf = np.random.default_rng(1).integers(0, 255, geo.pool_bytes, dtype=np.uint8)
                keep.append(buf)
                agent.register(buf)
                agent.add_layout(name, pdkv.KVLayout.contiguous(geo, buf))
            peer = a.add_peer(b.metadata())
            ids = list(range(BLOCKS))
            homog = a.prepare(op, peer, "src", ids, "nhd", ids)
            staged = a.prepare(op, peer, "src", ids, "hnd", ids)
            direct = a.prepare_extents(op, peer, pdkv.plan_blocks(a.layout("src"), ids,
                                                                  pdkv.KVLayout(a.peer_info(peer)["layouts"]["hnd"]),
                                                                  ids))
            gbps = {k: homog.nbytes / best_seconds(p) / 1e9 for k, p in
                    (("homogeneous", homog), ("staged", staged), ("direct", direct))}
            print(f"{transport} {op} {homog.nbytes >> 20} MiB: homogeneous {gbps['homogeneous']:.2f} GB/s; nhd:hnd "
                  f"staged {gbps['staged']:.2f} GB/s ({gbps['staged'] / gbps['homogeneous']:.2f}x, "
                  f"{staged.num_extents} extents), direct {gbps['direct']:.2f} GB/s "
                  f"({gbps['direct'] / gbps['homogeneous']:.2f}x, {direct.num_extents} extents)")


if __name__ == "__main__":
    main()
