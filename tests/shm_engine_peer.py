"""Peer process of tests/library/shm/test_shm_engine_memory.py, driven by JSON lines on stdin.

``--role target``: an agent exporting one region of ``--kind`` memory (numpy, torch,
alloc, slice: a numpy slice starting 100 bytes into its buffer, small: below the
sharing threshold, off: sharing switched off). Prints ``{"address", "pid",
"metadata" (base64), "region", "nbytes", "shared_bytes", "shared_offset"}`` and answers:

* ``{"cmd": "fill", "seed": s}``: the engine writes seeded random bytes through its own pointer
* ``{"cmd": "digest"}`` -> ``{"sha": sha256 of the bytes the engine sees, "addr": their address}``
* ``{"cmd": "memfd_mapped"}`` -> ``{"mapped": bytes of the region mapped from a pdkv memfd now}``
* ``{"cmd": "dereg"}`` -> ``{"secs": seconds the deregistration took}``
* ``{"cmd": "exit"}``

``--role init``: an agent that writes into a target: ``{"cmd": "write", "metadata", "region",
"nbytes", "seed"}`` (prepared once and kept, so its mapping of the target's memfd stays)
-> ``{"ok", "error", "transport"}``; ``{"cmd": "scribble", "value": v}`` fills every
mapping of a peer's shared pages it holds with v, as a copy already running would
-> ``{"bytes": n}``.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import pdkv  # noqa: E402

NBYTES = (4 << 20) + 123  # whole pages inside, partial ones at both ends
SMALL = 64 << 10
MEMFD_NAME = "/memfd:pdkv-registered"


def memfd_mappings(lo: int = 0, hi: int = 2**64) -> list[tuple[int, int]]:
    """Mappings of pdkv's re-mapped engine pages in this process overlapping [lo, hi)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(MEMFD_NAME):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                if a < hi and b > lo:
                    out.append((max(a, lo), min(b, hi)))
    return out


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def engine_memory(kind: str):
    """(object to register, numpy view of exactly the registered bytes)."""
    if kind == "torch":
        import torch

        t = torch.zeros(NBYTES, dtype=torch.uint8)
        return t, t.numpy()
    if kind == "slice":
        whole = np.zeros(NBYTES + 8192, np.uint8)
        view = whole[100:100 + NBYTES]
        return view, view
    buf = np.zeros(SMALL if kind == "small" else NBYTES, np.uint8)
    return buf, buf


def run_target(args: argparse.Namespace) -> None:
    shm = pdkv.ShmOptions(share_pages_min_bytes=0) if args.kind == "off" else None
    agent = pdkv.Agent("engine", secret=args.secret, transports=["shm", "tcp"], options=[shm] if shm else [])
    if args.kind == "alloc":
        region = agent.alloc(NBYTES)
        view = region.array(np.uint8)
    else:
        obj, view = engine_memory(args.kind)
        region = agent.register(obj)
    out({"address": agent.address, "pid": os.getpid(), "region": region.id, "nbytes": region.nbytes,
         "shared_bytes": region.shared_bytes, "shared_offset": region.shared_offset,
         "metadata": base64.b64encode(agent.metadata()).decode()})
    addr = view.ctypes.data
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "exit":
            break
        if cmd == "fill":
            view[:] = np.random.default_rng(req["seed"]).integers(0, 256, view.size, dtype=np.uint8)
            out({})
        elif cmd == "digest":
            out({"sha": hashlib.sha256(view.tobytes()).hexdigest(), "addr": view.ctypes.data})
        elif cmd == "memfd_mapped":
            out({"mapped": sum(b - a for a, b in memfd_mappings(addr, addr + view.size))})
        elif cmd == "dereg":
            import time

            t0 = time.monotonic()
            region.close()
            out({"secs": time.monotonic() - t0})
    agent.close()


def run_init(args: argparse.Namespace) -> None:
    agent = pdkv.Agent("writer", secret=args.secret, transports=["shm"])
    out({"address": "", "pid": os.getpid()})
    kept = []
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "exit":
            break
        if cmd == "write":
            src = np.random.default_rng(req["seed"]).integers(0, 256, req["nbytes"], dtype=np.uint8)
            try:
                peer = agent.add_peer(base64.b64decode(req["metadata"]))
                rs = agent.register(src, remote_access=False)
                prep = agent.prepare_extents("write", peer, [(rs.id, 0, req["region"], 0, req["nbytes"])])
                kept.append((src, rs, prep))
                x = prep.post()
                x.wait(30)
                out({"ok": True, "error": "", "transport": x.transport})
            except pdkv.PdkvError as e:
                out({"ok": False, "error": f"{type(e).__name__}: {e}", "transport": ""})
        elif cmd == "scribble":
            n = 0
            for a, b in memfd_mappings():
                ctypes.memset(a, req["value"], b - a)
                n += b - a
            out({"bytes": n})
    agent.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--secret", required=True)
    ap.add_argument("--role", choices=["target", "init"], required=True)
    ap.add_argument("--kind", choices=["numpy", "torch", "alloc", "slice", "small", "off"], default="numpy")
    args = ap.parse_args()
    (run_target if args.role == "target" else run_init)(args)


if __name__ == "__main__":
    main()
