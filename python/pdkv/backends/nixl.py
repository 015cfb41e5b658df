"""The ``nixl`` transport: pdkv transfers carried by NIXL (UCX), for RDMA networks.

Select it with ``pdkv.Agent(name, transports=["nixl", ...])`` or per peer with
``agent.add_peer(md, transport="nixl")``; an Agent created without ``transports`` puts
it first when the host has an RDMA device and NIXL is installed. ``agent.peer_transport
(peer)`` shows the choice. Install NIXL with ``pip install --no-deps nixl-cu12==1.5.1
nixl==1.5.1`` (``nixl-cu12`` declares torch as a dependency: without ``--no-deps`` pip
pulls a multi-GB CUDA build even on CPU-only machines).

It implements pdkv's one transport interface (:class:`pdkv.transport.Transport`, the
C++ ``pdkv::Transport`` through its pybind11 trampoline) and is registered in the same
registry as tcp and shm (``pdkv/backends/__init__.py``). The core keeps layouts,
planning, metadata, routing, bounds checks and the transfer state; this transport gets
resolved byte extents and moves them with one NIXL agent (UCX backend) per pdkv Agent:

* every registered region is registered with NIXL (``DRAM``; ``VRAM`` for CUDA regions);
  the agent's metadata carries NIXL's metadata for the *exported* regions only (under
  ``extras["nixl"]``), re-published whenever regions change;
* ``prepare`` builds the NIXL descriptor lists and a request once; ``post`` reposts a
  pooled request. A transfer's notification goes out (on the same UCX endpoint) once
  NIXL reports the request complete, which it does only after flushing the endpoint:
  the peer gets it after every byte landed, for WRITE and for READ alike (for READ:
  landed here);
* transfers are the core's :class:`pdkv.Transfer`: this transport resolves them (NIXL
  failures become pdkv errors that name the cause) and lets ``wait()`` drive NIXL's
  progress itself; a peer is (re)introduced to NIXL on the first prepare, notify or
  warm-up after ``add_peer``;
* received NIXL notifications go to the agent's queue (``AgentHooks.deliver_notification``),
  so ``wait_notifications``, ``notification_fd`` and ``notifications()`` work unchanged.

Example
-------
>>> import numpy as np, pdkv
>>> from pdkv.backends.nixl import NixlOptions
>>> with pdkv.Agent("p", secret="s", transports=["nixl"], nixl=NixlOptions()) as p, \\
...         pdkv.Agent("d", secret="s", transports=["nixl"]) as d:
...     src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
...     rs, rd = p.register(src), d.register(dst)
...     peer = p.connect(d.address)                    # metadata over tcp, data over NIXL
...     p.peer_transport(peer)
...     p.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post(notify=b"kv").wait(5)
...     [n.data for n in d.wait_notifications(5)]
'nixl'
True
[b'kv']

NIXL and UCX traps (NIXL 1.5.1, measured on a 2-core loopback-only host) and what pdkv does
-------------------------------------------------------------------------------------------
Each default applies only when the caller has not set the variable; ``NixlTransport.info()``
lists the ones applied.

* **Idle progress thread spins a core.** ``nixl_agent`` hard-codes the UCX progress
  thread's ``poll()`` timeout (``pthrDelay``) to 0: one core at 100% while idle (0.999
  CPU-s/s). pdkv builds NIXL's agent config itself with ``pthrDelay`` = 10 ms
  (:attr:`NixlOptions.pthr_delay_us`): the thread sleeps in ``poll()`` until UCX has
  work; throughput is unchanged.
* **``UCX_TLS=shm`` fails** unless the UCX backend uses error handling mode ``"none"``
  (shared-memory transports cannot detect a dead peer; under NIXL's default ``"peer"``
  the backend is not created). pdkv picks ``"none"`` exactly when ``UCX_TLS`` names only
  same-host transports; then a dead peer cannot be detected, only timed out.
* **Segfault at exit** of every NIXL process when Debian's ``libibverbs1`` is installed
  and there is no RDMA device (UCX's ib module crashes in teardown): pdkv sets
  ``UCX_MODULES=^ib`` in the process environment before NIXL loads UCX.
* **UCX over TCP uses every interface.** When the agent listens on a loopback address
  (every peer it can meet is on this host) pdkv restricts UCX to ``lo``; otherwise UCX
  keeps all devices, as multi-host deployments need. Set ``UCX_NET_DEVICES`` to choose.
* **UCX's own choice on one host is cma** (``process_vm_writev``), a path that exists
  only between processes of one host. Without an RDMA device (and without a GPU) pdkv
  uses ``UCX_TLS=tcp``, the path peers on other hosts get (pdkv's own ``shm`` transport
  is the fast same-host path). With an RDMA device (or a GPU) UCX chooses. These two
  settings go through the backend's ``engine_config``, per agent, not the environment.
* **``import nixl`` imports torch** (2.1 s instead of 0.3 s, plus its memory) when a
  CPU-only torch is installed; pdkv imports the one installed backend wheel
  (``nixl_cu12``) directly.
* **NIXL's Python wrapper logs INFO lines to stdout**, corrupting programs that speak a
  protocol there; pdkv uses NIXL's bindings (what the wrapper calls), whose C++ logger
  writes to stderr.
* **A notification attached to a NIXL request is sent only when the initiator checks
  the finished request** (NIXL's UCX backend sends it from ``getXferStatus``), and while
  it is on its way the request still reads "in progress": cancelling or timing out then
  reports a failure for a transfer whose peer was told the data is there. And
  **reposting a request without a notification re-sends the previous one.** pdkv
  attaches none: it sends the notification itself right after it saw the request
  complete (data flushed), under the same lock that decides the transfer's state, so a
  transfer is either DONE and notified or failed and silent. Its poller checks transfers
  nobody waits on, so ``write(..., notify=...)`` without ``wait()`` delivers.
* **One-sided writes are not checked against deregistration over UCX's TCP/shm
  emulation** (measured: a write through the old key lands in memory the target has
  deregistered; with RDMA the NIC refuses the invalidated key). pdkv revokes access
  first: a deregistering agent tells every peer that holds its metadata, waits for
  their in-flight transfers touching the region, and only then deregisters; later
  posts into that region fail with NotFound until the peer's metadata is re-added.
* **Prepared descriptor lists point into NIXL's registration records**: posting one
  after its memory was deregistered reads freed memory. pdkv drops prepared requests
  when their regions go away (posting them raises NotFound), and re-prepares
  transparently when a peer's metadata is re-added (StalePeer if it restarted).
* **Loading a peer's metadata again only adds to it**: regions the peer dropped stay
  known, and a region at the same address keeps the *old* key. When a re-added peer only
  gained or lost regions, pdkv loads the new metadata on top (connections, prepared
  requests and in-flight transfers stay); when a new region overlaps a dropped one it
  reconnects from scratch, failing that peer's in-flight transfers with
  PeerConnectionError.
* **NIXL has no wake-up for notifications**: pdkv polls in a thread that backs off from
  :attr:`NixlOptions.poll_min_s` to :attr:`~NixlOptions.poll_idle_max_s` (10 ms) when
  idle: a notification after a quiet spell waits up to 10 ms, and an idle agent costs
  about 0.7% of one core here (measured per thread: poller 0.5%, NIXL's progress thread
  0.2%; a timed wake-up costs ~50 us of CPU on this VM). Raise ``poll_idle_max_s`` to
  trade notification delay for less idle CPU.
* **Neither NIXL nor UCX authenticates peers**: anyone who can reach the UCX endpoint
  can issue RMA to registered memory (over UCX's TCP emulation, to any address). pdkv's
  secret guards only the metadata and the handshake. Use the nixl transport on trusted
  networks.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import hmac
import itertools
import json
import logging
import os
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import (
    Cancelled,
    InvalidArgument,
    NotFound,
    PdkvError,
    PeerConnectionError,
    ProtocolError,
    StalePeer,
    TransferTimeout,
)
from .. import _native, transport as _transport
from ..transport import Transport
from ..xfer_state import XferState
from ._nixl import PTHR_DELAY_US, NixlEngine, UcxSetup, is_loopback_host, to_pdkv, ucx_setup

__all__ = ["NixlOptions", "NixlTransport", "nixl_agent_name"]


@dataclass(frozen=True)
class NixlOptions:
    """Tuning of the nixl transport (``pdkv.Agent(..., nixl=NixlOptions(...))``).

    Attributes
    ----------
    pthr_delay_us : int
        NIXL's UCX progress thread wakes at least this often (microseconds, rounded up
        to ms). 0 is NIXL's busy-polling default; negative runs without a progress
        thread (the poller and waiters then progress UCX).
    poll_min_s, poll_busy_max_s, poll_idle_max_s : float
        The notification/completion poller sleeps ``poll_min_s`` after activity and
        doubles that while nothing happens, up to ``poll_busy_max_s`` while transfers
        are in flight and ``poll_idle_max_s`` when idle (the worst-case delay of a
        notification after a quiet spell, and the idle CPU cost).
    wait_spin_s : float
        ``Transfer.wait`` checks continuously this long before sleeping between checks.
    handshake_timeout_s : float
        ``add_peer`` waits this long for the peer's NIXL handshake answer.
    revoke_timeout_s : float
        Deregistering an exported region waits this long for each peer holding this
        agent's metadata to confirm it stopped using it (a peer that does not answer is
        forgotten).
    max_idle_requests : int
        Completed NIXL requests kept for reuse per prepared transfer.
    restart_probe_s : float
        When a peer's NIXL endpoint fails, its tcp endpoint is asked (this long at most)
        whether it restarted: the transfer then fails with StalePeer instead of
        PeerConnectionError (docs/faults.md).
    """

    pthr_delay_us: int = PTHR_DELAY_US
    poll_min_s: float = 100e-6
    poll_busy_max_s: float = 1e-3
    poll_idle_max_s: float = 10e-3
    wait_spin_s: float = 200e-6
    handshake_timeout_s: float = 5.0
    revoke_timeout_s: float = 5.0
    max_idle_requests: int = 4
    restart_probe_s: float = 1.0


def nixl_agent_name(name: str, instance_id: int) -> str:
    """The NIXL agent name of a pdkv agent: unique per agent *instance*, so a restarted
    peer (same pdkv name) never collides with its predecessor inside NIXL."""
    return f"{name}#{instance_id:016x}"


def _pdkv_name(nixl_name: str) -> str:
    return nixl_name.rpartition("#")[0] or nixl_name  # pdkv names never contain spaces; '#' may


# ---------------------------------------------------------------------------- metadata
_MAGIC = b"PDKVNIXL"
_VERSION = 1


def _encode_extra(nixl_name: str, mds: Sequence[bytes]) -> bytes:
    """``extras["nixl"]``: magic, version, NIXL agent name, NIXL metadata blobs, sha256."""
    name = nixl_name.encode()
    out = [_MAGIC, struct.pack("<HH", _VERSION, len(name)), name, struct.pack("<H", len(mds))]
    for md in mds:
        out += [struct.pack("<I", len(md)), md]
    body = b"".join(out)
    return body + hashlib.sha256(body).digest()


def _decode_extra(blob: bytes) -> tuple[str, list[bytes]]:
    """Inverse of :func:`_encode_extra`; raises ProtocolError on anything malformed
    (NIXL's own deserializer never sees bytes that fail the checksum)."""
    if len(blob) < len(_MAGIC) + 6 + 32 or not blob.startswith(_MAGIC):
        raise ProtocolError("nixl metadata extra: bad magic or truncated")
    body, digest = blob[:-32], blob[-32:]
    if not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
        raise ProtocolError("nixl metadata extra: checksum mismatch (corrupted metadata)")
    version, nlen = struct.unpack_from("<HH", body, len(_MAGIC))
    if version != _VERSION:
        from ..errors import VersionMismatch

        raise VersionMismatch(f"nixl metadata extra version {version} (this pdkv speaks {_VERSION})")
    pos = len(_MAGIC) + 4
    try:
        name = body[pos:pos + nlen].decode()
        pos += nlen
        (count,) = struct.unpack_from("<H", body, pos)
        pos += 2
        mds = []
        for _ in range(count):
            (n,) = struct.unpack_from("<I", body, pos)
            pos += 4
            if pos + n > len(body):
                raise ProtocolError("nixl metadata extra: length past the end")
            mds.append(body[pos:pos + n])
            pos += n
    except (struct.error, UnicodeDecodeError) as e:
        raise ProtocolError(f"nixl metadata extra: {e}") from None
    if pos != len(body) or not name:
        raise ProtocolError("nixl metadata extra: trailing bytes or empty name")
    return name, mds


# Every NIXL notification between pdkv agents starts with a tag byte: user data, or a
# control message of the transport's own protocol (JSON; control path only).
log = logging.getLogger("pdkv.nixl")

_USER = b"U"
_CTL = b"C"


def _ctl(**msg: Any) -> bytes:
    return _CTL + json.dumps(msg, separators=(",", ":")).encode()


# Limits on control messages from a peer (NIXL notifications starting with _CTL),
# checked before they are parsed; docs/wire.md "nixl control messages".
_MAX_CTL_BYTES = 64 << 10            # every kind but hello
_MAX_HELLO_BYTES = 64 << 20          # hello carries the peer's NIXL metadata (base64)
_MAX_REVOKE_REGIONS = 4096
_MAX_CTL_TEXT = 4096                 # hello-ack error, mac
_U63 = (1 << 63) - 1
# kind -> {field: type}; every field is required, no other field is accepted.
_CTL_SCHEMA: dict[str, dict[str, type]] = {
    "hello": {"epoch": int, "md": str, "mac": str},
    "hello-ack": {"epoch": int, "error": str},
    "bye": {"epoch": int},
    "revoke": {"regions": list, "seq": int},
    "revoke-ack": {"seq": int},
}


def _parse_ctl(raw: bytes) -> dict[str, Any]:
    """Decodes and validates one control message (without its _CTL prefix).

    Raises ProtocolError naming the problem: over its size limit (checked before
    parsing), not JSON, not an object, unknown kind, a missing, extra or mistyped
    field, an integer outside [0, 2**63), a string over its limit, a revoke naming
    too many regions.
    """
    limit = _MAX_HELLO_BYTES if raw.startswith(b'{"k":"hello",') else _MAX_CTL_BYTES
    if len(raw) > limit:
        raise ProtocolError(f"nixl control message of {len(raw)} bytes (limit {limit})")
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested input
        raise ProtocolError(f"nixl control message is not JSON: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("nixl control message is not an object")
    kind = msg.get("k")
    schema = _CTL_SCHEMA.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"nixl control message of unknown kind {str(kind)[:32]!r}")
    if set(msg) != {"k", *schema}:
        raise ProtocolError(f"nixl {kind} message has fields {sorted(msg)[:8]}, expected {['k', *sorted(schema)]}")
    for field, typ in schema.items():
        v = msg[field]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ProtocolError(f"nixl {kind} message: {field} is not {typ.__name__}")
        if typ is int and not 0 <= v <= _U63:
            raise ProtocolError(f"nixl {kind} message: {field} out of range")
        if typ is str and field != "md" and len(v) > _MAX_CTL_TEXT:
            raise ProtocolError(f"nixl {kind} message: {field} longer than {_MAX_CTL_TEXT}")
    if kind == "revoke":
        ids = msg["regions"]
        if not 0 < len(ids) <= _MAX_REVOKE_REGIONS:
            raise ProtocolError(f"nixl revoke names {len(ids)} regions (1 to {_MAX_REVOKE_REGIONS})")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _U63 for i in ids):
            raise ProtocolError("nixl revoke: region ids must be integers in [0, 2**63)")
    return msg


def _hello_mac(secret: bytes, sender: str, target: str, epoch: int, md: bytes) -> str:
    data = b"pdkv-nixl-hello\0%s\0%s\0%d\0" % (sender.encode(), target.encode(), epoch) + md
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------- state
class _Region:
    __slots__ = ("id", "addr", "end", "kind", "device", "exported", "dlist")

    def __init__(self, region: dict, dlist: Any) -> None:
        self.id = int(region["id"])
        self.addr = int(region["addr"])
        self.end = self.addr + int(region["len"])
        self.kind = region["kind"]
        self.device = max(0, int(region["device"]))
        self.exported = bool(region["remote_access"])
        self.dlist = dlist


_KINDS = ("host", "cuda")


class _RegionIndex:
    """Sorted (addr, end, id, kind, device) table; maps extents to their regions."""

    def __init__(self, rows: Sequence[tuple[int, int, int, str, int]]) -> None:
        rows = sorted(rows)
        self.starts = np.array([r[0] for r in rows], dtype=np.uint64)
        self.ends = np.array([r[1] for r in rows], dtype=np.uint64)
        self.ids = np.array([r[2] for r in rows], dtype=np.int64)
        self.kinds = np.array([_KINDS.index(r[3]) for r in rows], dtype=np.int64)  # codes into _KINDS
        self.devices = np.array([r[4] for r in rows], dtype=np.uint64)

    def lookup(self, addrs: np.ndarray, lens: np.ndarray, side: str) -> np.ndarray:
        """Row index of the region holding each ``[addr, addr + len)``; raises NotFound."""
        if not len(self.starts):
            raise NotFound(f"no {side} region is registered with the nixl transport")
        i = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        bad = (i < 0) | (addrs + lens > self.ends[np.maximum(i, 0)])
        if bad.any():
            k = int(np.argmax(bad))
            raise NotFound(f"{side} bytes [0x{int(addrs[k]):x}, +{int(lens[k])}) are not in a region "
                           "registered with the nixl transport (region not registered)")
        return i


class _Peer:
    """One peer as this transport knows it (replaced, never mutated, on re-add)."""

    def __init__(self, name: str, md: dict, nixl_name: str, extra: bytes, secret: bytes) -> None:
        self.name = name
        self.instance = int(md["instance_id"])
        self.nixl_name = nixl_name
        self.update(md, extra, secret)
        self.error: PdkvError | None = None  # set: transfers to this peer raise it
        self.is_self = False
        self.loaded = False  # its NIXL metadata is loaded
        self.epoch = 0  # of the handshake that made the peer hold our metadata
        self.hello_ok = False
        self.revoked: set[int] = set()
        self.dropped = False
        self.core: Any = None  # the core's Peer this state was made or updated for

    def update(self, md: dict, extra: bytes, secret: bytes) -> None:
        self.extra = extra
        self.secret = secret
        # Where to ask whether it restarted when its NIXL endpoint fails (see _probe_restart).
        self.tcp_address = next((a for t, a in md.get("endpoints", []) if t == "tcp"), None)
        self.rows = [(int(r["addr"]), int(r["addr"]) + int(r["len"]), int(r["id"]), r.get("kind", "host"),
                      max(0, int(r.get("device", -1)))) for r in md.get("regions", [])]
        self.index = _RegionIndex(self.rows)
        self.region_ids = {row[2] for row in self.rows}

    def reuses_freed_range(self, md: dict) -> bool:
        """Whether ``md`` (same instance) has a region overlapping one this peer dropped:
        NIXL would keep the dropped region's key for it (reloading only adds entries)."""
        new = [(int(r["addr"]), int(r["addr"]) + int(r["len"]), int(r["id"])) for r in md.get("regions", [])]
        ids = {n[2] for n in new}
        gone = [row for row in self.rows if row[2] not in ids]
        return any(a < ge and ga < e for a, e, _ in new for ga, ge, *_ in gone)


class _Group:
    """The extents of a prepared transfer that share a (local, remote) memory kind: one
    pair of NIXL descriptor lists and a pool of NIXL requests built from them."""

    __slots__ = ("lkind", "rkind", "ldesc", "rdesc", "nbytes", "ldl", "rdl", "idle", "busy")

    def __init__(self, lkind: str, rkind: str, ldesc: np.ndarray, rdesc: np.ndarray) -> None:
        self.lkind, self.rkind = lkind, rkind
        self.ldesc, self.rdesc = ldesc, rdesc
        self.nbytes = int(ldesc[:, 1].sum())
        self.ldl: int | None = None
        self.rdl: int | None = None
        self.idle: list[int] = []  # completed requests, ready to repost (never given a notification)
        self.busy = 0


_S: dict[str, XferState] = {m.name: m for m in XferState}


class NixlTransfer:
    """This transport's record of one posted transfer (or standalone notification):
    the NIXL requests it waits on and the core's transfer it resolves when it ends."""

    def __init__(self, owner: "NixlTransport", xid: int, peer: "_Peer", op: str, nbytes: int,
                 notify: bytes | None, native: Any, prep: "NixlPrepared | None") -> None:
        self._owner = owner
        self.id = xid
        self._peer_state = peer
        self.peer = peer.name
        self._op = op
        self.bytes_total = nbytes
        self._notify = notify
        self._native = native  # pdkv._pdkv.Transfer (its parts declared), or None
        left = native.remaining_s if native is not None else float("inf")
        self._deadline = time.monotonic() + max(left, 0.0) if left != float("inf") else 0.0
        self._prep = prep
        self._local_ids: frozenset = prep._local_ids if prep is not None else frozenset()
        self._remote_ids: frozenset = prep._remote_ids if prep is not None else frozenset()
        self._reqs: list[tuple[_Group, int]] = []
        self._pending: list[int] = []
        self._manual_notify = False  # a notification to send once every request completed
        self._probing = False  # failed at the connection level; finished once the restart probe answers
        self._waiting = 0  # threads in wait(): they check it, so the poller need not hurry
        self._state = _S["PENDING"]
        self._error: PdkvError | None = None
        self._t_post = time.monotonic()
        self._event: threading.Event | None = None  # made by the first waiter that sleeps

    def drive(self, timeout: float) -> None:
        """The core transfer's driver: ``wait()`` progresses NIXL itself (checking
        continuously for ``wait_spin_s``, then sleeping between checks, woken at once
        when the poller sees completion) instead of waiting for the poller."""
        owner = self._owner
        if owner._check(self) is not _S["PENDING"]:
            return
        with owner._lock:
            self._waiting += 1
        try:
            self._wait_loop(timeout)
        finally:
            with owner._lock:
                self._waiting -= 1

    def _wait_loop(self, timeout: float) -> XferState:
        owner = self._owner
        opts = owner._opts
        pending = st = _S["PENDING"]
        now = time.monotonic()
        end = None if timeout == float("inf") else now + max(0.0, float(timeout))
        spin_end = now + opts.wait_spin_s
        pause = opts.poll_min_s
        while True:
            now = time.monotonic()
            if end is not None and now >= end:
                return st
            if now >= spin_end:
                ev = self._event
                if ev is None:
                    with owner._lock:  # _finish sets it under the same lock: no lost wake-up
                        if self._state is not pending:
                            return self._state
                        ev = self._event = self._event or threading.Event()
                ev.wait(pause if end is None else min(pause, end - now))
                pause = min(pause * 2, opts.poll_busy_max_s)
            st = owner._check(self)
            if st is not pending:
                return st


class NixlPrepared:
    """What prepare() returns to the core: a nixl transfer laid out once (descriptor
    lists and a NIXL request built), posted many times."""

    def __init__(self, owner: "NixlTransport", peer: "_Peer", op: str, ldesc: np.ndarray, rdesc: np.ndarray,
                 kinds: np.ndarray, local_ids: frozenset, remote_ids: frozenset) -> None:
        self._owner = owner
        self._peer = peer
        self.peer = peer.name
        self._op = op
        self._ldesc, self._rdesc = ldesc, rdesc
        self._kinds = kinds  # [n] local kind code * len(_KINDS) + remote kind code
        self._local_ids, self._remote_ids = local_ids, remote_ids
        self.nbytes = int(ldesc[:, 1].sum())
        self.num_extents = len(ldesc)
        self._groups: list[_Group] | None = None
        self._invalid: PdkvError | None = None  # raised by post (the caller must prepare again)

    def __del__(self) -> None:
        groups, self._groups = self._groups, None
        if groups:
            # No locks in a finalizer: the owner releases these on its next pass.
            self._owner._graveyard.append(groups)

    def __repr__(self) -> str:
        return (f"NixlPrepared(peer={self.peer!r}, {self._op}, {self.nbytes} bytes in "
                f"{self.num_extents} extents)")


# ---------------------------------------------------------------------------- transport
_LIVE: "weakref.WeakSet[NixlTransport]" = weakref.WeakSet()
_ATEXIT = []


def _close_live() -> None:
    # Before interpreter teardown: NIXL's threads must stop while Python still runs.
    for t in list(_LIVE):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


_BY_INSTANCE: "weakref.WeakValueDictionary[int, NixlTransport]" = weakref.WeakValueDictionary()


class NixlTransport(Transport):
    """The nixl transport of one :class:`pdkv.Agent` (created through the registry; see
    the module docstring). Thread-safe: one lock guards its state, NIXL runs in STRICT
    sync mode, and a poller thread delivers notifications and completes unwaited
    transfers.
    """

    name = "nixl"

    def __init__(self, options: NixlOptions | None = None) -> None:
        if options is not None and not isinstance(options, NixlOptions):
            raise InvalidArgument(f"nixl options must be NixlOptions, got {type(options).__name__}")
        self._opts = options or NixlOptions()
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._eng: NixlEngine | None = None
        self._closed = False
        self._regions: dict[int, _Region] = {}
        self._index = _RegionIndex([])
        self._peers: dict[str, _Peer] = {}
        self._by_nixl: dict[str, _Peer] = {}
        self._watchers: dict[str, tuple[int, bytes]] = {}  # NIXL name -> (epoch, conn md)
        self._preps: "weakref.WeakSet[NixlPrepared]" = weakref.WeakSet()
        self._inflight: dict[int, NixlTransfer] = {}
        self._acks: dict[int, set[str]] = {}
        self._hello_acks: dict[int, str] = {}
        self._deferred_acks: list[tuple[str, int, _Peer, frozenset]] = []
        self._graveyard: list[list[_Group]] = []
        self._zombies: list[int] = []
        self._ids = itertools.count(1)
        self._md_cache: bytes | None = None
        self._poll_interval = 0.0
        self._thread: threading.Thread | None = None
        self._refused = 0                 # malformed messages dropped since the last log line
        self._refused_logged_at = -1e9
        self._probes: list[threading.Thread] = []  # restart probes (joined by shutdown)
        self._hooks: Any = None

    @staticmethod
    def of(agent: Any) -> "NixlTransport":
        """The nixl transport of a :class:`pdkv.Agent` (for :meth:`info` and tests)."""
        t = _BY_INSTANCE.get(agent.instance_id)
        if t is None:
            raise NotFound(f"agent {agent.name!r} has no nixl transport")
        return t

    def caps(self) -> Any:
        kinds = (1 << _transport.HOST) | (1 << _transport.CUDA)
        # One-sided RDMA: no hook at the target before bytes land (no generation checks).
        return _native.module().TransportCaps(local_mem_kinds=kinds, remote_mem_kinds=kinds, generations=False)

    # -------------------------------------------------------------- lifecycle
    def start(self, hooks: Any) -> None:
        self._hooks = hooks
        self._agent_name = hooks.agent_name
        self._secret = bytes(hooks.secret)
        self._max_notif = int(hooks.max_notif_bytes)
        self._nixl_name = nixl_agent_name(hooks.agent_name, hooks.instance_id)
        host = _transport.listen_host() or "127.0.0.1"
        self._setup: UcxSetup = ucx_setup(os.environ, loopback=is_loopback_host(host))
        for k, v in self._setup.env.items():
            os.environ.setdefault(k, v)  # before NIXL loads UCX (process-wide)
        self._eng = NixlEngine(self._nixl_name, self._setup.backend_params, pthr_delay_us=self._opts.pthr_delay_us)
        self._conn_md = self._eng.partial_md(self._eng.reg_dlist("host", []))
        _LIVE.add(self)
        _BY_INSTANCE[hooks.instance_id] = self
        if not _ATEXIT:
            _ATEXIT.append(atexit.register(_close_live))
        self._thread = threading.Thread(target=_poll_loop, args=(weakref.ref(self), self._wake),
                                        name=f"pdkv-nixl-{hooks.agent_name}", daemon=True)
        self._thread.start()

    def info(self) -> dict:
        """How this transport runs: NIXL agent name, UCX defaults applied, options."""
        return {"nixl_name": self._nixl_name, "ucx_tls": self._setup.tls or "UCX's choice",
                "ucx_error_mode": self._setup.backend_params["ucx_error_handling_mode"],
                "backend_params": dict(self._setup.backend_params), "env_defaults": dict(self._setup.env),
                "applied": list(self._setup.applied), "pthr_delay_us": self._opts.pthr_delay_us,
                "options": self._opts}

    def shutdown(self) -> None:
        """Fails everything in flight, stops the poller and destroys the NIXL agent."""
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        th = self._thread
        if th is not None and th is not threading.current_thread():
            th.join(5.0)
        for probe in list(self._probes):  # they use the agent's hooks: done before it goes
            probe.join(self._opts.restart_probe_s + 1.0)
        with self._lock:
            eng = self._eng
            for x in list(self._inflight.values()):
                self._finish(x, _states()["CANCELLED"], Cancelled(
                    f"agent {self._agent_name!r} closed while the transfer to {x.peer!r} was in flight"))
            for p in list(self._peers.values()):
                # No goodbye: destroying the NIXL agent closes its UCX endpoints, which
                # peers notice (a notification to a peer already gone only logs errors).
                self._drop_peer(p, None, bye=False)
            self._peers.clear()
            for prep in list(self._preps):
                self._detach(prep)
            self._collect_garbage()
            if eng is not None:
                for n in list(self._watchers):
                    eng.forget(n)
                for r in self._regions.values():
                    try:
                        eng.deregister(r.dlist)
                    except PdkvError:
                        pass
            self._watchers.clear()
            self._regions.clear()
            self._eng = None
        _LIVE.discard(self)
        self._hooks = None
        if eng is not None:
            eng.close()

    def _engine(self) -> NixlEngine:
        if self._closed or self._eng is None:
            raise InvalidArgument(f"the nixl transport of agent {self._agent_name!r} is closed")
        return self._eng

    # -------------------------------------------------------------- memory
    def region_added(self, region: dict) -> None:
        eng = self._engine()
        kind = region["kind"]
        dlist = eng.reg_dlist(kind, [(int(region["addr"]), int(region["len"]), max(0, int(region["device"])))])
        eng.register(dlist)
        with self._lock:
            self._regions[int(region["id"])] = _Region(region, dlist)
            self._reindex()

    def region_removed(self, region: dict) -> None:
        rid = int(region["id"])
        with self._lock:
            r = self._regions.get(rid)
            if r is None or self._closed:
                return
            if r.exported and self._watchers:
                self._revoke(rid)
            # In-flight transfers that use the region (as source/destination here, or as
            # the "remote" side of transfers to ourselves) finish first.
            self._kick()
            while True:
                busy = [x for x in self._inflight.values()
                        if rid in x._local_ids or (x._peer_state.is_self and rid in x._remote_ids)]
                if not busy:
                    break
                now = time.monotonic()
                for x in busy:
                    self._progress(x, now)
                if any(x._state is _S["PENDING"] for x in busy):
                    self._cond.wait(self._opts.poll_busy_max_s)
            gone = NotFound(f"region {rid} is not registered any more (deregistered); prepare the transfer again")
            for prep in list(self._preps):
                if rid in prep._local_ids or (prep._peer.is_self and rid in prep._remote_ids):
                    prep._invalid = gone
                    self._detach(prep)
            del self._regions[rid]
            self._reindex()
            eng = self._eng
        if eng is not None:
            eng.deregister(r.dlist)

    def _reindex(self) -> None:
        self._index = _RegionIndex([(r.addr, r.end, r.id, r.kind, r.device) for r in self._regions.values()])
        self._md_cache = None

    def metadata_extra(self) -> bytes:
        with self._lock:
            if self._md_cache is None:
                eng = self._engine()
                mds = []
                for kind in ("host", "cuda"):
                    rows = [(r.addr, r.end - r.addr, r.device) for r in self._regions.values()
                            if r.exported and r.kind == kind]
                    if rows:
                        mds.append(eng.partial_md(eng.reg_dlist(kind, rows)))
                self._md_cache = _encode_extra(self._nixl_name, mds or [self._conn_md])
            return self._md_cache

    # -------------------------------------------------------------- peers
    def can_reach(self, peer_md: Any) -> bool:
        """Whether the peer publishes a well-formed nixl extra (``peer_md``: the core's
        AgentMetadata, or a dict as :func:`pdkv.decode_metadata` returns)."""
        if isinstance(peer_md, dict):
            blob = peer_md.get("extras", {}).get(self.name)
        else:
            blob = peer_md.extra(self.name)
        if not blob:
            return False
        try:
            _decode_extra(blob)
        except PdkvError:
            return False
        return True

    def connect(self, peer: Any, timeout_s: float) -> None:
        with self._lock:
            self._engine()
            self._ensure_peer(peer)

    def _ensure_peer(self, peer: Any) -> "_Peer":
        """The state of the core's ``peer`` (lock held). The core makes a new Peer on
        every add_peer: the first time this transport sees one, it (re)introduces the
        peer to NIXL, keeping connections when its metadata did not change."""
        p = self._peers.get(peer.name)
        if p is None or p.core is not peer:
            md = {"name": peer.md.name, "instance_id": peer.md.instance_id, "endpoints": peer.md.endpoints,
                  "regions": peer.md.regions}
            self._add_peer(peer.name, md, peer.md.extra(self.name) or b"", bytes(peer.secret))
            p = self._peers[peer.name]
            p.core = peer  # (held: pybind11 then hands out this same object for it)
        return p

    def _add_peer(self, name: str, peer_md: dict, blob: bytes, secret: bytes) -> None:
        """Loads the peer's NIXL metadata and introduces this agent to it (a handshake
        that lets the peer revoke access when it deregisters memory). Connection
        failures do not raise here: transfers to the peer fail with them."""
        nixl_name, mds = _decode_extra(blob)  # ProtocolError if missing or corrupted
        with self._lock:
            eng = self._engine()
            old = self._peers.get(name)
            if (old is not None and old.error is None and old.nixl_name == nixl_name
                    and old.instance == int(peer_md["instance_id"]) and (old.loaded or old.is_self)):
                if old.extra == blob:
                    old.secret = secret
                    return  # unchanged: keep connections, prepared requests and transfers
                if not old.reuses_freed_range(peer_md) and self._load_more(old, peer_md, mds, blob, secret):
                    return  # regions added or removed: NIXL learned the new ones in place
            if old is not None:  # (no goodbye: a replaced instance is usually gone)
                self._drop_peer(old, PeerConnectionError(
                    f"peer {name!r} was re-added with new metadata while this transfer was in flight"), bye=False)
            p = _Peer(name, peer_md, nixl_name, blob, secret)
            self._peers[name] = p
            expected = nixl_agent_name(str(peer_md["name"]), int(peer_md["instance_id"]))
            if nixl_name != expected:
                p.error = StalePeer(
                    f"peer {name!r} restarted or its metadata is inconsistent: it names instance "
                    f"{int(peer_md['instance_id']):016x} but its NIXL endpoint belongs to {nixl_name!r}; "
                    "fetch its metadata again and re-add it")
                return
            if nixl_name == self._nixl_name:
                p.is_self = True
                return
            try:
                for md in mds:
                    got = eng.load_md(md)
                    if got != nixl_name:
                        eng.forget(got)
                        raise ProtocolError(f"NIXL metadata of peer {name!r} names agent {got!r}, "
                                            f"expected {nixl_name!r}")
                    p.loaded = True
            except PdkvError as e:
                p.error = PeerConnectionError(f"cannot connect to peer {name!r} through NIXL: {e}")
                if p.loaded:
                    eng.forget(nixl_name)
                    p.loaded = False
                return
            self._by_nixl[nixl_name] = p
            p.epoch = next(self._ids)
            mac = _hello_mac(secret, self._nixl_name, nixl_name, p.epoch, self._conn_md)
            try:
                eng.notify(nixl_name, _ctl(k="hello", epoch=p.epoch, md=base64.b64encode(self._conn_md).decode(),
                                           mac=mac))
            except PdkvError as e:
                p.error = PeerConnectionError(f"cannot reach peer {name!r} through NIXL: {e}")
                return
            self._hello_acks[p.epoch] = ""
            self._kick()
            deadline = time.monotonic() + self._opts.handshake_timeout_s
            while self._hello_acks.get(p.epoch) == "" and time.monotonic() < deadline and not p.dropped:
                self._cond.wait(min(self._opts.poll_busy_max_s * 10, max(0.0, deadline - time.monotonic())))
            answer = self._hello_acks.pop(p.epoch, "")
            if p.dropped:
                return
            if answer == "ok":
                p.hello_ok = True
            elif not answer:
                p.error = PeerConnectionError(
                    f"peer {name!r} did not answer the NIXL handshake within {self._opts.handshake_timeout_s:g} s "
                    "(unreachable over UCX, stopped, or not using the secret given to add_peer)")
            else:
                p.error = PeerConnectionError(f"peer {name!r} refused the NIXL handshake: {answer}")

    def _load_more(self, p: _Peer, md: dict, mds: list[bytes], blob: bytes, secret: bytes) -> bool:
        """Updates a known peer in place (lock held): loads its new NIXL metadata on top of
        the old (NIXL only adds regions), and fails prepared transfers into regions it
        dropped. In-flight transfers and connections stay. False if NIXL refused."""
        if not p.is_self:
            try:
                for m in mds:
                    self._engine().load_md(m)
            except PdkvError:
                return False
        before = set(p.region_ids)
        p.update(md, blob, secret)
        gone = frozenset(before - p.region_ids)
        if gone:
            p.revoked |= gone
            err = NotFound(f"peer {p.name!r} no longer exports region {min(gone)}; prepare the transfer again")
            for prep in list(self._preps):
                if prep._peer is p and prep._remote_ids & gone:
                    prep._invalid = err
                    self._detach(prep)
        return True

    def drop_peer(self, name: str) -> None:
        with self._lock:
            p = self._peers.pop(name, None)
            if p is not None:
                self._drop_peer(p, PeerConnectionError(f"peer {name!r} was removed while the transfer was in flight"),
                                bye=True)

    def _drop_peer(self, p: _Peer, err: PdkvError | None, *, bye: bool) -> None:
        """Fails ``p``'s in-flight transfers, releases its prepared requests and forgets
        its NIXL metadata (in that order: requests point into the metadata)."""
        p.dropped = True
        self._cond.notify_all()
        if self._peers.get(p.name) is p:
            del self._peers[p.name]
        if self._by_nixl.get(p.nixl_name) is p:
            del self._by_nixl[p.nixl_name]
        for x in list(self._inflight.values()):
            if x._peer_state is p:
                self._finish(x, _states()["FAILED"], err or Cancelled("the transfer's peer was dropped"))
        for prep in list(self._preps):
            if prep._peer is p:
                self._detach(prep)
        eng = self._eng
        if eng is None or not p.loaded:
            return
        if bye and p.hello_ok:
            try:
                eng.notify(p.nixl_name, _ctl(k="bye", epoch=p.epoch))
            except PdkvError:
                pass
        eng.forget(p.nixl_name)
        p.loaded = False
        w = self._watchers.get(p.nixl_name)
        if w is not None and not self._closed:  # it still holds our metadata: keep a way to reach it
            try:
                eng.load_md(w[1])
            except PdkvError:
                del self._watchers[p.nixl_name]

    # -------------------------------------------------------------- transfers
    def _known_peer(self, peer: str) -> _Peer:
        """The peer's state (caller holds the lock); NotFound if the caller never added it.
        A broken peer is returned as it is: its faults surface from transfers' wait()."""
        p = self._peers.get(peer)
        if p is None:
            raise NotFound(f"peer {peer!r} is not known to the nixl transport of agent {self._agent_name!r}")
        return p

    def _failed(self, p: _Peer, op: str, nbytes: int, err: PdkvError, native: Any) -> None:
        """Fails a transfer before it started (lock held): the fault contract
        (docs/faults.md) has peer faults raise from wait(), never from post()."""
        x = NixlTransfer(self, next(self._ids), p, op, nbytes, None, native, None)
        self._finish(x, _S["FAILED"], type(err)(str(err)))

    def prepare(self, peer: Any, op: Any, extents: np.ndarray) -> NixlPrepared:
        """``extents``: the core's resolved ``[n, 7]`` rows (pdkv.transport.EXTENT_COLUMNS)."""
        rows = np.empty((len(extents), 3), dtype=np.uint64)  # (local_addr, remote_addr, nbytes)
        rows[:, 0], rows[:, 1], rows[:, 2] = extents[:, 0], extents[:, 6], extents[:, 1]
        opname = "write" if op == _native.module().OpKind.WRITE else "read"
        with self._lock:
            self._engine()
            self._ensure_peer(peer)
        return self._prepare_rows(peer.name, opname, rows)

    def _prepare_rows(self, peer: str, op: str, extents: Any) -> NixlPrepared:
        """Lays out absolute ``(local_addr, remote_addr, nbytes)`` rows to a peer this
        transport knows (checked against the regions registered with NIXL)."""
        ext = np.asarray(extents, dtype=np.uint64).reshape(-1, 3)
        if not len(ext):
            raise InvalidArgument("no extents to transfer")
        with self._lock:
            self._engine()
            p = self._known_peer(peer)
            prep = self._build(p, op, ext)
            self._preps.add(prep)
            return prep

    def _build(self, p: _Peer, op: str, ext: np.ndarray) -> NixlPrepared:
        ext = _coalesce(ext)
        laddr, raddr, lens = ext[:, 0], ext[:, 1], ext[:, 2]
        li = self._index.lookup(laddr, lens, "local")
        rindex = self._index if p.is_self else p.index
        ri = rindex.lookup(raddr, lens, f"peer {p.name!r}")
        local_ids = frozenset(int(i) for i in np.unique(self._index.ids[li]))
        remote_ids = frozenset(int(i) for i in np.unique(rindex.ids[ri]))
        if p.is_self:
            exported = {r.id for r in self._regions.values() if r.exported}
            if not remote_ids <= exported:
                raise NotFound(f"region {min(remote_ids - exported)} is not exported to peers")
        revoked = remote_ids & p.revoked
        if revoked:
            raise NotFound(f"peer {p.name!r} deregistered its region {min(revoked)}; re-add its metadata")
        ldesc = np.empty((len(ext), 3), dtype=np.uint64)  # (addr, nbytes, device) rows for NIXL
        ldesc[:, 0], ldesc[:, 1], ldesc[:, 2] = laddr, lens, self._index.devices[li]
        rdesc = np.empty((len(ext), 3), dtype=np.uint64)
        rdesc[:, 0], rdesc[:, 1], rdesc[:, 2] = raddr, lens, rindex.devices[ri]
        kinds = self._index.kinds[li] * len(_KINDS) + rindex.kinds[ri]
        prep = NixlPrepared(self, p, op, ldesc, rdesc, kinds, local_ids, remote_ids)
        if p.error is None:  # (a broken peer's transfers fail at post; nothing to build)
            self._make_groups(prep)
        return prep

    def _make_groups(self, prep: NixlPrepared) -> None:
        eng = self._engine()
        p = prep._peer
        remote = self._nixl_name if p.is_self else p.nixl_name
        codes = np.unique(prep._kinds)
        groups = []
        try:
            for code in codes.tolist():
                sel = prep._kinds == code if len(codes) > 1 else slice(None)
                lkind, rkind = _KINDS[code // len(_KINDS)], _KINDS[code % len(_KINDS)]
                g = _Group(lkind, rkind, np.ascontiguousarray(prep._ldesc[sel]),
                           np.ascontiguousarray(prep._rdesc[sel]))
                groups.append(g)
                g.ldl = eng.xfer_dlist(None, g.lkind, g.ldesc)
                g.rdl = eng.xfer_dlist(remote, g.rkind, g.rdesc)
                g.idle.append(eng.make_req(prep._op, g.ldl, g.rdl, np.arange(len(g.ldesc), dtype=np.int32)))
        except PdkvError:
            self._release_groups(groups)
            raise
        prep._groups = groups

    def post(self, prep: NixlPrepared, transfer: Any, notif: bytes) -> None:
        """Posts the prepared NIXL requests; ``transfer`` (the core's) resolves as one part
        once every request completed and the notification (if any) was sent."""
        transfer.set_parts(1)
        data = bytes(notif) or None
        with self._lock:
            if self._closed or self._eng is None:
                return self._failed(prep._peer, prep._op, prep.nbytes, PeerConnectionError(
                    f"the nixl transport of agent {self._agent_name!r} is shutting down"), transfer)
            eng = self._eng
            if prep._invalid is not None:
                return self._failed(prep._peer, prep._op, prep.nbytes, prep._invalid, transfer)
            cur = self._peers.get(prep.peer)
            if cur is not prep._peer:
                if cur is None:
                    return self._failed(prep._peer, prep._op, prep.nbytes, NotFound(
                        f"peer {prep.peer!r} was removed; add it and prepare again"), transfer)
                if cur.instance != prep._peer.instance:
                    return self._failed(prep._peer, prep._op, prep.nbytes, StalePeer(
                        f"peer {prep.peer!r} restarted since this transfer was prepared; prepare it again"), transfer)
                if cur.error is not None:
                    return self._failed(cur, prep._op, prep.nbytes, cur.error, transfer)
                gone = prep._remote_ids - cur.region_ids
                if gone:
                    return self._failed(cur, prep._op, prep.nbytes, NotFound(
                        f"peer {prep.peer!r} no longer exports region {min(gone)}"), transfer)
                self._detach(prep)
                prep._peer = cur  # same instance, re-added metadata: rebuild against it
            p = prep._peer
            if p.error is not None:
                return self._failed(p, prep._op, prep.nbytes, p.error, transfer)
            revoked = prep._remote_ids & p.revoked
            if revoked:
                return self._failed(p, prep._op, prep.nbytes, NotFound(
                    f"peer {p.name!r} deregistered its region {min(revoked)}; re-add its metadata and prepare again"),
                    transfer)
            x = NixlTransfer(self, next(self._ids), p, prep._op, prep.nbytes, data, transfer, prep)
            if prep._groups is None:
                try:
                    self._make_groups(prep)
                except PdkvError as e:
                    self._finish(x, _S["FAILED"], e)
                    return None
            groups = prep._groups
            x._manual_notify = data is not None
            try:
                for g in groups:
                    req = g.idle.pop() if g.idle else eng.make_req(prep._op, g.ldl, g.rdl,
                                                               np.arange(len(g.ldesc), dtype=np.int32))
                    g.busy += 1
                    x._reqs.append((g, req))
                    x._pending.append(req)
            except PdkvError as e:
                self._finish(x, _S["FAILED"], e)
                return None
            self._inflight[x.id] = x
            self._hook(x)
            try:
                for g, req in x._reqs:
                    if eng.post(req, b""):
                        x._pending.remove(req)
            except eng.errors as e:
                self._fail_connection(x, to_pdkv(e, f"NIXL {prep._op} to peer {p.name!r}", PeerConnectionError))
                return None
            if not x._pending:
                self._progress(x, time.monotonic())
            elif data is not None:
                # Its notification leaves only when someone checks the finished request:
                # have the poller do so promptly in case nobody waits on it. (Without a
                # notification there is no hurry; not waking the poller keeps it off the
                # GIL while a waiter spins.)
                self._kick()
            return None

    def notify(self, peer: Any, transfer: Any, notif: bytes) -> None:
        """Sends a notification alone, after the transfers to ``peer`` posted before it
        (resolves the one part of ``transfer`` the core declared)."""
        data = bytes(notif)
        with self._lock:
            if self._closed or self._eng is None:
                return self._failed(_Peer(peer.name, {"instance_id": 0}, "", b"", b""), "notify", 0,
                                    PeerConnectionError(f"the nixl transport of agent {self._agent_name!r} is "
                                                        "shutting down"), transfer)
            try:
                p = self._ensure_peer(peer)
            except PdkvError as e:
                return self._failed(_Peer(peer.name, {"instance_id": 0}, "", b"", b""), "notify", 0, e, transfer)
            if p.error is not None:
                return self._failed(p, "notify", 0, p.error, transfer)
            x = NixlTransfer(self, next(self._ids), p, "notify", 0, data, transfer, None)
            x._manual_notify = True
            self._inflight[x.id] = x
            self._hook(x)
            self._progress(x, time.monotonic())
            if x._state is _S["PENDING"]:
                self._kick()
            return None

    def _hook(self, x: NixlTransfer) -> None:
        """Lets the core's transfer cancel ``x`` and have its waiters progress NIXL."""
        ref = weakref.ref(x)

        def cancel() -> None:
            y = ref()
            if y is not None:
                self._cancel(y)

        def drive(timeout: float) -> None:
            y = ref()
            if y is not None:
                y.drive(timeout)

        x._native.set_cancel_hook(cancel)
        x._native.set_driver(drive)

    def _check(self, x: NixlTransfer) -> "XferState":
        if x._state is _S["PENDING"]:
            with self._lock:
                if x._state is _S["PENDING"] and not self._closed:
                    self._progress(x, time.monotonic())
        return x._state

    def _progress(self, x: NixlTransfer, now: float) -> bool:
        """Advances ``x`` (lock held); True if it became terminal."""
        eng = self._eng
        if eng is None or x._probing:
            return False
        try:
            while x._pending:
                if not eng.done(x._pending[-1]):
                    break
                x._pending.pop()
        except eng.errors as e:
            self._fail_connection(x, to_pdkv(e, f"NIXL {x._op} to peer {x.peer!r} failed", PeerConnectionError))
            return False
        if not x._pending and x._manual_notify:
            if x._op == "notify" and any(y.id < x.id and y._peer_state is x._peer_state
                                         for y in self._inflight.values()):
                pass  # a standalone notification follows earlier transfers to its peer
            else:
                p = x._peer_state
                try:
                    eng.notify(self._nixl_name if p.is_self else p.nixl_name, _USER + (x._notify or b""))
                except PdkvError as e:
                    what = "the data landed but " if x.bytes_total else ""
                    self._finish(x, _S["FAILED"], PeerConnectionError(
                        f"{what}the notification to peer {x.peer!r} could not be sent: {e}"))
                    return True
                x._manual_notify = False
        if not x._pending and not x._manual_notify:
            self._finish(x, _S["DONE"], None)
            return True
        if x._deadline and now >= x._deadline:
            what = "notification" if x._op == "notify" else f"{x._op} of {x.bytes_total} bytes"
            self._finish(x, _S["FAILED"], TransferTimeout(
                f"NIXL {what} to peer {x.peer!r} timed out after {now - x._t_post:.3g} s "
                "(the peer stalled or the link is too slow)"))
            return True
        return False

    def _fail_connection(self, x: NixlTransfer, err: PdkvError) -> None:
        """``x`` failed at the connection level (lock held). A peer that restarted at the
        same address looks exactly like a dead one to UCX; the fault contract says
        StalePeer for it, so ask its tcp endpoint (off the lock, bounded) before
        finishing ``x``. It stays PENDING, untouched by the poller, until then."""
        p = x._peer_state
        if not isinstance(err, PeerConnectionError) or p.is_self or not p.tcp_address:
            self._finish(x, _S["FAILED"], err)
            return
        x._probing = True
        probe = threading.Thread(target=self._probe_restart, args=(x, err), name=f"pdkv-nixl-probe-{x.id}",
                                 daemon=True)
        self._probes.append(probe)
        probe.start()

    def _probe_restart(self, x: NixlTransfer, err: PdkvError) -> None:
        p = x._peer_state
        final = err
        hooks = self._hooks
        if hooks is not None and not self._closed:  # (shutdown joins this thread before the hooks go)
            try:
                md = _native.module().decode_metadata(
                    hooks.fetch_metadata(p.tcp_address, p.secret, self._opts.restart_probe_s))
                if md["name"] == p.name and int(md["instance_id"]) != p.instance:
                    final = StalePeer(f"peer {p.name!r} restarted (instance {p.instance:016x} is gone, "
                                      f"{int(md['instance_id']):016x} answers at {p.tcp_address}); fetch its "
                                      f"metadata again and re-add it ({err})")
            except Exception:  # noqa: BLE001 - unreachable or closed: the connection error stands
                pass
        with self._lock:
            if x._state is _S["PENDING"]:
                self._finish(x, _S["FAILED"], final)
            if threading.current_thread() in self._probes:
                self._probes.remove(threading.current_thread())

    def _cancel(self, x: NixlTransfer) -> None:
        with self._lock:
            if x._state is not _S["PENDING"] or self._closed:
                return
            if self._progress(x, time.monotonic()):
                return
            self._finish(x, _S["CANCELLED"], Cancelled(f"transfer {x.id} to peer {x.peer!r} was cancelled"))

    def _finish(self, x: NixlTransfer, state: Any, err: PdkvError | None) -> None:
        """Makes ``x`` terminal (lock held): its requests go back to their pool when it
        completed, else they are released (which aborts whatever is still in flight)."""
        x._state = state
        x._error = err
        native, x._native = x._native, None
        if native is not None:
            if state is _S["DONE"]:
                native.resolve_part(x.bytes_total)
            else:
                native.resolve_part(0, err or Cancelled(f"transfer to peer {x.peer!r} was cancelled"))
        prep = x._prep
        keep = state is _S["DONE"] and prep is not None and prep._invalid is None
        for g, req in x._reqs:
            g.busy -= 1
            if keep and prep._groups is not None and g in prep._groups and len(g.idle) < self._opts.max_idle_requests:
                g.idle.append(req)
            else:
                self._release_req(req)
            if g.busy == 0 and (prep is None or prep._groups is None or g not in prep._groups):
                self._release_groups([g])
        x._reqs = []
        x._pending = []
        x._prep = None
        self._inflight.pop(x.id, None)
        if x._event is not None:
            x._event.set()
        self._cond.notify_all()

    def _detach(self, prep: NixlPrepared) -> None:
        """Releases ``prep``'s idle requests and descriptor lists now, the busy ones when
        their transfers end; the next post rebuilds (or raises ``prep._invalid``)."""
        groups, prep._groups = prep._groups, None
        if groups:
            self._release_groups(groups)

    def _release_groups(self, groups: list[_Group]) -> None:
        eng = self._eng
        for g in groups:
            for req in g.idle:
                self._release_req(req)
            g.idle = []
            if g.busy == 0 and eng is not None:
                for h in (g.ldl, g.rdl):
                    if h is not None:
                        eng.release_dlist(h)
                g.ldl = g.rdl = None

    def _release_req(self, req: int) -> None:
        eng = self._eng
        if eng is not None and not eng.release_req(req):
            self._zombies.append(req)  # NIXL refused (still cancelling): retried by the poller

    def _collect_garbage(self) -> None:
        while self._graveyard:
            self._release_groups(self._graveyard.pop())
        zombies, self._zombies = self._zombies, []
        for req in zombies:
            self._release_req(req)

    # -------------------------------------------------------------- revocation protocol
    def _revoke(self, rid: int) -> None:
        """Tells every peer holding our metadata that region ``rid`` goes away and waits
        until each confirms it no longer uses it (lock held; the wait releases it)."""
        eng = self._engine()
        seq = next(self._ids)
        waiting: set[str] = set()
        for n in list(self._watchers):
            try:
                eng.notify(n, _ctl(k="revoke", regions=[rid], seq=seq))
                waiting.add(n)
            except PdkvError:
                self._forget_watcher(n)
        if not waiting:
            return
        self._acks[seq] = waiting
        self._kick()
        deadline = time.monotonic() + self._opts.revoke_timeout_s
        while self._acks[seq] and time.monotonic() < deadline and not self._closed:
            self._cond.wait(min(self._opts.poll_busy_max_s * 10, max(0.0, deadline - time.monotonic())))
        for n in self._acks.pop(seq):
            self._forget_watcher(n)  # silent past the deadline: it is not told again

    def _forget_watcher(self, n: str) -> None:
        self._watchers.pop(n, None)
        p = self._by_nixl.get(n)
        if (p is None or not p.loaded) and self._eng is not None:
            self._eng.forget(n)

    def _log_refused(self, sender: str, err: Exception) -> None:
        """Drops a malformed message from ``sender`` (logged at most once a second)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= 1.0:
            log.warning("nixl: dropped %d malformed message(s), latest from %r: %s", self._refused,
                        str(sender)[:64], err)
            self._refused, self._refused_logged_at = 0, now

    def _control(self, sender: str, raw: bytes) -> None:
        """One control message from NIXL agent ``sender`` (poller thread, lock held)."""
        try:
            msg = _parse_ctl(raw)
        except ProtocolError as e:
            self._log_refused(sender, e)
            return
        kind = msg["k"]
        eng = self._eng
        if eng is None:
            return
        try:
            if kind == "hello":
                md = base64.b64decode(msg["md"])
                epoch = int(msg["epoch"])
                good = _hello_mac(self._secret, sender, self._nixl_name, epoch, md)
                if sender not in self._by_nixl and sender not in self._watchers:
                    eng.load_md(md)
                if not hmac.compare_digest(good, str(msg.get("mac", ""))):
                    eng.notify(sender, _ctl(k="hello-ack", epoch=epoch, error="wrong secret"))
                    if sender not in self._by_nixl and sender not in self._watchers:
                        eng.forget(sender)
                    return
                self._watchers[sender] = (epoch, md)
                eng.notify(sender, _ctl(k="hello-ack", epoch=epoch, error=""))
            elif kind == "hello-ack":
                epoch = int(msg["epoch"])
                if epoch in self._hello_acks:
                    self._hello_acks[epoch] = str(msg.get("error") or "ok")
                    self._cond.notify_all()
            elif kind == "bye":
                w = self._watchers.get(sender)
                if w is not None and w[0] == int(msg["epoch"]):
                    self._forget_watcher(sender)
            elif kind == "revoke":
                ids = frozenset(int(i) for i in msg["regions"])
                seq = int(msg["seq"])
                p = self._by_nixl.get(sender)
                if p is not None:
                    p.revoked |= ids
                    gone = NotFound(f"peer {p.name!r} deregistered its region {min(ids)}; re-add its metadata "
                                    "and prepare again")
                    for prep in list(self._preps):
                        if prep._peer is p and prep._remote_ids & ids:
                            prep._invalid = gone
                            self._detach(prep)
                    self._deferred_acks.append((sender, seq, p, ids))
                else:
                    eng.notify(sender, _ctl(k="revoke-ack", seq=seq))
            elif kind == "revoke-ack":
                waiting = self._acks.get(int(msg["seq"]))
                if waiting is not None:
                    waiting.discard(sender)
                    self._cond.notify_all()
        except (PdkvError, ValueError, KeyError, TypeError):
            pass  # a malformed or unanswerable control message changes nothing

    def _send_deferred_acks(self) -> None:
        eng = self._eng
        keep = []
        for sender, seq, p, ids in self._deferred_acks:
            if any(x._peer_state is p and x._remote_ids & ids for x in self._inflight.values()):
                keep.append((sender, seq, p, ids))
                continue
            try:
                eng.notify(sender, _ctl(k="revoke-ack", seq=seq))
            except PdkvError:
                pass
        self._deferred_acks = keep

    # -------------------------------------------------------------- poller
    def _kick(self) -> None:
        if self._poll_interval > self._opts.poll_min_s:
            self._wake.set()

    def _poll_once(self) -> tuple[bool, bool]:
        """One pass: notifications, control messages, unwaited transfers. Returns
        (something happened, transfers still in flight)."""
        eng = self._eng
        if eng is None:
            return False, False
        active = False
        try:
            got = eng.notifs()
        except eng.errors:
            got = {}
        if got:
            active = True
            hooks = self._hooks
            for sender, msgs in got.items():
                for m in msgs:
                    m = bytes(m)
                    if m[:1] == _USER:
                        if len(m) - 1 > self._max_notif:
                            self._log_refused(sender, ProtocolError(
                                f"notification of {len(m) - 1} bytes (limit {self._max_notif})"))
                        elif hooks is not None:
                            hooks.deliver_notification(_pdkv_name(sender), m[1:])
                    elif m[:1] == _CTL:
                        with self._lock:
                            self._control(sender, m[1:])
        with self._lock:
            if self._closed:
                return active, False
            if self._graveyard or self._zombies:
                self._collect_garbage()
            now = time.monotonic()
            for x in list(self._inflight.values()):
                if x._state is _S["PENDING"] and self._progress(x, now):
                    active = True
            if self._deferred_acks:
                self._send_deferred_acks()
            busy = (any(not x._waiting for x in self._inflight.values()) or bool(self._deferred_acks)
                    or bool(self._acks) or bool(self._hello_acks))
        return active, busy


def _poll_loop(ref: "weakref.ref[NixlTransport]", wake: threading.Event) -> None:
    """The poller thread. Holds its transport only weakly between passes, so an agent
    dropped without close() is still collected (the thread then ends)."""
    interval = 0.0
    while True:
        t = ref()
        if t is None or t._closed:
            return
        opts = t._opts
        try:
            active, busy = t._poll_once()
        except Exception:  # noqa: BLE001 - keep delivering; the next pass retries (backing off)
            active, busy = False, True
        if active:
            interval = opts.poll_min_s
        else:
            interval = min(max(interval * 2, opts.poll_min_s), opts.poll_busy_max_s if busy else opts.poll_idle_max_s)
        t._poll_interval = interval
        del t
        if wake.wait(interval):
            wake.clear()
            interval = 0.0


def _coalesce(ext: np.ndarray) -> np.ndarray:
    """Merges extents adjacent on both sides: ``[n, 3]`` (local, remote, nbytes) uint64."""
    if len(ext) < 2:
        return ext
    ends_l = ext[:-1, 0] + ext[:-1, 2]
    ends_r = ext[:-1, 1] + ext[:-1, 2]
    joins = (ends_l == ext[1:, 0]) & (ends_r == ext[1:, 1])
    if not joins.any():
        return ext
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = ext[starts].copy()
    out[:, 2] = np.add.reduceat(ext[:, 2], starts)
    return out

