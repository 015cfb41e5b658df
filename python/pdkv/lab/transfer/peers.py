"""The ``pdkv bench transfer`` workload run through peer libraries: NIXL and Mooncake.

``pdkv bench transfer --compare nixl,mooncake`` measures pdkv beside the libraries a user
would otherwise pick, on the same machine, in the same run, with the same workload:
``num_blocks`` blocks of ``block_bytes`` each, written from an initiator's pool into a
target's pool at seeded random destinations (so nothing coalesces), ``iters`` times, then
``lat_iters`` single-block writes for latency. Each library's own API does the work; this
module only sets it up, times it and checks the bytes.

Every run uses three processes: the caller (which imports neither library), a *target*
and an *initiator*, both ``python -m pdkv.lab.transfer.peers`` children that talk to the caller
over a private socket pair (JSON lines). Both children die with the caller
(``PR_SET_PDEATHSIG``), every wait has a deadline, and on any failure both children are
killed before the error is raised, so no process outlives a call.

Example
-------
>>> from pdkv.lab.transfer.peers import Workload, available_peers, run_nixl
>>> w = Workload(block_bytes=32768, num_blocks=2048, iters=5, seed=0, lat_iters=200)
>>> if "nixl" in available_peers():
...     r = run_nixl(w)
...     print(r["gbps"], r["lat_p50_us"], r["verified"])

Traps measured on a 2-core, loopback-only machine, and what this module does about each
----------------------------------------------------------------------------------------
NIXL 1.5.1 (``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``; without
``--no-deps`` pip pulls a multi-GB CUDA torch, which nixl-cu12 declares):

* **Idle progress thread spins a core.** ``nixl_agent`` hard-codes
  ``nixlAgentConfig.pthrDelay = 0`` and offers no knob for it. The UCX backend's progress
  thread ``poll()``s the UCX worker's event fd with ``pthrDelay`` (rounded up to whole
  milliseconds) as its timeout, so 0 means ``poll(..., 0)`` in a loop: one core at 100%
  while idle (measured: 0.999 CPU-seconds per second, idle agent). We construct the agent
  with ``pthrDelay`` set (``_NIXL_PTHR_DELAY_US``): the thread then sleeps in ``poll()``
  until UCX signals work; idle CPU drops to ~0.001 s/s and throughput is unchanged. The
  spinning thread does buy a lower median single-block latency (it never sleeps), at the
  price of a core per process; ``backend_env={"PDKV_NIXL_PTHR_DELAY_US": "0"}`` measures
  that configuration, ``"-1"`` runs with no progress thread at all.
* **``UCX_TLS=shm`` fails** unless the UCX backend is created with
  ``ucx_error_handling_mode="none"``: UCX's shared-memory transports cannot detect a dead
  peer, so under NIXL's default mode (``"peer"``) ``create_backend("UCX")`` raises
  ``NIXL_ERR_BACKEND``. We pick ``"none"`` when ``UCX_TLS`` names only same-host
  transports (see ``_ucx_error_mode``).
* **Segfault at exit** (exit status -11, every NIXL process, with or without a progress
  thread) when Debian's ``libibverbs1`` is installed (as Mooncake needs): UCX's ib module
  is loaded and crashes during teardown. ``UCX_MODULES=^ib`` avoids it; we set it unless
  the host has an RDMA device or the caller set ``UCX_MODULES``.
* **UCX over TCP also uses non-loopback interfaces** unless ``UCX_NET_DEVICES=lo``; we
  always set it (both ends are on 127.0.0.1, so loopback is the right device anyway).
* **UCX's own transport choice on one host is not TCP**: with ``UCX_TLS`` unset, NIXL's
  WRITEs go through ``cma`` (``process_vm_writev``, one copy between processes; seen with
  ``UCX_PROTO_INFO=y``). We set ``UCX_TLS=tcp`` by default so that NIXL is measured on
  the path a cross-host deployment without RDMA gets, like pdkv's TCP transport.

Mooncake Transfer Engine (``apt-get install -y libibverbs1`` then
``pip install mooncake-transfer-engine-non-cuda``; its engine links libibverbs even when
it only uses TCP):

* TCP protocol with ``P2PHANDSHAKE`` metadata, so no etcd or metadata server is needed;
  the target's segment name is ``127.0.0.1:<rpc port>``.
* **Batches above ~2,000 slices are rejected**: the TCP transport queues at most
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (default 1024) transfers per peer plus
  ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (default 1024) waiting for admission. We
  raise both to cover one batch (at most 65535 each; values already in the environment
  win); a batch above 65535 blocks is written as consecutive chunks of 65535.
* ``MC_TCP_BIND_ADDRESS=127.0.0.1`` keeps its data listener on loopback.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pdkv.backends import _nixl as _nixl_setup
from pdkv.errors import InvalidArgument, NotSupported, PdkvError, TransferTimeout

__all__ = [
    "PeerFailed",
    "Workload",
    "available_peers",
    "run_mooncake",
    "run_nixl",
]

_NIXL_PIP = _nixl_setup.PIP
_MOONCAKE_PIP = "apt-get install -y libibverbs1 && pip install mooncake-transfer-engine-non-cuda"

# Upper bound of the NIXL UCX progress thread's poll() timeout (microseconds; the backend
# rounds it up to whole milliseconds). It only bounds how late the thread notices work
# whose event-fd wake-up UCX missed; normal wake-ups are immediate. 0 (NIXL's Python
# default) turns the poll into a busy loop.
_NIXL_PTHR_DELAY_US = _nixl_setup.PTHR_DELAY_US

# Mooncake's TCP per-peer queue limits (defaults 1024 + 1024, maximum 65535 each).
_MC_QUEUE_MAX = 65535

_PROGRESS_NOTE = {
    "thread": "NIXL progress thread blocking in poll() between UCX events "
    "(pthrDelay={delay} us; NIXL's Python default of 0 spins a core)",
    "thread-spinning": "NIXL progress thread busy-polling (pthrDelay=0, NIXL's default)",
    "caller": "no NIXL progress thread (the waiting caller polls)",
}

_DONE_TAG = b"pdkv-bench-done"
_TARGET_NAME = "pdkv-bench-target"
_INITIATOR_NAME = "pdkv-bench-initiator"


class PeerFailed(PdkvError):
    """A peer library (NIXL, Mooncake) failed during a benchmark; the message says where."""

    code = "PeerFailed"


@dataclass(frozen=True)
class Workload:
    """One transfer workload, identical for pdkv and every peer library.

    Parameters
    ----------
    block_bytes : int
        Bytes per block, e.g. 32768: one K or V block-half of llama-3-8b
        (16 tokens x 8 kv heads x 128 head dim x bf16).
    num_blocks : int
        Blocks written per iteration; the payload is ``block_bytes * num_blocks`` and both
        pools are exactly that big.
    iters : int
        Timed repetitions of the whole batch (one untimed warm-up runs first).
    seed : int
        Seeds the destination permutation and the source bytes (:meth:`permutation`,
        :meth:`source_pool`).
    lat_iters : int
        Single-block (``block_bytes``) writes, each waited on, for p50/p99 latency.
    """

    block_bytes: int
    num_blocks: int
    iters: int
    seed: int
    lat_iters: int

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.num_blocks <= 0:
            raise InvalidArgument(
                f"Workload needs block_bytes > 0 and num_blocks > 0, got "
                f"block_bytes={self.block_bytes}, num_blocks={self.num_blocks}"
            )
        if self.iters <= 0 or self.lat_iters < 0:
            raise InvalidArgument(
                f"Workload needs iters > 0 and lat_iters >= 0, got iters={self.iters}, "
                f"lat_iters={self.lat_iters}"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes moved per iteration (= the size of each pool)."""
        return self.block_bytes * self.num_blocks

    def permutation(self) -> np.ndarray:
        """Destination block of each source block: ``[num_blocks]`` int64.

        Source block ``i`` is written to destination block ``perm[i]``. A seeded random
        permutation, so (up to the odd accidental neighbour) no two consecutive source
        blocks land next to each other and no library can coalesce them.
        """
        return np.random.default_rng([self.seed, 0]).permutation(self.num_blocks)

    def source_pool(self) -> np.ndarray:
        """The initiator's pool: ``[num_blocks * block_bytes]`` uint8 of seeded random bytes."""
        raw = np.random.default_rng([self.seed, 1]).bytes(self.payload_bytes)
        return np.frombuffer(raw, dtype=np.uint8).copy()  # writable, owned

    def latency_blocks(self) -> np.ndarray:
        """Source block of each single-block latency write: ``[lat_iters]`` int64."""
        return np.arange(self.lat_iters, dtype=np.int64) % self.num_blocks

    def default_timeout_s(self) -> float:
        """A generous deadline for one whole run (start-up, transfers, verification)."""
        moved = self.payload_bytes * (self.iters + 1) + self.block_bytes * self.lat_iters
        # 60 s of start-up and verification slack, then at least 20 MB/s and 2 ms/write.
        return 60.0 + moved / 20e6 + self.lat_iters * 2e-3


def available_peers() -> list[str]:
    """Peer libraries importable here, of ``["nixl", "mooncake"]`` (imports neither)."""
    peers = []
    if _nixl_installed():
        peers.append("nixl")
    if _mooncake_installed():
        peers.append("mooncake")
    return peers


def _nixl_installed() -> bool:
    return importlib.util.find_spec("nixl") is not None


def _mooncake_installed() -> bool:
    # find_spec("mooncake.engine") would import the mooncake package; look for the
    # extension file instead. Its engine links libibverbs even for TCP: without
    # Debian's libibverbs1 the import fails, so Mooncake counts as not installed.
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return False
    if not _loadable("libibverbs.so.1"):
        return False
    return any(
        name.startswith("engine.") and name.endswith(".so")
        for loc in spec.submodule_search_locations
        if os.path.isdir(loc)
        for name in os.listdir(loc)
    )


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def _version(*dists: str) -> str:
    for dist in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


# ---------------------------------------------------------------------------------------
# Public entry points (run in the caller; they import neither library)
# ---------------------------------------------------------------------------------------


def run_nixl(
    w: Workload,
    *,
    backend_env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Runs ``w`` through NIXL's Python API (UCX backend) between two processes.

    Parameters
    ----------
    w : Workload
        What to move.
    backend_env : dict of str to str, optional
        Extra environment for both NIXL processes, applied last. Without it the run uses
        ``UCX_TLS=tcp`` (unless the caller's environment sets ``UCX_TLS``) over
        ``UCX_NET_DEVICES=lo``: TCP, like pdkv's default transport. Examples:
        ``{"UCX_TLS": "shm"}`` (UCX shared memory; the backend then uses error handling
        mode ``"none"``, which it needs), ``{"UCX_TLS": "cma,tcp"}`` (writes through
        ``process_vm_writev``), ``{"UCX_TLS": ""}`` (UCX's own choice, which on one
        host is cma). ``{"PDKV_NIXL_PTHR_DELAY_US": "0"}`` restores NIXL's busy-polling
        progress thread, to measure that trap.
    timeout_s : float, optional
        Deadline for the whole run; :meth:`Workload.default_timeout_s` by default.

    Returns
    -------
    dict
        ``peer`` ("nixl"), ``gbps`` (payload GB/s, 1 GB = 1e9 bytes, over the timed
        iterations), ``lat_p50_us``/``lat_p99_us`` (single-block write, posted and
        waited on), ``payload_bytes``, ``block_bytes``, ``verified`` (every destination
        block equals its source block), ``version``, ``notes``, plus
        ``mismatched_blocks``, ``iters``, ``num_blocks``, ``lat_iters``, ``env`` (the
        UCX/NIXL variables used), ``progress`` (how NIXL progressed: ``"thread"``,
        ``"thread-spinning"`` or ``"caller"``) and ``cpu_s`` (CPU seconds each child
        used over its whole life, about 2 s of which is importing NIXL).

    Raises
    ------
    NotSupported
        NIXL is not installed (the message names the pip command).
    TransferTimeout
        The run passed its deadline (both children are killed first).
    PeerFailed
        NIXL or a child failed (message carries the child's log tail).
    """
    if not _nixl_installed():
        raise NotSupported(f"NIXL is not installed; install it with: {_NIXL_PIP}")
    env = _nixl_env(backend_env)
    res = _run_pair("nixl", w, env, timeout_s)
    tls = env.get("UCX_TLS", "")
    res["version"] = _version("nixl", "nixl-cu12")
    res["env"] = {k: v for k, v in env.items() if k.startswith(("UCX_", "NIXL_", "PDKV_NIXL_"))}
    res["notes"] = (
        f"NIXL {res['version']} Python API, UCX backend "
        f"(UCX_TLS={tls or 'UCX default'}, error mode {_ucx_error_mode(env)}), "
        "one prepared WRITE request of all blocks reposted per iteration, completion by "
        "polling check_xfer_state; "
        + _PROGRESS_NOTE[res["progress"]].format(delay=_pthr_delay_us(env))
        + "; the target learns the data is complete from a NIXL notification on the last "
        "write."
        + res.pop("exit_note", "")
    )
    return res


def run_mooncake(w: Workload, *, timeout_s: float | None = None) -> dict[str, Any]:
    """Runs ``w`` through Mooncake Transfer Engine (TCP, P2PHANDSHAKE) between two processes.

    Parameters and return value as :func:`run_nixl` (``peer`` is ``"mooncake"``; no
    ``progress`` key; ``env`` lists the ``MC_*`` variables used). Mooncake's Python API
    has no completion notification for TCP writes, so the target is told to verify over
    the side channel once the initiator has seen every write complete.

    Raises
    ------
    NotSupported
        Mooncake is not installed (the message names the install commands).
    TransferTimeout, PeerFailed
        As :func:`run_nixl`.
    """
    if not _mooncake_installed():
        raise NotSupported(
            f"Mooncake Transfer Engine is not installed; install it with: {_MOONCAKE_PIP}"
        )
    queue = str(min(_MC_QUEUE_MAX, max(1024, w.num_blocks)))
    env = dict(os.environ)
    # One batch is num_blocks slices; the default per-peer limits (1024 queued + 1024
    # waiting for admission) reject anything above ~2,000. A value the caller set wins.
    env.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", queue)
    env.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", queue)
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # data listener on loopback only
    res = _run_pair("mooncake", w, env, timeout_s)
    res.pop("progress", None)
    res["version"] = _version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
    res["env"] = {k: v for k, v in env.items() if k.startswith("MC_")}
    res["notes"] = (
        f"Mooncake Transfer Engine {res['version']}, TCP protocol, P2PHANDSHAKE metadata, "
        f"batch_transfer_sync_write of all blocks per iteration (per-peer TCP queue limits "
        f"{env['MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER']} + "
        f"{env['MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER']}; batches above {_MC_QUEUE_MAX} "
        "blocks split into consecutive chunks), transfer_sync_write per latency sample; "
        "target told to verify over the side channel after the initiator saw every write "
        "complete."
        + res.pop("exit_note", "")
    )
    return res


def _nixl_env(backend_env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # Only loopback traffic: both ends are on 127.0.0.1, and UCX's TCP transport would
    # otherwise also open lanes over every other interface.
    env["UCX_NET_DEVICES"] = "lo"
    # With Debian's libibverbs installed but no RDMA device, UCX's ib module crashes at
    # process exit (status -11). Without a device it has nothing to offer anyway.
    if "UCX_MODULES" not in env and not _has_rdma_device():
        env["UCX_MODULES"] = "^ib"
    # UCX's TCP transport unless told otherwise: pdkv's own default transport is TCP, and
    # left to itself UCX writes between two processes on one host through cma
    # (process_vm_writev, a same-host single copy), which is not what a cross-host
    # deployment without RDMA gets. backend_env={"UCX_TLS": ""} restores UCX's choice.
    env.setdefault("UCX_TLS", "tcp")
    env.update(backend_env or {})
    if not env.get("UCX_TLS"):
        env.pop("UCX_TLS", None)
    return env


def _pthr_delay_us(env: dict[str, str]) -> int:
    return int(env.get("PDKV_NIXL_PTHR_DELAY_US", _NIXL_PTHR_DELAY_US))


_has_rdma_device = _nixl_setup.rdma_device_present


def _ucx_error_mode(env: dict[str, str]) -> str:
    """``"none"`` when ``UCX_TLS`` names only transports that cannot detect a dead peer
    (shared with the nixl transport: :func:`pdkv.backends._nixl.ucx_error_mode`)."""
    return _nixl_setup.ucx_error_mode(env.get("UCX_TLS", ""))


# ---------------------------------------------------------------------------------------
# Orchestration: spawn the target and the initiator, relay, collect, always clean up
# ---------------------------------------------------------------------------------------


class _Channel:
    """JSON lines over a stream socket, every receive with a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, deadline: float | None) -> dict[str, Any] | None:
        """The next message; ``None`` at EOF. Raises ``TimeoutError`` past ``deadline``."""
        while b"\n" not in self._buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
            else:
                self._sock.settimeout(None)
            try:
                chunk = self._sock.recv(1 << 16)
            except socket.timeout:
                raise TimeoutError from None
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def readable(self, timeout: float) -> bool:
        """Whether a message (or EOF) is waiting, after at most ``timeout`` seconds."""
        if b"\n" in self._buf:
            return True
        return bool(select.select([self._sock], [], [], timeout)[0])

    def close(self) -> None:
        self._sock.close()


class _Child:
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
        self.chan = _Channel(parent_end)

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


def _run_pair(
    peer: str, w: Workload, env: dict[str, str], timeout_s: float | None
) -> dict[str, Any]:
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else w.default_timeout_s())
    spec = dataclasses.asdict(w)
    children: list[_Child] = []
    try:
        target = _Child(f"{peer}-target", env)
        children.append(target)
        tinfo = target.request({"cmd": "setup", "workload": spec}, deadline)
        initiator = _Child(f"{peer}-initiator", env)
        children.append(initiator)
        res = initiator.request({"cmd": "run", "workload": spec, "target": tinfo}, deadline)
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
        "progress": res.get("progress"),
        "exit_note": exit_note,
    }


# ---------------------------------------------------------------------------------------
# Child side (runs in `python -m pdkv.lab.transfer.peers`): the only code that imports the peers
# ---------------------------------------------------------------------------------------


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _touched_zeros(nbytes: int) -> np.ndarray:
    # np.zeros maps lazily-zeroed pages; writing them now keeps page faults out of the
    # timed transfers.
    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(0)
    return a


def _verify(w: Workload, pool: np.ndarray) -> tuple[bool, int]:
    """Whether every destination block of ``pool`` holds its source block."""
    src = w.source_pool().reshape(w.num_blocks, w.block_bytes)
    dst = pool.reshape(w.num_blocks, w.block_bytes)
    perm = w.permutation()
    bad = 0
    step = max(1, (64 << 20) // w.block_bytes)  # compare ~64 MiB at a time
    for s in range(0, w.num_blocks, step):
        eq = (dst[perm[s : s + step]] == src[s : s + step]).all(axis=1)
        bad += int((~eq).sum())
    return bad == 0, bad


def _workload(msg: dict[str, Any]) -> Workload:
    return Workload(**msg["workload"])


def _timed_loop(post_and_wait: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        post_and_wait()
    return time.perf_counter() - t0


def _latency_loop(post_and_wait: Callable[[int], None], blocks: np.ndarray) -> list[float]:
    lat = []
    for b in blocks:
        t0 = time.perf_counter()
        post_and_wait(int(b))
        lat.append((time.perf_counter() - t0) * 1e6)
    return lat


# ---- NIXL -----------------------------------------------------------------------------


class _NixlBindShim:
    """Stands in for ``nixl._api.nixlBind`` while one agent is built, to set pthrDelay.

    ``nixl_agent.__init__`` builds its ``nixlAgentConfig`` and then hard-codes
    ``pthrDelay = 0`` (a busy-polling progress thread) before passing it to
    ``nixlBind.nixlAgent``; this shim sets the delay on the config at that call.
    """

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us
        self.applied = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, cfg: Any) -> Any:  # noqa: N802 (NIXL's name)
        cfg.pthrDelay = self._delay_us
        self.applied = True
        return self._real.nixlAgent(name, cfg)


def _nixl_agent(name: str) -> tuple[Any, str]:
    """A NIXL agent with a UCX backend whose progress thread sleeps when idle.

    Returns the agent and how it progresses: ``"thread"`` (NIXL's progress thread,
    blocking in ``poll()`` between events), ``"thread-spinning"`` (pthrDelay 0: NIXL's
    own default), or ``"caller"`` (no progress thread: whoever waits must poll; used when
    ``PDKV_NIXL_PTHR_DELAY_US`` is negative or pthrDelay cannot be set).
    """
    # The backend wheel's _api directly: ``import nixl`` would import torch (see
    # pdkv.backends._nixl.import_bindings).
    api = _nixl_setup.import_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    delay_us = _pthr_delay_us(dict(os.environ))
    real = getattr(api, "nixlBind", None)
    agent = None
    progress = "caller"
    if delay_us >= 0 and real is not None:
        shim = _NixlBindShim(real, delay_us)
        api.nixlBind = shim
        try:
            # No backend in the config: UCX is created below, with its parameters.
            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=[]))
        finally:
            api.nixlBind = real
        if shim.applied:
            progress = "thread" if delay_us > 0 else "thread-spinning"
        else:  # NIXL changed underneath: never leave a spinning thread behind
            del agent
            agent = None
    if agent is None:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": _ucx_error_mode(dict(os.environ))})
    return agent, progress


def _nixl_wait(agent: Any, handle: Any, state: str, deadline: float) -> None:
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError("NIXL transfer did not complete in time")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed (state {state})")


def _nixl_descs(base: int, w: Workload, blocks: np.ndarray) -> np.ndarray:
    """``[len(blocks), 3]`` uint64 rows (address, length, device 0) for NIXL."""
    d = np.zeros((len(blocks), 3), dtype=np.uint64)
    d[:, 0] = base + blocks.astype(np.uint64) * np.uint64(w.block_bytes)
    d[:, 1] = w.block_bytes
    return d


def _nixl_target(chan: _Channel) -> None:
    msg = _expect(chan, "setup")
    w = _workload(msg)
    agent, progress = _nixl_agent(_TARGET_NAME)
    pool = _touched_zeros(w.payload_bytes)
    reg = agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    chan.send(
        {
            "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
            "base": pool.ctypes.data,
        }
    )
    if progress == "caller":
        # Nobody else moves UCX forward in this process, and its TCP transport needs
        # the receiver to progress: poll notifications (which progresses) until told.
        while not chan.readable(0.0):
            agent.update_notifs()
    msg = _expect(chan, "verify")
    deadline = time.monotonic() + 120.0
    while not agent.check_remote_xfer_done(_INITIATOR_NAME, _DONE_TAG):
        if time.monotonic() > deadline:
            raise TimeoutError("no completion notification from the initiator")
        time.sleep(0.001)
    ok, bad = _verify(w, pool)
    chan.send({"verified": ok, "mismatched_blocks": bad, "cpu_s": _cpu_s()})
    _expect(chan, "exit")
    agent.deregister_memory(reg)


def _nixl_initiator(chan: _Channel) -> None:
    msg = _expect(chan, "run")
    w = _workload(msg)
    tinfo = msg["target"]
    agent, progress = _nixl_agent(_INITIATOR_NAME)
    src = w.source_pool()
    reg = agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(base64.b64decode(tinfo["metadata"]))
    deadline = time.monotonic() + w.default_timeout_s()

    all_blocks = np.arange(w.num_blocks, dtype=np.int64)
    local_side = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", _nixl_descs(src.ctypes.data, w, all_blocks), "DRAM"
    )
    remote_side = agent.prep_xfer_dlist(
        remote, _nixl_descs(int(tinfo["base"]), w, all_blocks), "DRAM"
    )
    perm = w.permutation()
    batch = agent.make_prepped_xfer(
        "WRITE", local_side, all_blocks.astype(np.int32), remote_side, perm.astype(np.int32)
    )

    def post_batch() -> None:
        _nixl_wait(agent, batch, agent.transfer(batch), deadline)

    post_batch()  # warm-up: connection set-up and first touch stay out of the timing
    elapsed = _timed_loop(post_batch, w.iters)

    singles: dict[int, Any] = {}

    def single(b: int) -> Any:
        if b not in singles:
            singles[b] = agent.make_prepped_xfer(
                "WRITE", local_side, [b], remote_side, [int(perm[b])]
            )
        return singles[b]

    lat_blocks = w.latency_blocks()
    for b in set(lat_blocks.tolist()):
        single(b)  # prepare outside the timed section, as for the batch
    lat = _latency_loop(
        lambda b: _nixl_wait(agent, single(b), agent.transfer(single(b)), deadline), lat_blocks
    )
    # The target learns that every byte has landed from a notification that NIXL
    # delivers only after this last write's data (all earlier writes are complete).
    last = single(int(lat_blocks[-1]) if lat_blocks.size else 0)
    _nixl_wait(agent, last, agent.transfer(last, _DONE_TAG), deadline)

    chan.send(
        {
            "gbps": w.payload_bytes * w.iters / elapsed / 1e9,
            "lat_us": lat,
            "cpu_s": _cpu_s(),
            "progress": progress,
        }
    )
    _expect(chan, "exit")
    for h in [batch, *singles.values()]:
        h.release()
    local_side.release()
    remote_side.release()
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)


# ---- Mooncake -------------------------------------------------------------------------


def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize returned {rc}")
    return te


def _mooncake_target(chan: _Channel) -> None:
    msg = _expect(chan, "setup")
    w = _workload(msg)
    te = _mooncake_engine()
    pool = _touched_zeros(w.payload_bytes)
    rc = te.register_memory(pool.ctypes.data, pool.nbytes)
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory returned {rc}")
    chan.send({"session": f"127.0.0.1:{te.get_rpc_port()}", "base": pool.ctypes.data})
    # Mooncake's TCP path has no completion notification in its Python API; the caller
    # sends "verify" only after the initiator saw every write complete.
    _expect(chan, "verify")
    ok, bad = _verify(w, pool)
    chan.send({"verified": ok, "mismatched_blocks": bad, "cpu_s": _cpu_s()})
    _expect(chan, "exit")
    te.unregister_memory(pool.ctypes.data)


def _mooncake_initiator(chan: _Channel) -> None:
    msg = _expect(chan, "run")
    w = _workload(msg)
    tinfo = msg["target"]
    te = _mooncake_engine()
    src = w.source_pool()
    rc = te.register_memory(src.ctypes.data, src.nbytes)
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory returned {rc}")
    session = tinfo["session"]
    base = int(tinfo["base"])
    bs = w.block_bytes
    perm = w.permutation()
    srcs = (src.ctypes.data + np.arange(w.num_blocks, dtype=np.int64) * bs).tolist()
    dsts = (base + perm * bs).tolist()
    lens = [bs] * w.num_blocks
    chunks = [
        (srcs[s : s + _MC_QUEUE_MAX], dsts[s : s + _MC_QUEUE_MAX], lens[s : s + _MC_QUEUE_MAX])
        for s in range(0, w.num_blocks, _MC_QUEUE_MAX)
    ]

    def post_batch() -> None:
        for c in chunks:  # one chunk unless a batch exceeds Mooncake's queue maximum
            rc = te.batch_transfer_sync_write(session, *c)
            if rc != 0:
                raise RuntimeError(
                    f"Mooncake batch_transfer_sync_write of {len(c[0])} blocks failed "
                    f"(returned {rc})"
                )

    post_batch()  # warm-up
    elapsed = _timed_loop(post_batch, w.iters)

    def single(b: int) -> None:
        rc = te.transfer_sync_write(session, srcs[b], dsts[b], bs)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer_sync_write failed (returned {rc})")

    lat = _latency_loop(single, w.latency_blocks())
    chan.send({"gbps": w.payload_bytes * w.iters / elapsed / 1e9, "lat_us": lat, "cpu_s": _cpu_s()})
    _expect(chan, "exit")
    te.unregister_memory(src.ctypes.data)


# ---- child main -----------------------------------------------------------------------

_ROLES: dict[str, Callable[[_Channel], None]] = {
    "nixl-target": _nixl_target,
    "nixl-initiator": _nixl_initiator,
    "mooncake-target": _mooncake_target,
    "mooncake-initiator": _mooncake_initiator,
}


def _expect(chan: _Channel, cmd: str) -> dict[str, Any]:
    msg = chan.recv(None)
    if msg is None:
        raise SystemExit(0)  # the caller went away: leave quietly
    if msg.get("cmd") != cmd:
        if msg.get("cmd") == "exit":
            raise SystemExit(0)
        raise RuntimeError(f"expected {cmd!r} from the caller, got {msg.get('cmd')!r}")
    return msg


def _die_with_parent(parent_pid: int) -> None:
    # Linux: SIGKILL this child when the process that spawned it dies, so a killed bench
    # never leaves a target holding its pool and port.
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="pdkv bench peer child (internal)")
    ap.add_argument("--role", required=True, choices=sorted(_ROLES))
    ap.add_argument("--ctl-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    _die_with_parent(args.parent_pid)
    chan = _Channel(socket.socket(fileno=args.ctl_fd))
    try:
        _ROLES[args.role](chan)
    except SystemExit:
        raise
    except BaseException as e:  # report, then fail: the caller raises PeerFailed
        with contextlib.suppress(OSError):
            chan.send({"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
