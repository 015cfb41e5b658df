"""Small-request latency at the proxy with and without abuse, measured in one run.

A colocated deployment (``pdkv serve colocated`` behind ``pdkv serve proxy``, real
processes) on a tiny random-weight model. Phase 1 measures small requests alone. Phase
2 measures them again while this script holds ``--idle`` raw sockets open to the proxy
(a third send nothing, a third half of their request headers, a third headers and half
a body) and posts one large prompt (``--big-mb`` MB of text, tokenized off the
proxy's event loop). Prints p50/p95/max latency of both phases, how many abusive
sockets the proxy closed within the run (the idle/header/body deadlines), and the
proxy's open file handles. Not a test: nothing is asserted.

    .venv/bin/python bench/serve_abuse.py [--idle 5000] [--big-mb 8] [--small 100]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdkv.serving.launch import Deployment
from pdkv.serving.tiny import save_tiny_model


def _post(url: str, body: bytes, timeout: float = 120.0) -> tuple[int, float]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        with e:
            e.read()
            status = e.code
    return status, time.perf_counter() - t0


def _small(base: str, model: str, n: int) -> tuple[list[float], list[int]]:
    body = json.dumps({"model": model, "prompt": [11, 12, 13, 14], "max_tokens": 2, "temperature": 0}).encode()
    lat, statuses = [], []
    for _ in range(n):
        status, dt = _post(base + "/v1/completions", body)
        lat.append(dt)
        statuses.append(status)
    return lat, statuses


def _summary(lat: list[float]) -> str:
    s = sorted(lat)
    p95 = s[min(len(s) - 1, int(0.95 * len(s)))]
    return f"p50 {statistics.median(s) * 1e3:7.1f} ms  p95 {p95 * 1e3:7.1f} ms  max {s[-1] * 1e3:7.1f} ms"


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=5000, help="abusive sockets held open (default 5000)")
    ap.add_argument("--big-mb", type=float, default=8.0, help="size of the large prompt in MB (default 8)")
    ap.add_argument("--small", type=int, default=100, help="small requests per phase (default 100)")
    ap.add_argument("--keepalive-timeout", type=float, default=5.0,
                    help="the proxy's idle/header deadline for this run (default 5 s)")
    ap.add_argument("--body-timeout", type=float, default=5.0, help="the proxy's body deadline (default 5 s)")
    args = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.idle + 512
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard != resource.RLIM_INFINITY else want,
                                                    hard))
    tmp = Path(tempfile.mkdtemp(prefix="pdkv-abuse-"))
    model_dir = save_tiny_model(tmp / "tiny-llama", arch="llama", seed=3)
    big_bytes = int(args.big_mb * (1 << 20))
    proxy_args = ["--keepalive-timeout", str(args.keepalive_timeout), "--body-timeout", str(args.body_timeout),
                  "--max-body-bytes", str(big_bytes + (1 << 20))]
    with Deployment("colocated", model_dir, num_decode=1, proxy_args=proxy_args, pin=False) as dep:
        base = dep.url
        model = model_dir.name
        host, port = base.removeprefix("http://").rsplit(":", 1)
        assert dep.proxy is not None and dep.proxy.pid is not None
        ppid = dep.proxy.pid
        _small(base, model, 5)  # warm-up
        print(f"proxy {base} (pid {ppid}), keep-alive/header deadline {args.keepalive_timeout:g} s, body deadline "
              f"{args.body_timeout:g} s; proxy fds at rest: {_fds(ppid)}")

        lat0, st0 = _small(base, model, args.small)
        print(f"alone:        {_summary(lat0)}  ({sum(s == 200 for s in st0)}/{len(st0)} ok)")

        # Abuse: idle and half-sent sockets, then one large prompt in a thread.
        sel = selectors.DefaultSelector()
        socks = []
        t0 = time.perf_counter()
        for i in range(args.idle):
            s = socket.socket()
            s.setblocking(True)
            s.settimeout(10)
            try:
                s.connect((host, int(port)))
            except OSError as e:
                print(f"stopped opening sockets at {i}: {e}")
                s.close()
                break
            if i % 3 == 1:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            elif i % 3 == 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            socks.append(s)
        print(f"opened {len(socks)} abusive sockets in {time.perf_counter() - t0:.1f} s; "
              f"proxy fds now {_fds(ppid)}")
        big_result: list[tuple[int, float]] = []
        prompt = ("lorem ipsum " * (big_bytes // 12 + 1))[:big_bytes]
        big_body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
        big = threading.Thread(target=lambda: big_result.append(_post(base + "/v1/completions", big_body)))
        big.start()
        lat1, st1 = _small(base, model, args.small)
        print(f"under abuse:  {_summary(lat1)}  ({sum(s == 200 for s in st1)}/{len(st1)} ok)")
        big.join(300)
        if big_result:
            print(f"large prompt ({args.big_mb:g} MB): HTTP {big_result[0][0]} after {big_result[0][1]:.2f} s")
        # How many abusive sockets did the proxy close, and when?
        closed = 0
        end = time.monotonic() + max(args.keepalive_timeout, args.body_timeout) + 5
        while closed < len(socks) and time.monotonic() < end:
            for key, _ in sel.select(timeout=0.5):
                s = key.fileobj
                try:
                    data = s.recv(65536)  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(s)
                    closed += 1
        print(f"the proxy closed {closed}/{len(socks)} abusive sockets within "
              f"{max(args.keepalive_timeout, args.body_timeout) + 5:g} s of the run's end; proxy fds "
              f"{_fds(ppid)}")
        for s in socks:
            s.close()
        lat2, st2 = _small(base, model, args.small)
        print(f"after:        {_summary(lat2)}  ({sum(s == 200 for s in st2)}/{len(st2)} ok)")


if __name__ == "__main__":
    main()
