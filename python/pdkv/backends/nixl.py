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
>>> with pdkv.Agent("p", secret="s", transports=["nixl"], options=[NixlOptions()]) as p, \\
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
  when their regions go away (their transfers fail with NotFound), and re-prepares
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
import itertools
import os
import threading
import weakref
from typing import Any

from .. import _native, transport as _transport
from ..errors import Cancelled, InvalidArgument, NotFound, PdkvError
from ..transport import Transport
from ._nixl import NixlEngine, UcxSetup, is_loopback_host, ucx_setup
from ._nixl_options import NixlOptions
# NixlTransport is composed of its seams, one file each, read in this order:
from ._nixl_peers import _Peers          # connection: peers, NIXL metadata, the hello handshake
from ._nixl_memory import _Memory        # memory registration, published metadata, revocation
from ._nixl_transfers import _Transfers  # prepare, post, progress, finish
from ._nixl_control import _Control, _poll_loop  # notifications, control messages, the poller
from ._nixl_records import _S, NixlPrepared, NixlTransfer, _Group, _Peer, _Region, _RegionIndex
from ._nixl_wire import (  # noqa: F401 - re-exported (tests, docs/wire.md)
    _CTL, _MAX_CTL_BYTES, _MAX_REVOKE_REGIONS, _USER, _ctl, _decode_extra, _encode_extra, _parse_ctl,
    nixl_agent_name)

__all__ = ["NixlOptions", "NixlTransport", "nixl_agent_name"]


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


class NixlTransport(_Peers, _Memory, _Transfers, _Control, Transport):
    """The nixl transport of one :class:`pdkv.Agent` (created through the registry; see
    the module docstring). Thread-safe: one lock guards its state, NIXL runs in STRICT
    sync mode, and a poller thread delivers notifications and completes unwaited
    transfers.
    """

    name = "nixl"

    def __init__(self, options: NixlOptions | None = None, *, listen_host: str = "127.0.0.1") -> None:
        if options is not None and not isinstance(options, NixlOptions):
            raise InvalidArgument(f"nixl options must be NixlOptions, got {type(options).__name__}")
        self._opts = options or NixlOptions()
        self._opts.validate()
        self._listen_host = listen_host or "127.0.0.1"  # the agent's tcp listen host (UCX devices)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._cond_waiters = 0  # threads in _wait_cond: only then does a finished transfer notify
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
        # Our handshakes by epoch: None while waiting, then the challenge or hello-ack message.
        self._hello_acks: dict[int, Any] = {}
        self._pending_hs: dict[str, tuple] = {}  # sender -> (epoch, its md, TargetHandshake)
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
        self._secrets = [bytes(s) for s in hooks.accepted_secrets]  # ours first; never sent
        self._max_notif = int(hooks.max_notif_bytes)
        self._nixl_name = nixl_agent_name(hooks.agent_name, hooks.instance_id)
        self._setup: UcxSetup = ucx_setup(os.environ, loopback=is_loopback_host(self._listen_host))
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
                self._finish(x, _S["CANCELLED"], Cancelled(
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

    def _wait_cond(self, timeout: float) -> None:
        """``self._cond.wait`` (lock held), counted: finishing a transfer notifies the
        condition only while someone waits on it (most never see a waiter)."""
        self._cond_waiters += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._cond_waiters -= 1

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
