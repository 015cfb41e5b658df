"""Measures what a lab link actually carries: one TCP stream between two lab hosts.

``measure_rate(lab, "h0", "h1", nbytes)`` runs a receiver on h1 and a sender on h0
(``python -m pdkv.lab.netlab.probe recv|send``) and returns the goodput in bits per
second, timed at the receiver from the first byte to the last. Used by the tests
(the rate a link is shaped to must be what it carries) and ``pdkv netlab up --check``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

from pdkv.errors import InvalidArgument
from pdkv.lab.netlab.testbed import Lab, NetlabError

CHUNK = 1 << 20


def receive(listen_host: str) -> None:
    with socket.create_server((listen_host, 0)) as srv:
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        srv.settimeout(60)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(60)
            buf = bytearray(CHUNK)
            n = conn.recv_into(buf)
            t0 = time.perf_counter()
            total = n
            while n:
                n = conn.recv_into(buf)
                total += n
            dt = time.perf_counter() - t0
    print(json.dumps({"bytes": total, "seconds": dt}), flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    payload = memoryview(bytearray(CHUNK))
    with socket.create_connection((host, port), timeout=60) as s:
        left = nbytes
        while left > 0:
            s.sendall(payload[: min(CHUNK, left)])
            left -= CHUNK


def measure_rate(lab: Lab, src: str, dst: str, nbytes: int = 32 << 20, timeout: float = 120) -> float:
    """Goodput from ``src`` to ``dst`` in bits per second (one TCP stream, ``nbytes``)."""
    if nbytes < 2 * CHUNK:
        raise InvalidArgument(f"measure at least {2 * CHUNK} bytes, got {nbytes}")
    recv = lab.popen(dst, [sys.executable, "-m", "pdkv.lab.netlab.probe", "recv", lab.address(dst)],
                     stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(recv.stdout.readline() or "{}").get("port")
        if port is None:
            raise NetlabError(f"the rate probe's receiver on {dst} did not start (exit {recv.wait(10)})")
        lab.run(src, [sys.executable, "-m", "pdkv.lab.netlab.probe", "send", lab.address(dst), str(port), str(nbytes)],
                timeout=timeout)
        out, _ = recv.communicate(timeout=timeout)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    result = json.loads(out.strip().splitlines()[-1])
    if result["bytes"] != nbytes:
        raise NetlabError(f"the rate probe received {result['bytes']} of {nbytes} bytes")
    return result["bytes"] * 8 / result["seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.lab.netlab.probe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("host")
    s = sub.add_parser("send")
    s.add_argument("host")
    s.add_argument("port", type=int)
    s.add_argument("nbytes", type=int)
    args = ap.parse_args(argv)
    if args.cmd == "recv":
        receive(args.host)
    else:
        send(args.host, args.port, args.nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
