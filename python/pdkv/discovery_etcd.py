"""Runs a single-member etcd (Debian's ``etcd-server``) for tests, demos and small
deployments: ``python -m pdkv.discovery_etcd [--host H] [--port P] [--data-dir D]``
prints ``etcd://H:P`` once etcd answers and runs until interrupted. With
``--cert-file/--key-file [--trusted-ca-file]`` it serves TLS (``etcds://H:P``; a CA
file also turns on client-certificate authentication); with ``--auth-user U`` (password
from ``PDKV_ETCD_PASSWORD``) it enables etcd's authentication, with a user ``U`` that
may read and write pdkv's prefix only (and a ``root`` user with the same password).

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
from dataclasses import dataclass
from typing import Sequence

from .discovery import EtcdClient, EtcdOptions, EtcdRefused, _b64, _prefix_end
from .errors import NotFound, PeerConnectionError

__all__ = ["EtcdServer", "EtcdTLS", "etcd_binary", "enable_auth"]


@dataclass(frozen=True)
class EtcdTLS:
    """etcd's server certificate and key; ``ca_file``: also require client certificates
    signed by that CA (``--client-cert-auth``)."""

    cert_file: str
    key_file: str
    ca_file: str | None = None


def enable_auth(client: EtcdClient, user: str, password: str, *, prefix: str = "/pdkv",
                root_password: str | None = None) -> None:
    """Turns on etcd's authentication through the gateway (what ``etcdctl user add``,
    ``role add``, ``role grant-permission``, ``user grant-role`` and ``auth enable`` do):
    a ``root`` user (role ``root``, password ``root_password``, default ``password``)
    and ``user`` with a role that may read and write ``prefix/`` only."""
    root_pw = root_password or password
    p = (prefix.rstrip("/") + "/").encode()
    for path, body in (("auth/role/add", {"name": "root"}),
                       ("auth/user/add", {"name": "root", "password": root_pw}),
                       ("auth/user/grant", {"user": "root", "role": "root"}),
                       ("auth/role/add", {"name": user}),
                       ("auth/role/grant", {"name": user, "perm": {"permType": "READWRITE", "key": _b64(p),
                                                                   "range_end": _b64(_prefix_end(p))}}),
                       ("auth/user/add", {"name": user, "password": password}),
                       ("auth/user/grant", {"user": user, "role": user}),
                       ("auth/enable", {})):
        if path == "auth/user/add" and body["name"] == "root" and user == "root":
            continue
        try:
            client.call(path, body)
        except EtcdRefused as e:
            if "already exists" not in str(e):
                raise


def etcd_binary() -> str | None:
    """Path of the ``etcd`` server binary (``PDKV_ETCD`` names another one), or None."""
    return shutil.which(os.environ.get("PDKV_ETCD") or "etcd")


class _PortTaken(Exception):
    """etcd exited because a port it was told to listen on is taken."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd process on ``host``: client port ``port`` (0: a free one), data in
    ``data_dir`` (default: a temporary directory removed by :meth:`close`).
    :meth:`stop` and :meth:`start` again keep the port and the data (etcd down, then back).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, data_dir: str | None = None, *,
                 tls: EtcdTLS | None = None, args: Sequence[str] = ()) -> None:
        binary = etcd_binary()
        if binary is None:
            raise NotFound("no etcd binary (install Debian's etcd-server, or set PDKV_ETCD)")
        self.binary, self.host = binary, host
        # Ports we picked may be taken by someone else before etcd binds them: a first
        # start that loses that race picks others (a restart keeps them: clients know them).
        self._pick_ports, self._started = port == 0, False
        self.port = port or _free_port(host)
        self.peer_port = _free_port(host)
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix="pdkv-etcd-")
        self.data_dir = data_dir or os.path.join(self._tmp or "", "data")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self._tmp or data_dir or ".", "etcd.log")
        self.tls, self.args = tls, list(args)

    @property
    def url(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.host}:{self.port}"

    def client(self, options: EtcdOptions | None = None, timeout: float = 5.0) -> EtcdClient:
        """A client of this etcd (TLS when it serves TLS; ``options``: user, client cert)."""
        if options is None and self.tls is not None:
            options = EtcdOptions(ca_file=self.tls.ca_file)
        return EtcdClient(self.host, self.port, timeout=timeout, tls=self.tls is not None, options=options)

    def start(self, timeout: float = 20.0) -> str:
        """Starts etcd and waits until it answers; returns its ``etcd://`` URL."""
        tries = 5 if self._pick_ports and not self._started else 1
        while True:
            tries -= 1
            try:
                url = self._start_once(timeout)
                self._started = True
                return url
            except _PortTaken:
                if tries == 0:
                    raise PeerConnectionError(f"etcd did not start on {self.host}:{self.port}: "
                                              f"a port it was given ({self.port} or {self.peer_port}) is in use") from None
                self.port, self.peer_port = _free_port(self.host), _free_port(self.host)

    def _start_once(self, timeout: float) -> str:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://{self.host}:{self.port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        argv = [self.binary, "--name", "pdkv", "--data-dir", self.data_dir,
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"pdkv={peer_url}", "--log-level", "error"]
        if self.tls is not None:
            argv += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file]
            if self.tls.ca_file:
                argv += ["--trusted-ca-file", self.tls.ca_file, "--client-cert-auth"]
        argv += self.args
        with open(self.log_path, "ab") as log:
            log_from = log.tell()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        probe = None
        end = time.monotonic() + timeout
        while True:
            try:
                if probe is None:  # with client certificates required: the server's own (if it may be one)
                    opts = None
                    if self.tls is not None and self.tls.ca_file:
                        opts = EtcdOptions(ca_file=self.tls.ca_file, cert_file=self.tls.cert_file,
                                           key_file=self.tls.key_file)
                    probe = self.client(opts, timeout=1.0)
                probe.get("/pdkv-ready-probe")
                return self.url
            except EtcdRefused:  # it answers (and wants authentication)
                return self.url
            except (PeerConnectionError, OSError) as e:
                if self.tls is not None and "SSL" in str(e) and "Connection refused" not in str(e):
                    return self.url  # it speaks TLS and refused our certificate: it is up
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    with open(self.log_path, "rb") as f:
                        f.seek(log_from)
                        tail = f.read()[-2000:].decode(errors="replace")
                    if "address already in use" in tail:
                        raise _PortTaken()
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
    ap.add_argument("--cert-file", help="serve TLS with this certificate (and --key-file)")
    ap.add_argument("--key-file", help="the certificate's private key")
    ap.add_argument("--trusted-ca-file", help="require client certificates signed by this CA")
    ap.add_argument("--auth-user", help="enable etcd authentication: this user may read and write /pdkv/ "
                    "(password from PDKV_ETCD_PASSWORD; root gets the same one)")
    args = ap.parse_args(argv)
    if bool(args.cert_file) != bool(args.key_file):
        ap.error("--cert-file and --key-file go together")
    password = os.environ.get("PDKV_ETCD_PASSWORD", "")
    if args.auth_user and not password:
        ap.error("--auth-user needs the password in PDKV_ETCD_PASSWORD")
    tls = EtcdTLS(args.cert_file, args.key_file, args.trusted_ca_file) if args.cert_file else None
    server = EtcdServer(args.host, args.port, args.data_dir, tls=tls)
    try:
        url = server.start()
        if args.auth_user:
            enable_auth(server.client(EtcdOptions(ca_file=args.trusted_ca_file, cert_file=args.cert_file,
                                                  key_file=args.key_file) if tls else None),
                        args.auth_user, password)
        print(url, flush=True)
        wait_for_stop()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
