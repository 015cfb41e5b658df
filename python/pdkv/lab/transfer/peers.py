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
  with ``pthrDelay`` set (``peer_nixl.NIXL_PTHR_DELAY_US``): the thread then sleeps in ``poll()``
  until UCX signals work; idle CPU drops to ~0.001 s/s and throughput is unchanged. The
  spinning thread does buy a lower median single-block latency (it never sleeps), at the
  price of a core per process; ``backend_env={"PDKV_NIXL_PTHR_DELAY_US": "0"}`` measures
  that configuration, ``"-1"`` runs with no progress thread at all.
* **``UCX_TLS=shm`` fails** unless the UCX backend is created with
  ``ucx_error_handling_mode="none"``: UCX's shared-memory transports cannot detect a dead
  peer, so under NIXL's default mode (``"peer"``) ``create_backend("UCX")`` raises
  ``NIXL_ERR_BACKEND``. We pick ``"none"`` when ``UCX_TLS`` names only same-host
  transports (see ``peer_nixl.ucx_error_mode``).
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

Modules
-------
This module is the caller's API (and the command line its children run). The rest lives in
:mod:`~pdkv.lab.transfer.peer_common` (:class:`Workload`, :class:`PeerFailed`, the
control channel), :mod:`~pdkv.lab.transfer.peer_pair` (spawning, relaying, clean-up),
:mod:`~pdkv.lab.transfer.peer_child` (what every child role shares), and one module per
library with its target and initiator roles: :mod:`~pdkv.lab.transfer.peer_nixl`,
:mod:`~pdkv.lab.transfer.peer_mooncake`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import os
import socket
import sys
from typing import Any, Callable

from pdkv.backends import _nixl as _nixl_setup
from pdkv.errors import NotSupported
from pdkv.lab.transfer import peer_mooncake, peer_nixl
from pdkv.lab.transfer.peer_child import die_with_parent
from pdkv.lab.transfer.peer_common import Channel, PeerFailed, Workload
from pdkv.lab.transfer.peer_mooncake import MC_QUEUE_MAX
from pdkv.lab.transfer.peer_nixl import pthr_delay_us, ucx_error_mode
from pdkv.lab.transfer.peer_pair import run_pair

__all__ = [
    "PeerFailed",
    "Workload",
    "available_peers",
    "run_mooncake",
    "run_nixl",
]

_NIXL_PIP = _nixl_setup.PIP
_MOONCAKE_PIP = "apt-get install -y libibverbs1 && pip install mooncake-transfer-engine-non-cuda"

_PROGRESS_NOTE = {
    "thread": "NIXL progress thread blocking in poll() between UCX events "
    "(pthrDelay={delay} us; NIXL's Python default of 0 spins a core)",
    "thread-spinning": "NIXL progress thread busy-polling (pthrDelay=0, NIXL's default)",
    "caller": "no NIXL progress thread (the waiting caller polls)",
}


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
        ``"thread-spinning"`` or ``"caller"``), ``cpu_s`` (CPU seconds each child
        used over its whole life, about 2 s of which is importing NIXL),
        ``cpu_s_per_gb`` (CPU seconds of both children together, every thread, over the
        timed iterations, per GB moved; ``None`` if a child could not be read) and
        ``cpu_s_per_gb_by_process`` (the same for ``"initiator"`` and ``"target"``).

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
    res = run_pair("nixl", w, env, timeout_s)
    tls = env.get("UCX_TLS", "")
    res["version"] = _version("nixl", "nixl-cu12")
    res["env"] = {k: v for k, v in env.items() if k.startswith(("UCX_", "NIXL_", "PDKV_NIXL_"))}
    res["notes"] = (
        f"NIXL {res['version']} Python API, UCX backend "
        f"(UCX_TLS={tls or 'UCX default'}, error mode {ucx_error_mode(env)}), "
        "one prepared WRITE request of all blocks reposted per iteration, completion by "
        "polling check_xfer_state; "
        + _PROGRESS_NOTE[res["progress"]].format(delay=pthr_delay_us(env))
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
    queue = str(min(MC_QUEUE_MAX, max(1024, w.num_blocks)))
    env = dict(os.environ)
    # One batch is num_blocks slices; the default per-peer limits (1024 queued + 1024
    # waiting for admission) reject anything above ~2,000. A value the caller set wins.
    env.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", queue)
    env.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", queue)
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # data listener on loopback only
    res = run_pair("mooncake", w, env, timeout_s)
    res.pop("progress", None)
    res["version"] = _version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
    res["env"] = {k: v for k, v in env.items() if k.startswith("MC_")}
    res["notes"] = (
        f"Mooncake Transfer Engine {res['version']}, TCP protocol, P2PHANDSHAKE metadata, "
        f"batch_transfer_sync_write of all blocks per iteration (per-peer TCP queue limits "
        f"{env['MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER']} + "
        f"{env['MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER']}; batches above {MC_QUEUE_MAX} "
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


_has_rdma_device = _nixl_setup.rdma_device_present


# ---------------------------------------------------------------------------------------
# Child main (runs in `python -m pdkv.lab.transfer.peers`)
# ---------------------------------------------------------------------------------------

_ROLES: dict[str, Callable[[Channel], None]] = {
    "nixl-target": peer_nixl.target,
    "nixl-initiator": peer_nixl.initiator,
    "mooncake-target": peer_mooncake.target,
    "mooncake-initiator": peer_mooncake.initiator,
}


def _child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="pdkv bench peer child (internal)")
    ap.add_argument("--role", required=True, choices=sorted(_ROLES))
    ap.add_argument("--ctl-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    chan = Channel(socket.socket(fileno=args.ctl_fd))
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
