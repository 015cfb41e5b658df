"""Starting serving processes on this machine: one at a time or a whole deployment.

:class:`ServerProcess` runs ``pdkv serve ROLE ...`` as a child process (its own
session, so a terminal's Ctrl-C reaches only the launcher, which then stops it in
order; it also exits by itself if the launcher dies), waits for its ready file and
stops it (SIGTERM, then SIGKILL). :class:`Deployment` starts a proxy and its workers
for one serving mode, pinned to separate CPU cores where there are enough.

Used by ``pdkv demo``, the tests, and benchmark drivers.

Example
-------
>>> with Deployment("disagg", model_dir) as dep:         # doctest: +SKIP
...     print(dep.url)                                  # the proxy's OpenAI API
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from pdkv.errors import InvalidArgument

__all__ = ["MODES", "Deployment", "ServerProcess", "StartupError", "cpu_plan"]

#: Serving modes a :class:`Deployment` can start.
MODES = ("colocated", "chunked", "disagg", "hybrid")


class StartupError(RuntimeError):
    """A serving process exited or did not become ready; the message has its log tail."""


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class ServerProcess:
    """One ``pdkv serve ROLE`` child process.

    Parameters
    ----------
    role : {"prefill", "decode", "colocated", "proxy"}
    args : sequence of str
        Further ``pdkv serve ROLE`` options (``--port 0 --ready-file`` are added).
    log_path : path-like
        Where its stdout and stderr go.
    cpus : str, optional
        ``--cpus`` value (CPU affinity).
    env : dict, optional
        Extra environment variables.
    name : str, optional
        Label in messages (default: the role).
    prefix : sequence of str
        Runs the command through this (e.g. ``netlab.Lab.prefix(host)``: on a lab host).
    """

    def __init__(self, role: str, args: Sequence[str], *, log_path: str | os.PathLike, cpus: str | None = None,
                 env: dict[str, str] | None = None, name: str | None = None, prefix: Sequence[str] = ()) -> None:
        self.role = role
        self.name = name or role
        self.log_path = Path(log_path)
        self.ready_path = self.log_path.with_suffix(".ready.json")
        self.args = list(args)
        self.cpus = cpus
        self.env = dict(env or {})
        self.prefix = list(prefix)
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self._log: Any = None

    @property
    def url(self) -> str:
        """The HTTP base URL (after :meth:`wait_ready`)."""
        return str(self.info.get("url", ""))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "ServerProcess":
        """Spawns the process (returns at once; see :meth:`wait_ready`)."""
        if self.proc is not None:
            raise InvalidArgument(f"{self.name} is already started")
        self.ready_path.unlink(missing_ok=True)
        cmd = [*self.prefix, sys.executable, "-m", "pdkv.cli", "serve", self.role, *self.args, "--port", "0",
               "--ready-file", str(self.ready_path)]
        if self.cpus:
            cmd += ["--cpus", self.cpus]
        env = {**os.environ, **self.env, "PDKV_PARENT_PID": str(os.getpid())}
        env.setdefault("PDKV_LOG", "error")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Waits for the ready file; returns its content.

        Raises
        ------
        StartupError
            The process exited or did not get ready within ``timeout`` seconds.
        """
        if self.proc is None:
            raise InvalidArgument(f"{self.name} is not started")
        deadline = time.monotonic() + timeout
        while True:
            if self.ready_path.exists():
                try:
                    self.info = json.loads(self.ready_path.read_text())
                    return self.info
                except ValueError:
                    pass  # being written
            rc = self.proc.poll()
            if rc is not None:
                raise StartupError(f"{self.name} exited with status {rc} while starting:\n{_tail(self.log_path)}")
            if time.monotonic() >= deadline:
                raise StartupError(f"{self.name} was not ready after {timeout:g} s:\n{_tail(self.log_path)}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash, for tests)."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit status."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(signal.SIGTERM)
                    rc = self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    rc = self.proc.wait()
            else:
                rc = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        self.ready_path.unlink(missing_ok=True)
        return rc

    def log_tail(self, n: int = 25) -> str:
        return _tail(self.log_path, n)

    def __repr__(self) -> str:
        return f"ServerProcess({self.name!r}, pid={self.pid}, url={self.url!r})"


def _wait_all(procs: Sequence[ServerProcess], deadline: float) -> None:
    """Waits for every process's ready file; fails as soon as one of them exits."""
    pending = list(procs)
    while pending:
        for p in list(pending):
            try:
                p.wait_ready(0.0)
                pending.remove(p)
            except StartupError:
                if not p.alive() or time.monotonic() >= deadline:
                    raise
        if pending:
            time.sleep(0.05)


def cpu_plan(n_workers: int, cpus: Sequence[int] | None = None) -> list[str | None]:
    """One CPU per worker, in order, while there are enough; else None (unpinned).

    Parameters
    ----------
    n_workers : int
    cpus : sequence of int, optional
        Default: the CPUs this process may run on.
    """
    avail = sorted(cpus if cpus is not None else (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                                  else range(os.cpu_count() or 1)))
    if len(avail) < n_workers:
        return [None] * n_workers
    return [str(c) for c in avail[:n_workers]]


@dataclass
class Deployment:
    """A proxy plus its workers for one serving mode, as child processes.

    Parameters
    ----------
    mode : {"colocated", "chunked", "disagg", "hybrid"}
        colocated/chunked: ``num_decode`` engine workers (``pdkv serve colocated
        --mode ...``) behind a colocated proxy; disagg/hybrid: ``num_prefill`` prefill
        and ``num_decode`` decode workers behind a disagg/hybrid proxy.
    model_dir : path-like
    num_prefill, num_decode : int
    worker_args : sequence of str
        Extra options for every worker (``--dtype``, ``--num-blocks``...).
    prefill_args, decode_args, proxy_args : sequence of str
        Extra options per role (e.g. ``["--hybrid-threshold", "64"]`` for the proxy).
    pin : bool
        Pin each worker to its own CPU core when there are enough cores.
    log_dir : path-like, optional
        Where the logs go (default: a temporary directory, removed by :meth:`stop`
        unless a start failed).
    env : dict, optional
        Extra environment for every process (a random ``PDKV_SECRET`` is added).
    placement : callable, optional
        ``(role, index) -> (argv prefix, bind address)`` of each process (role "proxy"
        for the proxy), e.g. one host of a :mod:`pdkv.lab.netlab.testbed` lab each (default: here, 127.0.0.1).
    registry : str, optional
        ``etcd://host:port``: the workers register there and the proxy routes to what is
        registered (``--registry``) instead of a list of URLs (docs/discovery.md).
    registry_ttl : int
        The workers' lease (``--registry-ttl``).
    """

    mode: str
    model_dir: str | os.PathLike
    num_prefill: int = 1
    num_decode: int = 1
    worker_args: Sequence[str] = ()
    prefill_args: Sequence[str] = ()
    decode_args: Sequence[str] = ()
    proxy_args: Sequence[str] = ()
    pin: bool = True
    log_dir: str | os.PathLike | None = None
    env: dict[str, str] = field(default_factory=dict)
    placement: Callable[[str, int], tuple[Sequence[str], str]] | None = None
    registry: str | None = None
    registry_ttl: int = 10
    processes: list[ServerProcess] = field(default_factory=list, init=False)
    proxy: ServerProcess | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode in ("disagg", "hybrid") and self.num_prefill < 1):
            raise InvalidArgument("a deployment needs at least one decode (engine) worker, and one prefill worker "
                                  "in disagg and hybrid modes")
        self._tmp: tempfile.TemporaryDirectory | None = None
        #: The cluster secret of the running deployment (set by :meth:`start`): what a
        #: further proxy or a tool calling the workers' ``/pd/*`` routes signs with.
        self.secret: str = ""

    @property
    def url(self) -> str:
        """The proxy's URL."""
        return self.proxy.url if self.proxy is not None else ""

    @property
    def workers(self) -> list[ServerProcess]:
        return [p for p in self.processes if p is not self.proxy]

    def start(self, timeout: float = 300.0) -> str:
        """Starts the workers, then the proxy; returns the proxy URL. Stops everything
        that started if any process fails (:class:`StartupError`)."""
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pdkv-deploy-")
            log_dir = Path(self._tmp.name)
        else:
            log_dir = Path(self.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        env = {"PDKV_SECRET": secrets.token_hex(16), **self.env}
        self.secret = env["PDKV_SECRET"]  # every worker and the proxy share it (signed /pd/* calls)
        model = ["--model", str(self.model_dir)]
        if self.registry is not None:
            model += ["--registry", self.registry, "--registry-ttl", str(self.registry_ttl)]
        disagg = self.mode in ("disagg", "hybrid")
        roles: list[tuple[str, list[str]]] = []
        if disagg:
            roles += [("prefill", [*model, *self.worker_args, *self.prefill_args])] * self.num_prefill
            roles += [("decode", [*model, *self.worker_args, *self.decode_args])] * self.num_decode
        else:
            roles += [("colocated", [*model, "--mode", self.mode, *self.worker_args, *self.decode_args])] \
                * self.num_decode
        plan = cpu_plan(len(roles)) if self.pin else [None] * len(roles)
        try:
            counts: dict[str, int] = {}
            for (role, args), cpus in zip(roles, plan):
                i = counts[role] = counts.get(role, -1) + 1
                name = f"{role}-{i}"
                prefix, bind = self._place(role, i)
                self.processes.append(ServerProcess(role, [*args, *bind], log_path=log_dir / f"{name}.log", cpus=cpus,
                                                    env=env, name=name, prefix=prefix).start())
            deadline = time.monotonic() + timeout
            _wait_all(self.processes, deadline)
            prefill = ",".join(p.url for p in self.processes if p.role == "prefill")
            decode = ",".join(p.url for p in self.processes if p.role != "prefill")
            pargs = ["--mode", self.mode if disagg else "colocated"]
            if self.registry is not None:
                pargs += ["--registry", self.registry]
            else:
                pargs += ["--decode", decode] + (["--prefill", prefill] if disagg else [])
            prefix, bind = self._place("proxy", 0)
            self.proxy = ServerProcess("proxy", [*pargs, *self.proxy_args, *bind], log_path=log_dir / "proxy.log",
                                       env=env, prefix=prefix)
            self.processes.append(self.proxy.start())
            self.proxy.wait_ready(max(deadline - time.monotonic(), 0.1))
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self.url

    def _place(self, role: str, index: int) -> tuple[Sequence[str], list[str]]:
        if self.placement is None:
            return (), []
        prefix, host = self.placement(role, index)
        return prefix, ["--host", host]

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stops the proxy, then the workers, all at once (idempotent)."""
        if self.proxy is not None:
            self.proxy.stop()
        for p in self.processes:
            if p.alive():
                assert p.proc is not None
                p.proc.send_signal(signal.SIGTERM)
        for p in self.processes:
            p.stop()
        self.processes = []
        self.proxy = None
        if self._tmp is not None and not keep_logs:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Deployment":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
