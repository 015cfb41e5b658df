"""An elastic serving deployment across netlab hosts, found through etcd:
``python -m pdkv.lab.netlab.discovery [--model DIR] [--prefill 2] [--decode 2] [--proxies 2]
[--link 1gbit] [--check]`` (root: it builds a :mod:`pdkv.lab.netlab.testbed` lab of three hosts).

* h0: etcd and the proxies (``pdkv serve proxy --registry``)
* h1: the prefill workers, h2: the decode workers (``--registry``): every KV byte
  crosses the h1 -> h2 link over tcp.

It prints the lab, etcd's URL and the proxies' URLs, answers one completion through
each proxy, then serves until Ctrl-C (``--check``: exits after the completions). Reach
the proxies from h0, e.g. ``pdkv netlab exec --lab NAME h0 -- pdkv bench serve --url
URL``. See docs/discovery.md.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pdkv.discovery_etcd import EtcdServer, wait_for_stop
from pdkv.lab.netlab import testbed as netlab
from pdkv.serving.launch import Deployment, ServerProcess

__all__ = ["LabDeployment", "main"]

HOSTS = {"proxy": "h0", "prefill": "h1", "decode": "h2"}


@dataclass
class LabDeployment:
    """etcd, workers and proxies on the hosts of an up ``lab`` (see the module docstring)."""

    lab: Any
    model_dir: str | Path
    num_prefill: int = 2
    num_decode: int = 2
    num_proxies: int = 2
    registry_ttl: int = 5
    worker_args: Sequence[str] = ()
    log_dir: Path | None = None
    etcd: EtcdServer | None = field(default=None, init=False)
    proxies: list[ServerProcess] = field(default_factory=list, init=False)
    _stack: ExitStack = field(default_factory=ExitStack, init=False)

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.proxies]

    def start(self, timeout: float = 300.0) -> "LabDeployment":
        lab = self.lab
        log_dir = self.log_dir or Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="pdkv-lab-")))
        try:
            self.etcd = lab.call_in("h0", EtcdServer, lab.address("h0"))
            self._stack.callback(self.etcd.close)
            lab.call_in("h0", self.etcd.start)
            env = {"PDKV_SECRET": secrets.token_hex(16)}
            dep = Deployment("disagg", self.model_dir, num_prefill=self.num_prefill, num_decode=self.num_decode,
                             registry=self.etcd.url, registry_ttl=self.registry_ttl, pin=False, env=env,
                             placement=lambda role, i: (lab.prefix(HOSTS[role]), lab.address(HOSTS[role])),
                             worker_args=list(self.worker_args), log_dir=log_dir)
            dep.start(timeout)
            self._stack.callback(dep.stop)
            self.proxies = [dep.proxy] if dep.proxy is not None else []
            for i in range(1, self.num_proxies):
                p = ServerProcess("proxy", ["--mode", "disagg", "--registry", self.etcd.url,
                                            "--host", lab.address("h0")],
                                  log_path=log_dir / f"proxy-{i}.log", env=env, name=f"proxy-{i}",
                                  prefix=lab.prefix("h0")).start()
                self._stack.callback(p.stop)
                p.wait_ready(timeout)
                self.proxies.append(p)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Waits until every proxy sees every worker (``/health`` answers 200 and lists them)."""
        want = self.num_prefill + self.num_decode
        end = time.monotonic() + timeout
        for url in self.urls:
            while True:
                status, body = self.lab.call_in("h0", _get, url + "/health")
                if status == 200 and len(json.loads(body)["workers"]) == want:
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"proxy {url} does not see the {want} workers: {body}")
                time.sleep(0.2)

    def complete(self, url: str, prompt: str, max_tokens: int = 16) -> dict[str, Any]:
        """One greedy completion through the proxy at ``url`` (run on h0)."""
        model = json.loads(self.lab.call_in("h0", _get, url + "/v1/models")[1])["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return self.lab.call_in("h0", _post, url + "/v1/completions", body)

    def stop(self) -> None:
        self._stack.close()

    def __enter__(self) -> "LabDeployment":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.lab.netlab.discovery", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--prefill", type=int, default=2, help="prefill workers on h1 (default 2)")
    ap.add_argument("--decode", type=int, default=2, help="decode workers on h2 (default 2)")
    ap.add_argument("--proxies", type=int, default=2, help="proxies on h0 (default 2)")
    ap.add_argument("--link", default="1gbit", help="every host's link (netlab spec; default 1gbit)")
    ap.add_argument("--name", default=None, help="lab name (for `pdkv netlab exec --lab NAME`)")
    ap.add_argument("--worker-args", default="", help="extra `pdkv serve` worker options, space-separated")
    ap.add_argument("--check", action="store_true", help="exit after one completion through each proxy")
    args = ap.parse_args(argv)
    if args.model:
        model_dir = Path(args.model)
    else:
        from pdkv.serving.models import default_model_dir
        model_dir = default_model_dir()
    lab = netlab.Lab(hosts=3, link=args.link, name=args.name).up()
    try:
        with LabDeployment(lab, model_dir, args.prefill, args.decode, args.proxies,
                           worker_args=args.worker_args.split()) as dep:
            dep.wait_serving()
            print(f"lab {lab.name}: h0 {lab.address('h0')} (etcd, proxies), h1 {lab.address('h1')} "
                  f"({args.prefill} prefill), h2 {lab.address('h2')} ({args.decode} decode), links {args.link}")
            print(f"etcd: {dep.etcd.url if dep.etcd else ''}")
            for url in dep.urls:
                out = dep.complete(url, "The capital of France is")
                print(f"proxy {url}: {out['choices'][0]['text']!r}")
            sys.stdout.flush()
            if not args.check:
                print(f"serving; e.g. pdkv netlab exec --lab {lab.name} h0 -- pdkv bench serve --url {dep.urls[0]}"
                      " ...   (Ctrl-C stops)", flush=True)
                wait_for_stop()
    finally:
        lab.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
