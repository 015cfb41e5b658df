"""Target side of tests/library/shm/test_shm_trust.py: an agent whose region is numpy, torch or
pdkv-allocated memory, driven by JSON lines on stdin.

Prints ``{"address", "pid", "metadata" (base64), "region"}`` and answers:

* ``{"cmd": "bytes"}`` -> ``{"data": base64 of the region's bytes}`` (readable after deregistration)
* ``{"cmd": "dereg"}`` -> ``{"secs": seconds the deregistration took}``
* ``{"cmd": "notifs", "wait": s}`` -> ``{"notifs": [str, ...]}``
* ``{"cmd": "fresh"}``: registers a new region of the same kind -> like the hello
* ``{"cmd": "gens", "blocks": [...]}`` -> ``{"gens": [...]}`` (with ``--layout``: a kvpools
  pool registered as layout "kv")
* ``{"cmd": "bump", "blocks": [...]}`` -> ``{"gens": [...]}`` after bumping them
* ``{"cmd": "rss"}`` -> ``{"hwm_kib": VmHWM, "rss_kib": VmRSS}``
* ``{"cmd": "exit"}``

``--nbytes`` sizes the region (default 64 KiB: below ShmOptions.share_pages_min_bytes,
so numpy and torch regions stay private; 4 MiB makes them re-mapped onto a memfd).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import pdkv  # noqa: E402

NBYTES = 1 << 16


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--secret", required=True)
    ap.add_argument("--kind", choices=["numpy", "torch", "alloc"], required=True)
    ap.add_argument("--nbytes", type=int, default=NBYTES)
    ap.add_argument("--layout", action="store_true")
    args = ap.parse_args()
    nbytes = args.nbytes
    agent = pdkv.Agent("target", secret=args.secret, transports=["shm", "tcp"])
    keep = []

    def new_region():
        if args.kind == "numpy":
            buf = np.zeros(nbytes, np.uint8)
            return agent.register(buf), buf
        if args.kind == "torch":
            import torch

            t = torch.zeros(nbytes, dtype=torch.uint8)
            return agent.register(t), t.numpy()
        r = agent.alloc(nbytes)
        return r, r.array(np.uint8)  # the view keeps the pages after deregistration

    def hello(region) -> dict:
        return {"address": agent.address, "pid": os.getpid(), "region": region.id,
                "metadata": base64.b64encode(agent.metadata()).decode()}

    def out(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    region, view = new_region()
    keep.append(view)
    if args.layout:
        from kvpools import Pool, PoolSpec

        pool = Pool(PoolSpec(layers=2, blocks=8, block_tokens=4, heads=2, head_dim=8), 1)
        pool.register(agent)
        keep.append(pool)
    out(hello(region))
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "exit":
            break
        if cmd == "bytes":
            out({"data": base64.b64encode(view.tobytes()).decode()})
        elif cmd == "dereg":
            t0 = time.monotonic()
            region.close()
            out({"secs": time.monotonic() - t0})
        elif cmd == "notifs":
            out({"notifs": [n.data.decode() for n in agent.wait_notifications(req.get("wait", 0.5))]})
        elif cmd == "gens":
            out({"gens": list(agent.generations("kv", req["blocks"]))})
        elif cmd == "bump":
            agent.bump_generations("kv", req["blocks"], timeout=5.0)
            out({"gens": list(agent.generations("kv", req["blocks"]))})
        elif cmd == "rss":
            out({"hwm_kib": _status_kib("VmHWM"), "rss_kib": _status_kib("VmRSS")})
        elif cmd == "fresh":
            region, view = new_region()
            keep.append(view)
            out(hello(region))
    agent.close()


if __name__ == "__main__":
    main()
