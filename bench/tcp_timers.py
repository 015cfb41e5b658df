"""Which loopback connections wait on a TCP timer (persist = zero window, on = RTO/loss probe)?

Polls ``ss -tnoipH state established`` every ``--every`` seconds while a command runs
and attributes every sighting to the listening socket its connection belongs to
(a pdkv agent, a raw-socket sink, ...), by the port of whichever end listens. A
stall that a timer rescues (a window update that never came, a lost ACK) shows as a
connection seen in ``persist`` for hundreds of ms.

    .venv/bin/python bench/tcp_timers.py --out bench/results/busy/timers.json -- \\
        .venv/bin/pdkv bench transfer --transport tcp --payload 64M --busy 2
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time

_LINE = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+):(\d+)\s+(\S+):(\d+)\s+(.*)$")


def listeners() -> dict[int, str]:
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True).stdout
    res = {}
    for ln in out.splitlines():
        f = ln.split()
        if len(f) >= 4:
            port = int(f[3].rsplit(":", 1)[1])
            m = re.search(r'users:\(\("([^"]+)",pid=(\d+)', ln)
            res[port] = f"{m.group(1)}:{m.group(2)}" if m else "?"
    return res


def snapshot() -> list[dict]:
    out = subprocess.run(["ss", "-tnoipH", "state", "established"], capture_output=True, text=True).stdout
    rows, cur = [], None
    for ln in out.splitlines():
        m = _LINE.match(ln)
        if m:
            cur = {"recvq": int(m.group(1)), "sendq": int(m.group(2)), "lport": int(m.group(4)),
                   "pport": int(m.group(6)), "rest": m.group(7)}
            rows.append(cur)
        elif cur is not None:
            cur["rest"] += " " + ln.strip()
    for r in rows:
        t = re.search(r"timer:\((\w+),([\d.]+)(m?s)", r["rest"])
        r["timer"] = t.group(1) if t else None
        p = re.search(r'users:\(\("([^"]+)",pid=(\d+)', r["rest"])
        r["proc"] = f"{p.group(1)}:{p.group(2)}" if p else "?"
        w = re.search(r"snd_wnd:(\d+)", r["rest"])
        r["snd_wnd"] = int(w.group(1)) if w else None
        del r["rest"]
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=0.02)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not cmd:
        ap.error("give the command to watch after --")
    p = subprocess.Popen(cmd)
    seen: list[dict] = []
    ports: dict[int, str] = {}
    t0 = time.monotonic()
    while p.poll() is None:
        ports.update(listeners())
        now = round(time.monotonic() - t0, 3)
        for r in snapshot():
            if r["timer"] in ("persist", "on"):
                r["t"] = now
                seen.append(r)
        time.sleep(a.every)
    # attribute each connection to the listener it belongs to (either end)
    by = collections.Counter()
    first_last: dict[tuple, list[float]] = {}
    for r in seen:
        lst = ports.get(r["lport"]) or ports.get(r["pport"]) or "?"
        side = "accepting end" if r["lport"] in ports else "connecting end"
        key = (r["timer"], f"listener port {r['lport'] if r['lport'] in ports else r['pport']} ({lst})", side)
        by[key] += 1
        conn = (r["timer"], r["lport"], r["pport"])
        first_last.setdefault(conn, [r["t"], r["t"]])[1] = r["t"]
    print(f"# {' '.join(cmd)}\n# rc {p.returncode}; snapshots with a timer, by connection's listener:")
    for (timer, lst, side), n in by.most_common():
        print(f"  {timer:8} {n:6}  {lst}, {side}")
    long = sorted(((v[1] - v[0], k) for k, v in first_last.items()), reverse=True)[:10]
    print("# longest spans a connection was seen in a timer (s, timer, local port, peer port):")
    for span, k in long:
        print(f"  {span:7.3f} {k}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": cmd, "listeners": ports, "sightings": seen}, f)
    return p.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
