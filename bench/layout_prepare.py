"""Prepare cost of heterogeneous pushes at llama-3-70b geometry (80 layers, head_dim 128,
bf16, 4096 tokens), full 8 kv heads and tp8's 1 kv head per rank, and at llama-3-8b
geometry (32 layers, 8 kv heads).

Like ``pdkv bench transfer``'s prepare cost: two synthetic, never-touched address
ranges are registered and the agent prepares against itself (no memory, no network).
Each mode is prefill -> decode; ``write`` is prefill pushing (local = prefill), ``read``
is decode pulling (local = decode). Per mode and op it prints the extents the transport gets,
prepare's milliseconds (best of 5), and the direct plan's extents and milliseconds
(``pdkv.plan_blocks`` including its Python list: what the transfer would carry
without staging).

With ``--compare-env NAME=VALUE`` each line also gives the extents and milliseconds of
the same prepare under that benchmark switch (docs/benchmarks.md lists them), measured
by a child process right before, in the same run: ``--compare-one-level`` is
``--compare-env PDKV_BENCH_SHM_ONE_LEVEL=1`` (shm taking one-level runs only, as before
two-level runs); ``--compare-env PDKV_BENCH_PER_SEGMENT_RUNS=1`` (shm) keeps two-level
runs inside one (layer, part), as before runs across segments.

    .venv/bin/python bench/layout_prepare.py [--random-ids] [--transport shm] [--mode tp4:tp2 ...]
                                             [--compare-one-level | --compare-env NAME=VALUE]
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

TOKENS, HEAD_DIM, POOL_BLOCKS = 4096, 128, 512
GEOMETRIES = ((8, 80, "70b-full"), (1, 80, "70b-tp8"), (8, 32, "8b"))  # kv heads per rank, layers, label


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


def measure(args) -> list[dict]:
    """One row per (geometry, mode, op): extents and prepare ms, and the direct plan's."""
    rng = np.random.default_rng(0)
    rows = []
    for h, layers, label in GEOMETRIES:
        for name, (lt, lh, lo, rt, rh, ro, nh, lho, rho) in modes(h).items():
            if args.mode and name not in args.mode:
                continue
            with pdkv.Agent("bench-layout", secret="x", transports=[args.transport]) as a:
                layouts = []
                for i, (t, hh, order) in enumerate(((lt, lh, lo), (rt, rh, ro))):
                    geo = pdkv.KVGeometry(layers, POOL_BLOCKS, t, hh, HEAD_DIM, "bfloat16", order=order)
                    base = (1 << 44) + i * (1 << 43)
                    a.register_address(base, geo.pool_bytes, remote_access=True)
                    layouts.append(pdkv.KVLayout.contiguous(geo, base))
                    a.add_layout(f"kv{i}", layouts[-1])
                me = a.add_peer(a.metadata())
                pick = (lambda n: rng.permutation(POOL_BLOCKS)[:n]) if args.random_ids else (lambda n: np.arange(n))
                lids, rids = pick(TOKENS // lt).astype(np.uint32), pick(TOKENS // rt).astype(np.uint32)
                push = pdkv.PlanOptions(num_tokens=TOKENS if lt != rt else 0, num_heads=nh, local_head_offset=lho,
                                        remote_head_offset=rho)
                pull = pdkv.PlanOptions(num_tokens=push.num_tokens, num_heads=nh, local_head_offset=rho,
                                        remote_head_offset=lho)
                for op, (li, lo_, ri, ro_, plan) in (("write", (0, lids, 1, rids, push)),
                                                     ("read", (1, rids, 0, lids, pull))):
                    direct, dsecs = (None, 0.0) if args.no_direct else best_of(
                        lambda: pdkv.plan_blocks(layouts[li], lo_, layouts[ri], ro_, plan=plan), 2)
                    prep, secs = best_of(lambda: a.prepare(op, me, pdkv.Blocks(f"kv{li}", lo_),
                                                           pdkv.Blocks(f"kv{ri}", ro_), plan=plan))
                    rows.append(dict(geometry=label, mode=name, op=op, extents=prep.num_extents, ms=secs * 1e3,
                                     direct_extents=len(direct) if direct is not None else -1, direct_ms=dsecs * 1e3))
    return rows


def switched_rows(argv: list[str], switch: str) -> dict:
    """The same measurement by a child process with the benchmark switch ``NAME=VALUE``."""
    name, _, value = switch.partition("=")
    env = dict(os.environ, **{name: value})
    out = subprocess.run([sys.executable, __file__, *argv, "--json-rows", "--no-direct"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return {(r["geometry"], r["mode"], r["op"]): r for r in json.loads(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-ids", action="store_true", help="scattered block ids instead of consecutive ones")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    ap.add_argument("--mode", action="append", help="only these modes (repeatable; default: all)")
    ap.add_argument("--compare-one-level", action="store_true",
                    help="shm: also measure one-level runs only (PDKV_BENCH_SHM_ONE_LEVEL=1) in a child process")
    ap.add_argument("--compare-env", metavar="NAME=VALUE",
                    help="also measure with this benchmark switch set, in a child process")
    ap.add_argument("--no-direct", action="store_true", help="skip the direct plan (pdkv.plan_blocks) columns")
    ap.add_argument("--json-rows", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    child_argv = ["--transport", args.transport] + (["--random-ids"] if args.random_ids else [])
    for m in args.mode or []:
        child_argv += ["--mode", m]
    switch = "PDKV_BENCH_SHM_ONE_LEVEL=1" if args.compare_one_level else args.compare_env
    if switch and "=" not in switch:
        ap.error(f"--compare-env wants NAME=VALUE, not {switch!r}")
    before = switched_rows(child_argv, switch) if switch else {}
    rows = measure(args)
    if args.json_rows:
        print(json.dumps(rows))
        return
    print(f"{'geometry':<10} {'mode':<26} {'op':<5} {'extents':>8} {'prepare ms':>10} {'direct extents':>14} "
          f"{'direct ms':>9}" + (f" {'switched extents':>17} {'switched ms':>12}" if before else ""))
    if before:
        print(f"(switched: {switch}, measured right before by a child process)")
    for r in rows:
        direct = (f"{r['direct_extents']:>14} {r['direct_ms']:>9.1f}" if r["direct_extents"] >= 0
                  else f"{'-':>14} {'-':>9}")
        line = f"{r['geometry']:<10} {r['mode']:<26} {r['op']:<5} {r['extents']:>8} {r['ms']:>10.3f} {direct}"
        b = before.get((r["geometry"], r["mode"], r["op"]))
        if b:
            line += f" {b['extents']:>17} {b['ms']:>12.3f}"
        print(line)


if __name__ == "__main__":
    main()
