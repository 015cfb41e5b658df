"""Prepare cost of heterogeneous pushes at llama-3-70b geometry (80 layers, head_dim 128,
bf16, 4096 tokens), full 8 kv heads and tp8's 1 kv head per rank.

Like ``pdkv bench transfer``'s prepare cost: two synthetic, never-touched address
ranges are registered and the agent prepares against itself (no memory, no network).
Each mode is prefill -> decode; ``write`` is prefill pushing (local = prefill), ``read``
is decode pulling (local = decode). Per mode and op it prints the extents the transport gets,
prepare's milliseconds (best of 5), and the direct plan's extents and milliseconds
(``pdkv.plan_blocks`` including its Python list: what the transfer would carry
without staging).

    .venv/bin/python bench/layout_prepare.py [--random-ids] [--transport shm] [--mode tp4:tp2 ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import pdkv

TOKENS, LAYERS, HEAD_DIM, POOL_BLOCKS = 4096, 80, 128, 512


def modes(h: int) -> dict[str, tuple]:
    """name: (local T, H, order, remote T, H, order, heads moved, local offset, remote offset)
    of the push (local = prefill rank, remote = decode rank)."""
    if h == 1:  # llama-3-70b at tp8: 1 kv head per rank; tp4 ranks hold 2
        return {
            "tp4:tp8": (16, 2, "NHD", 16, 1, "NHD", 1, 1, 0),
            "tp8:tp4": (16, 1, "NHD", 16, 2, "NHD", 1, 0, 1),
            "bs16:bs32": (16, 1, "NHD", 32, 1, "NHD", 0, 0, 0),
            "bs32:bs16": (32, 1, "NHD", 16, 1, "NHD", 0, 0, 0),
        }
    # llama-3-70b at tp2 vs tp4: 4 and 2 of the 8 kv heads per rank
    return {
        "tp2:tp4": (16, 4, "NHD", 16, 2, "NHD", 2, 2, 0),
        "tp4:tp2": (16, 2, "NHD", 16, 4, "NHD", 2, 0, 2),
        "bs16:bs32": (16, h, "NHD", 32, h, "NHD", 0, 0, 0),
        "bs32:bs16": (32, h, "NHD", 16, h, "NHD", 0, 0, 0),
        "nhd:hnd": (16, h, "NHD", 16, h, "HND", 0, 0, 0),
        "hnd:nhd": (16, h, "HND", 16, h, "NHD", 0, 0, 0),
        "tp2:tp4+nhd:hnd": (16, 4, "NHD", 16, 2, "HND", 2, 2, 0),
        "tp4:tp2+hnd:nhd": (16, 2, "HND", 16, 4, "NHD", 2, 0, 2),
        "tp4:tp2+bs16:bs32+nhd:hnd": (16, 2, "NHD", 32, 4, "HND", 2, 0, 2),
    }


def best_of(fn, n=5):
    out, best = None, float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-ids", action="store_true", help="scattered block ids instead of consecutive ones")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    ap.add_argument("--mode", action="append", help="only these modes (repeatable; default: all)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'geometry':<10} {'mode':<26} {'op':<5} {'extents':>8} {'prepare ms':>10} {'direct extents':>14} "
          f"{'direct ms':>9}")
    for h, label in ((8, "70b-full"), (1, "70b-tp8")):
        for name, (lt, lh, lo, rt, rh, ro, nh, lho, rho) in modes(h).items():
            if args.mode and name not in args.mode:
                continue
            with pdkv.Agent("bench-layout", secret="x", transports=[args.transport]) as a:
                layouts = []
                for i, (t, hh, order) in enumerate(((lt, lh, lo), (rt, rh, ro))):
                    geo = pdkv.KVGeometry(LAYERS, POOL_BLOCKS, t, hh, HEAD_DIM, "bfloat16", order=order)
                    base = (1 << 44) + i * (1 << 43)
                    a.register_address(base, geo.pool_bytes, remote_access=True)
                    layouts.append(pdkv.KVLayout.contiguous(geo, base))
                    a.add_layout(f"kv{i}", layouts[-1])
                me = a.add_peer(a.metadata())
                pick = (lambda n: rng.permutation(POOL_BLOCKS)[:n]) if args.random_ids else (lambda n: np.arange(n))
                lids, rids = pick(TOKENS // lt).astype(np.uint32), pick(TOKENS // rt).astype(np.uint32)
                kw = dict(num_tokens=TOKENS if lt != rt else 0, num_heads=nh, local_head_offset=lho,
                          remote_head_offset=rho)
                pull = dict(num_tokens=kw["num_tokens"], num_heads=nh, local_head_offset=rho, remote_head_offset=lho)
                for op, (li, lo_, ri, ro_, opts) in (("write", (0, lids, 1, rids, kw)),
                                                     ("read", (1, rids, 0, lids, pull))):
                    direct, dsecs = best_of(lambda: pdkv.plan_blocks(layouts[li], lo_, layouts[ri], ro_, **opts), 2)
                    prep, secs = best_of(lambda: a.prepare(op, me, f"kv{li}", lo_, f"kv{ri}", ro_, **opts))
                    print(f"{label:<10} {name:<26} {op:<5} {prep.num_extents:>8} {secs * 1e3:>10.3f} "
                          f"{len(direct):>14} {dsecs * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
