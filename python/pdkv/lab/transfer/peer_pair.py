"""The caller's side of a peer-library benchmark: spawn the target and the initiator,
relay between them, collect the numbers, and always clean up.

:func:`run_pair` starts both children (``python -m pdkv.lab.transfer.peers``, see
:mod:`pdkv.lab.transfer.peers`), gives every request a deadline and kills both children
before any error leaves it, so no process outlives a call. It imports neither library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from pdkv.errors import TransferTimeout
from pdkv.lab.transfer.cpu import CpuUsage
from pdkv.lab.transfer.peer_common import Channel, PeerFailed, Workload

__all__ = ["Child", "run_pair"]


class Child:
    """One ``python -m pdkv.lab.transfer.peers`` child process with its control channel and log."""

    def __init__(self, role: str, env: dict[str, str]) -> None:
        self.role = role
        parent_end, child_end = socket.socketpair()
        log_dir = os.environ.get("PDKV_PEERS_LOG_DIR")  # keep child logs, for debugging
        self.log = (
            open(os.path.join(log_dir, f"{role}.log"), "w+b")  # noqa: SIM115 (closed in close())
            if log_dir
            else tempfile.TemporaryFile()
        )
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pdkv.lab.transfer.peers",
                    "--role",
                    role,
                    "--ctl-fd",
                    str(child_end.fileno()),
                    "--parent-pid",
                    str(os.getpid()),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                pass_fds=(child_end.fileno(),),
            )
        except BaseException:
            parent_end.close()
            self.log.close()
            raise
        finally:
            child_end.close()
        self.chan = Channel(parent_end)

    def request(self, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Sends ``msg`` and returns the reply; raises if the child fails, dies or stalls."""
        try:
            self.chan.send(msg)
            reply = self.chan.recv(deadline)
        except TimeoutError:
            raise TransferTimeout(
                f"{self.role} did not answer {msg.get('cmd')!r} in time"
                f"{self._log_tail()}"
            ) from None
        except OSError as e:
            reply = None
            err = e
        else:
            err = None
        if reply is None:
            rc = self._wait(2.0)
            raise PeerFailed(
                f"{self.role} exited (status {rc}) during {msg.get('cmd')!r}"
                f"{'; ' + str(err) if err else ''}{self._log_tail()}"
            )
        if "error" in reply:
            raise PeerFailed(f"{self.role}: {reply['error']}{self._log_tail()}")
        return reply

    def finish(self, timeout: float) -> int | None:
        """Asks the child to exit and waits; kills it after ``timeout``. Returns its status."""
        with contextlib.suppress(OSError):
            self.chan.send({"cmd": "exit"})
        rc = self._wait(timeout)
        self.close()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._wait(10.0)
        self.close()

    def close(self) -> None:
        self.chan.close()
        self.log.close()

    def _wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10.0)
            return None

    def _log_tail(self, n: int = 4000) -> str:
        try:
            self.log.seek(0, os.SEEK_END)
            size = self.log.tell()
            self.log.seek(max(0, size - n))
            text = self.log.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"\n--- {self.role} log (tail) ---\n{text}" if text else ""


def run_pair(
    peer: str, w: Workload, env: dict[str, str], timeout_s: float | None
) -> dict[str, Any]:
    """Runs ``w`` from a ``{peer}-initiator`` child into a ``{peer}-target`` child.

    Both children get ``env``; ``timeout_s`` bounds the whole run
    (:meth:`Workload.default_timeout_s` by default). Returns the result keys shared by
    :func:`~pdkv.lab.transfer.peers.run_nixl` and
    :func:`~pdkv.lab.transfer.peers.run_mooncake`, plus ``progress`` and ``exit_note``
    (a sentence naming children that exited nonzero, else empty) for the caller to use.
    """
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else w.default_timeout_s())
    spec = dataclasses.asdict(w)
    children: list[Child] = []
    try:
        target = Child(f"{peer}-target", env)
        children.append(target)
        tinfo = target.request({"cmd": "setup", "workload": spec}, deadline)
        initiator = Child(f"{peer}-initiator", env)
        children.append(initiator)
        # The target's pid, so the initiator can read both processes' CPU around its timed loop.
        res = initiator.request({"cmd": "run", "workload": spec, "target": {**tinfo, "pid": target.proc.pid}},
                                deadline)
        ver = target.request({"cmd": "verify", "workload": spec}, deadline)
        # Initiator first, so the target never sees its peer vanish mid-transfer.
        rc_i = initiator.finish(max(5.0, deadline - time.monotonic()))
        rc_t = target.finish(max(5.0, deadline - time.monotonic()))
        children.clear()
    finally:
        for child in children:  # only left on failure
            child.kill()
    exit_note = ""
    bad = {name: rc for name, rc in (("initiator", rc_i), ("target", rc_t)) if rc != 0}
    if bad:
        exit_note = f" Child exit status (nonzero): {bad}."
    lat = np.asarray(res.pop("lat_us"), dtype=np.float64)
    timed = CpuUsage(res.get("cpu_timed_s", {}))
    moved = w.payload_bytes * w.iters
    return {
        "peer": peer,
        "gbps": res["gbps"],
        "lat_p50_us": float(np.percentile(lat, 50)) if lat.size else None,
        "lat_p99_us": float(np.percentile(lat, 99)) if lat.size else None,
        "payload_bytes": w.payload_bytes,
        "block_bytes": w.block_bytes,
        "verified": bool(ver["verified"]),
        "mismatched_blocks": int(ver["mismatched_blocks"]),
        "iters": w.iters,
        "num_blocks": w.num_blocks,
        "lat_iters": w.lat_iters,
        "cpu_s": {"initiator": res["cpu_s"], "target": ver["cpu_s"]},
        "cpu_s_per_gb": timed.per_gb(moved),
        "cpu_s_per_gb_by_process": timed.per_gb_by_process(moved),
        "progress": res.get("progress"),
        "exit_note": exit_note,
    }
