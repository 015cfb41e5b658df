"""``pdkv bench transfer --link RATE[,rtt=..]``: the benchmark across two lab hosts.

The target (``--serve``) runs on lab host h1 and the initiator (the same command
with ``--target h1:7500``) on h0, behind the emulated link (:mod:`pdkv.lab.netlab.testbed`), so
pdkv and the raw-socket ceilings measured in the same run cross the same link. The
lab exists for the run only. Results carry a ``link`` entry (``--json``, ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any, Sequence

from pdkv.errors import InvalidArgument, PdkvError
from pdkv.lab.netlab.testbed import Lab, parse_link
from pdkv.lab.transfer import hetero
from pdkv.lab.transfer.common import parse_size, pool_blocks

TARGET_PORT = 7500  # inside the target's own namespace, so never taken
# A lab host's one network device. UCX (nixl) must use it: with "all" it also offers lo,
# and peers on another host cannot reach that; a "lo" set for loopback runs would fail.
LAB_ENV = {"UCX_NET_DEVICES": "eth0"}


def _without_link(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--link":
            skip = True
        elif not a.startswith("--link="):
            out.append(a)
    return out


def _blocks_needed(args: argparse.Namespace) -> int:
    """The target pool size the initiator's ``run`` will ask for (its largest payload)."""
    payloads = [parse_size(p) for p in args.payload.split(",")]
    if args.hetero:  # decode rank 0's pool, sized as the --hetero run asks for it
        return hetero.target_blocks(args, payloads)
    return pool_blocks(args.model, payloads)


def _check(args: argparse.Namespace) -> None:
    if args.serve or args.target:
        raise InvalidArgument("--link starts both sides in a lab; it cannot be combined with --serve or --target")
    if args.transport == "shm":
        raise InvalidArgument("--link measures a network link; the shm transport does not cross one "
                              "(use tcp or nixl)")


def transfer_behind_link(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Runs ``pdkv bench transfer`` (argv without ``--link``) across a two-host lab."""
    _check(args)
    link = parse_link(args.link)
    with Lab(hosts=2, link=link) as lab:
        target = _start_target(lab, args)
        try:
            return _run_initiator(lab, args, argv, link_info={
                "spec": str(link), "rate_bps": link.rate_bps, "rtt_s": link.rtt_s,
                "rtt_emulated": lab.info["rtt_emulated"], "delay": lab.info.get("delay"), "lab": lab.name,
                "initiator": lab.address("h0"), "target": lab.address("h1")})
        finally:
            _stop(target)


def _pin(cpu_index: int, enabled: bool):
    cpus = sorted(os.sched_getaffinity(0))
    if not enabled or len(cpus) < 2:
        return None
    return lambda: os.sched_setaffinity(0, {cpus[cpu_index]})


def _start_target(lab: Lab, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdkv.lab.transfer.bench", "--serve", "--listen", f"{lab.address('h1')}:{TARGET_PORT}",
           "--host", lab.address("h1"), "--transport", args.transport,
           "--model", args.model, "--blocks", str(_blocks_needed(args)), "--rcvlowat", str(args.rcvlowat),
           "--batch-bytes", str(args.batch_bytes), "--conns", str(args.conns), "--threads", str(args.threads),
           "--memory", args.memory]
    if args.hetero:
        cmd += hetero.target_flags(args)
    proc = lab.popen("h1", cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                     text=True, preexec_fn=_pin(1, args.pin), env={**os.environ, **LAB_ENV})
    line = proc.stdout.readline()
    if not line:
        raise PdkvError(f"the benchmark target on lab host h1 failed to start (exit code {proc.wait()})")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # `--serve` stops on Ctrl-C
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()


def _run_initiator(lab: Lab, args: argparse.Namespace, argv: Sequence[str], link_info: dict[str, Any]) -> int:
    cmd = [sys.executable, "-m", "pdkv.lab.transfer.bench", *_without_link(argv),
           "--target", f"{lab.address('h1')}:{TARGET_PORT}", "--host", lab.address("h0")]
    rtt = f"rtt {link_info['rtt_s'] * 1e3:g} ms" + (f" ({link_info['delay']})" if link_info.get("delay") else "")
    print(f"link: {link_info['spec']} between lab hosts h0 {link_info['initiator']} (initiator) and h1 "
          f"{link_info['target']} (target); {rtt}", file=sys.stderr, flush=True)
    proc = lab.popen("h0", cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **LAB_ENV})
    for line in proc.stdout:
        if args.json and line.startswith("{"):
            line = json.dumps({**json.loads(line), "link": link_info}) + "\n"
        sys.stdout.write(line)
        sys.stdout.flush()
    rc = proc.wait()
    if rc == 0 and args.out:
        with open(args.out) as f:
            doc = json.load(f)
        doc["command"] = " ".join(["pdkv", "bench", "transfer", *argv])
        doc["link"] = link_info
        for r in doc.get("results", []):
            r["link"] = link_info
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return rc
