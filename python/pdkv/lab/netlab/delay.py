"""The userspace delay line of a netlab lab, for kernels without ``sch_netem``.

Run by :class:`pdkv.lab.netlab.testbed.Lab` inside the lab's switch namespace (never by hand)::

    python -m pdkv.lab.netlab.delay --links h0,h1 --one-way-delay-us 50 --queue-limit-bytes 8388608

For each host link (the switch's end of the host's veth pair, out of the bridge) it
creates a TAP device ``d-<link>``, prints one JSON line ``{"taps": [...]}`` once they
exist (the lab then plugs them into the bridge), and forwards frames between each veth
and its TAP after the one-way delay, in native threads (no Python per frame), until
SIGTERM or SIGINT. The frame forwarding is cpp/lab/netlab_delay.cc.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from pdkv.lab._native import module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.lab.netlab.delay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", required=True, help="comma-separated veth names in this namespace")
    ap.add_argument("--one-way-delay-us", type=float, required=True)
    ap.add_argument("--queue-limit-bytes", type=int, default=8 << 20)
    args = ap.parse_args(argv)
    try:
        line = module().netlab.DelayLine([x for x in args.links.split(",") if x], args.one_way_delay_us / 1e6,
                                      args.queue_limit_bytes)
    except (RuntimeError, ValueError) as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    # SIGTERM/SIGINT make stop_r readable (the C-level handler writes the wakeup fd
    # while the native threads run without the GIL).
    stop_r, stop_w = os.pipe()
    os.set_blocking(stop_w, False)
    signal.set_wakeup_fd(stop_w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(json.dumps({"taps": line.taps}), flush=True)
    # The lab reads one line; it may exit (a persisted lab) while this runs on.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    line.run(stop_r)
    print(json.dumps({"counters": line.counters()}), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
