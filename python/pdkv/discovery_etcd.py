"""Runs a single-member etcd (Debian's ``etcd-server``) for tests, demos and small
deployments: ``python -m pdkv.discovery_etcd [--host H] [--port P] [--data-dir D]``
prints ``etcd://H:P`` once etcd answers and runs until interrupted.

A production deployment uses its own etcd cluster; pdkv only needs its client URL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from .discovery import EtcdClient
from .errors import NotFound, PeerConnectionError

__all__ = ["EtcdServer", "etcd_binary"]


def etcd_binary() -> str | None:
    """Path of the ``etcd`` server binary (``PDKV_ETCD`` names another one), or None."""
    return shutil.which(os.environ.get("PDKV_ETCD") or "etcd")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd process on ``host``: client port ``port`` (0: a free one), data in
    ``data_dir`` (default: a temporary directory removed by :meth:`close`).
    :meth:`stop` and :meth:`start` again keep the port and the data (etcd down, then back).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, data_dir: str | None = None) -> None:
        binary = etcd_binary()
        if binary is None:
            raise NotFound("no etcd binary (install Debian's etcd-server, or set PDKV_ETCD)")
        self.binary, self.host = binary, host
        self.port = port or _free_port(host)
        self.peer_port = _free_port(host)
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix="pdkv-etcd-")
        self.data_dir = data_dir or os.path.join(self._tmp or "", "data")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self._tmp or data_dir or ".", "etcd.log")

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> str:
        """Starts etcd and waits until it answers; returns its ``etcd://`` URL."""
        client_url = f"http://{self.host}:{self.port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        argv = [self.binary, "--name", "pdkv", "--data-dir", self.data_dir,
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"pdkv={peer_url}", "--log-level", "error"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        client = EtcdClient(self.host, self.port, timeout=1.0)
        end = time.monotonic() + timeout
        while True:
            try:
                client.get("/pdkv-ready-probe")
                return self.url
            except PeerConnectionError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    with open(self.log_path, "rb") as f:
                        tail = f.read()[-2000:].decode(errors="replace")
                    raise PeerConnectionError(f"etcd did not start on {self.host}:{self.port}: {tail}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """Kills etcd (its data stays for :meth:`start`)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_stop() -> None:
    """Returns on SIGINT or SIGTERM (children keep the default handling of both)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.discovery_etcd", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="client and peer address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=2379, help="client port (default 2379; 0: any free one)")
    ap.add_argument("--data-dir", default=None, help="etcd's data directory (default: a temporary one)")
    args = ap.parse_args(argv)
    server = EtcdServer(args.host, args.port, args.data_dir)
    try:
        print(server.start(), flush=True)
        wait_for_stop()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
