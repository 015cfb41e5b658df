"""The other side of two-process tests: a pdkv agent driven by JSON lines on stdin.

Start: ``python peer_proc.py --name N --secret S --spec JSON --seed K [--listen H:P]``;
it prints ``{"address": ..., "pid": ...}`` and then answers one JSON line per command:

* ``{"cmd": "digest", "blocks": [...]}`` -> ``{"digest": sha256 of the blocks' logical bytes}``
* ``{"cmd": "logical", "blocks": [...]}`` -> ``{"data": base64}``
* ``{"cmd": "expect", "items": [{"notif", "blocks", "digest"}], "timeout": s}``: for
  each notification as it arrives, checks *at once* that its blocks already hold the
  expected bytes -> ``{"results": [{"notif", "ok"}], "missing": [...]}``
* ``{"cmd": "xfer", "op": "write"|"read", "address": ..., "lblocks", "rblocks", "notify"}``:
  acts as initiator against another agent -> ``{"ok": bool, "error": str|null}``
* ``{"cmd": "gens", "blocks": [...]}`` / ``{"cmd": "bump", "blocks": [...]}`` -> ``{"gens": [...]}``:
  the blocks' generations now / after a bump (``xfer`` takes them as ``"rgens"``)
* ``{"cmd": "exit"}``
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pdkv  # noqa: E402
from kvpools import Pool, PoolSpec, expect_notifications  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--secret", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--tcp", default="{}")
    ap.add_argument("--transports", default="tcp")
    ap.add_argument("--shared", action="store_true", help="KV pool in pdkv-allocated shared memory")
    args = ap.parse_args()
    spec = PoolSpec(**json.loads(args.spec))
    agent = pdkv.Agent(args.name, secret=args.secret, listen=args.listen, options=[pdkv.TcpOptions(**json.loads(args.tcp))],
                       transports=args.transports.split(","))
    pool = Pool(spec, args.seed, shared_by=agent if args.shared else None)
    pool.register(agent)

    def out(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    out({"address": agent.address, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "exit":
            break
        if cmd == "digest":
            out({"digest": pool.digest(req["blocks"])})
        elif cmd == "logical":
            out({"data": base64.b64encode(pool.logical(req["blocks"]).tobytes()).decode()})
        elif cmd == "gens":
            out({"gens": agent.generations("kv", req["blocks"])})
        elif cmd == "bump":
            out({"gens": agent.bump_generations("kv", req["blocks"], timeout=30)})
        elif cmd == "expect":
            out(expect_notifications(agent, pool.digest, req, with_peer=True))
        elif cmd == "xfer":
            try:
                peer = agent.connect(req["address"])
                x = (agent.write if req["op"] == "write" else agent.read)(
                    peer, pdkv.Blocks("kv", req["lblocks"]),
                    pdkv.Blocks("kv", req["rblocks"], generations=req.get("rgens")), notify=req.get("notify"),
                    timeout=30)
                x.wait(30)
                out({"ok": True, "error": None, "transport": x.transport})
            except pdkv.PdkvError as e:
                out({"ok": False, "error": f"{type(e).__name__}: {e}"})
        else:
            out({"error": f"unknown command {cmd}"})
    agent.close()


if __name__ == "__main__":
    main()
