"""A target agent in its own process, for the memory-bound tests (tests/library/tcp/test_bounds.py):
its RSS is read from /proc/<pid>/status by the test, undisturbed by the test's own
allocations.

Start: ``python bounds_target.py --config JSON``, where the config holds ``agent`` (Agent
keyword arguments; ``tcp`` a dict of TcpOptions fields) and ``regions`` (sizes in bytes of
the zero-filled host regions to register). It prints ``{"address", "pid", "regions": [ids]}``
and answers one JSON line per command:

* ``{"cmd": "take"}`` -> ``{"taken": n}``: takes (and drops) the queued notifications
* ``{"cmd": "exit"}``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import pdkv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = json.loads(ap.parse_args().config)
    kw = dict(cfg.get("agent", {}))
    if "tcp" in kw:  # the tcp options' fields, as JSON
        kw["options"] = [pdkv.TcpOptions(**kw.pop("tcp"))]
    agent = pdkv.Agent(cfg.get("name", "target"), **kw)
    mems = [np.zeros(n, np.uint8) for n in cfg.get("regions", [])]
    regions = [agent.register(m) for m in mems]

    def out(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    out({"address": agent.address, "pid": os.getpid(), "regions": [r.id for r in regions]})
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "exit":
            break
        if req["cmd"] == "take":
            out({"taken": len(agent.get_notifications())})
        else:
            out({"error": f"unknown command {req['cmd']}"})
    agent.close()


if __name__ == "__main__":
    main()
