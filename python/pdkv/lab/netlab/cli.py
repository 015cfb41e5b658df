"""``pdkv netlab up|exec|status|down``: a multi-host test bed on this machine (needs root).

  pdkv netlab up --hosts 3 --link 1gbit,rtt=0.2ms     # hosts h0 h1 h2 at 10.211.0.1-3
  pdkv netlab exec h1 -- python3 -m http.server 8000   # run a command on h1
  pdkv netlab status                                   # labs, hosts, addresses, leftovers
  pdkv netlab down                                     # remove every lab (also after a crash)

See docs/netlab.md and :mod:`pdkv.lab.netlab.testbed`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pdkv.lab.netlab import testbed as netlab
from pdkv.lab.netlab.probe import measure_rate


def _up(args: argparse.Namespace) -> int:
    lab = netlab.Lab(hosts=args.hosts, link=args.link, name=args.name).up().persist()
    print(f"lab {lab.name}: {len(lab.hosts)} hosts on a switch, each link {lab.link}"
          f"{' (delay: ' + lab.info['delay'] + ')' if lab.info.get('delay') else ''}")
    for h in lab.hosts:
        print(f"  {h}  {lab.address(h):15s} netns {lab.namespace(h)}")
    if args.check:
        if len(lab.hosts) < 2:
            print("--check needs two hosts", file=sys.stderr)
            return 2
        print(f"measured h0 -> h1: {measure_rate(lab, 'h0', 'h1') / 1e9:.3f} Gbit/s (one TCP stream)")
    print(f"run commands with `pdkv netlab exec{'' if args.name == 'lab' else ' --lab ' + lab.name} HOST -- CMD`; "
          f"remove with `pdkv netlab down`")
    return 0


def _exec(args: argparse.Namespace) -> int:
    if not args.argv:
        print("pdkv netlab exec: give a command after HOST (e.g. `pdkv netlab exec h1 -- hostname -I`)",
              file=sys.stderr)
        return 2
    lab = netlab.attach(args.lab)
    argv = [*lab.prefix(args.host), *args.argv]
    os.execvp(argv[0], argv)
    return 127  # not reached


def _status(args: argparse.Namespace) -> int:
    labs = netlab.list_labs()
    live = set(netlab.live_namespaces())
    known = {ns for lab in labs for ns in [lab.get("switch", "")] + [h["namespace"] for h in lab["hosts"].values()]}
    leftovers = sorted(ns for ns in live if ns.startswith(netlab.PREFIX) and ns not in known)
    if args.json:
        print(json.dumps({"labs": labs, "leftover_namespaces": leftovers}, indent=1))
        return 0
    if not labs and not leftovers:
        print("no labs")
    for lab in labs:
        rtt = f" (delay: {lab['delay']})" if lab.get("delay") else "" if lab.get("rtt_emulated", True) \
            else " (rtt not emulated)"
        missing = [h for h, v in lab["hosts"].items() if v["namespace"] not in live]
        print(f"lab {lab['name']} ({lab.get('status')}), link {lab['link']}{rtt}, created by pid {lab['pid']}"
              f"{', MISSING hosts ' + ' '.join(missing) if missing else ''}")
        for h, v in lab["hosts"].items():
            print(f"  {h}  {v['address']:15s} netns {v['namespace']}")
    if leftovers:
        print(f"leftover namespaces without a state file (`pdkv netlab down` removes them): {' '.join(leftovers)}")
    return 0


def _down(args: argparse.Namespace) -> int:
    removed = netlab.down(args.lab) if args.lab else netlab.down_all()
    print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdkv netlab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create a lab")
    up.add_argument("--hosts", type=int, default=2, help="number of hosts h0..hN-1 (default 2)")
    up.add_argument("--link", default="unlimited",
                    help="each host's access link: RATE[,rtt=DURATION], e.g. 1gbit,rtt=0.2ms (default unlimited)")
    up.add_argument("--name", default="lab", help="lab name, lowercase letters and digits (default lab)")
    up.add_argument("--check", action="store_true", help="measure h0 -> h1 once the lab is up")
    ex = sub.add_parser("exec", help="run a command on a host: exec [--lab NAME] HOST -- CMD...")
    ex.add_argument("--lab", help="lab name (default: the only lab that is up)")
    ex.add_argument("host", help="h0, h1, ... (or 0, 1, ...)")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    st = sub.add_parser("status", help="labs, hosts and addresses, leftovers")
    st.add_argument("--json", action="store_true")
    dn = sub.add_parser("down", help="remove a lab (default: every lab, and leftovers of crashed ones)")
    dn.add_argument("lab", nargs="?", help="only this lab")
    args = ap.parse_args(argv)
    if args.cmd == "exec" and args.argv[:1] == ["--"]:
        args.argv = args.argv[1:]
    return {"up": _up, "exec": _exec, "status": _status, "down": _down}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
