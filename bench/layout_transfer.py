"""GB/s of heterogeneous transfers (staged through a local buffer) beside the homogeneous
transfer of the same bytes and the direct plan (many small extents), in the same run.

32 layers, head_dim 128, bf16, 1024 tokens in 16-token blocks, between two agents of
this process, best of 5 posts each. Modes: ``nhd:hnd`` (8 kv heads, NHD -> HND, 128
MiB) and ``tp2:tp4`` (heads [2, 4) of a 4-head NHD rank -> a 2-head NHD rank, 32 MiB;
as a pull: a 4-head rank reading a 2-head rank into heads [2, 4)).

    .venv/bin/python bench/layout_transfer.py [write|read] [nhd:hnd|tp2:tp4]
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


MODES = {  # (source heads, order), (heads of the homogeneous pair), (heterogeneous target), plan options
    "nhd:hnd": ((8, "NHD"), 8, (8, "HND"), {}),
    "tp2:tp4": ((4, "NHD"), 2, (2, "NHD"), {"num_heads": 2, "local_head_offset": 2}),
}


def main() -> None:
    op = sys.argv[1] if len(sys.argv) > 1 else "write"
    mode = sys.argv[2] if len(sys.argv) > 2 else "nhd:hnd"
    (sh, so), hh, (th, to), opts = MODES[mode]
    plan = pdkv.PlanOptions(**opts)
    for transport in ("tcp", "shm"):
        with pdkv.Agent("a", secret="s", transports=[transport]) as a, \
                pdkv.Agent("b", secret="s", transports=[transport]) as b:
            keep = []
            for name, agent, (h, order) in (("src", a, (sh, so)), ("src_h", a, (hh, "NHD")), ("homog", b, (hh, "NHD")),
                                            ("hetero", b, (th, to))):
                geo = pdkv.KVGeometry(LAYERS, BLOCKS, T, h, D, "bfloat16", order=order)
                buf = np.random.default_rng(1).integers(0, 255, geo.pool_bytes, dtype=np.uint8)
                keep.append(buf)
                agent.register(buf)
                agent.add_layout(name, pdkv.KVLayout.contiguous(geo, buf))
            peer = a.add_peer(b.metadata())
            ids = list(range(BLOCKS))
            hetero = a.prepare(op, peer, pdkv.Blocks("src", ids), pdkv.Blocks("hetero", ids), plan=plan)
            homog = a.prepare(op, peer, pdkv.Blocks("src_h", ids), pdkv.Blocks("homog", ids))
            direct = a.prepare_extents(op, peer, pdkv.plan_blocks(
                a.layout("src"), ids, pdkv.KVLayout(a.peer_info(peer)["layouts"]["hetero"]), ids, plan=plan))
            assert homog.nbytes == hetero.nbytes == direct.nbytes
            gbps = {k: homog.nbytes / best_seconds(p) / 1e9 for k, p in
                    (("homogeneous", homog), ("staged", hetero), ("direct", direct))}
            print(f"{transport} {op} {mode} {homog.nbytes >> 20} MiB: homogeneous {gbps['homogeneous']:.2f} GB/s "
                  f"({homog.num_extents} extents); staged {gbps['staged']:.2f} GB/s "
                  f"({gbps['staged'] / gbps['homogeneous']:.2f}x, {hetero.num_extents} extents), direct "
                  f"{gbps['direct']:.2f} GB/s ({gbps['direct'] / gbps['homogeneous']:.2f}x, {direct.num_extents} "
                  f"extents)")


if __name__ == "__main__":
    main()
