"""The pdkv Agent: register memory and KV layouts, meet peers, move blocks.

One Agent per process. Its native progress threads move the bytes; Python only
sets transfers up. Every blocking call releases the GIL.

Example
-------
Two agents in one process (the same calls work across processes and hosts; ship
``metadata()`` however you like, or let the decode side ``connect("host:port")``):

>>> import numpy as np, pdkv
>>> geo = pdkv.KVGeometry(num_layers=2, num_blocks=16, block_tokens=16, kv_heads=2,
...                       head_dim=64, dtype="float16")
>>> with pdkv.Agent("prefill", secret="s") as p, pdkv.Agent("decode", secret="s") as d:
...     pools = {a: np.zeros(geo.pool_bytes, np.uint8) for a in ("p", "d")}
...     _ = p.register(pools["p"]); _ = d.register(pools["d"])
...     p.add_layout("kv", pdkv.KVLayout.contiguous(geo, pools["p"]))
...     d.add_layout("kv", pdkv.KVLayout.contiguous(geo, pools["d"]))
...     pools["p"][:] = 7
...     peer = p.connect(d.address)                 # fetch decode's metadata by address
...     xfer = p.write(peer, pdkv.Blocks("kv", [0, 1, 2]), pdkv.Blocks("kv", [5, 9, 3]), notify=b"req-1")
...     xfer.wait(5.0)
...     [n.data for n in d.wait_notifications(5.0)]
True
[b'req-1']
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Sequence

from . import _native, _validate
from .errors import InvalidArgument, NotFound, PdkvError
from .layout import KVLayout
from .agent_memory import AgentMemory
from .agent_transfers import AgentTransfers, Notification
from .region import Region, SharedRegion
from .transfer import PreparedTransfer, StreamingWrite, Transfer
from .xfer_state import XferState

__all__ = ["Agent", "TcpOptions", "TcpCompression", "ShmOptions", "Region", "SharedRegion", "Transfer", "PreparedTransfer",
           "StreamingWrite", "Notification", "XferState"]


# The options classes are the native ones (cpp/bindings/py_options.cc): typed
# attributes named and documented once, in each transport's C++ header; keyword-only
# constructors that validate at once (InvalidArgument naming the field). Looked up on
# first use (module __getattr__ below), so `import pdkv` still loads no native code.
if TYPE_CHECKING:  # the classes as the stubs (python/pdkv/_pdkv.pyi) describe them
    from ._pdkv import ShmOptions, TcpCompression, TcpOptions

_NATIVE_OPTIONS = ("TcpOptions", "ShmOptions", "TcpCompression")


def __getattr__(name: str) -> Any:
    if name in _NATIVE_OPTIONS:
        return getattr(_native.module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _listen_address(listen: Any) -> tuple[str, int]:
    """``"host:port"`` (``[v6]:port`` too) -> (host, port): the one string edge of the options."""
    if not isinstance(listen, str):
        raise InvalidArgument(f"listen must be 'host:port', got {type(listen).__name__} {listen!r}")
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"listen must be 'host:port' with a port in 0..65535, got {listen!r}")
    return host.strip("[]"), int(port)


class _Closed:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise InvalidArgument(f"agent {self._name!r} is closed")


def _transport_name(transport: Any) -> str | None:
    if transport is not None and not isinstance(transport, str):
        raise InvalidArgument(f"transport must be a str, got {type(transport).__name__}")
    return transport


def _as_bytes(v: bytes | str | None, what: str = "secret") -> bytes:
    if v is None:
        return b""
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise InvalidArgument(f"{what} must be bytes or str, got {type(v).__name__}")


class Agent(AgentMemory, AgentTransfers):
    """One pdkv endpoint per process.

    Parameters
    ----------
    name : str
        Unique among the agents that talk to each other (printable ASCII, no spaces).
    secret : str or bytes, optional
        The cluster secret. Peers must prove they know it to read or write this agent's
        memory, and this agent proves it to them; it never crosses the wire (a mutual
        challenge-response, docs/security.md). Defaults to the ``PDKV_SECRET``
        environment variable, else a random one (see :attr:`secret`). By default this
        agent proves its own secret to peers, so a deployment that shares one secret
        needs no per-peer configuration. Use a random one (``pdkv.credential.new_secret()``).
    accepted_secrets : sequence of str or bytes, optional
        Further secrets whose proofs this agent accepts (at most 7): rotation without
        downtime (docs/security.md, "Rotating the secret"). Defaults to the comma-separated
        ``PDKV_ACCEPTED_SECRETS`` environment variable.
    listen : str, optional
        ``"host:port"`` the tcp transport binds and publishes (port 0: any free port);
        a convenience that overrides ``listen_host``/``listen_port`` of the
        :class:`TcpOptions` in ``options`` (default ``127.0.0.1:0``). Use an address
        peers can reach (not 127.0.0.1) across hosts.
    transports : sequence of str, optional
        Enabled transports in order of preference (default: every available one,
        ``cuda_ipc`` (GPU pools on this node), then ``shm``, then ``tcp``; ``nixl`` first
        when the host has an RDMA device); each peer uses the first one that can reach it
        (:meth:`peer_transport`), or the one ``add_peer(..., transport=)`` forces.
    options : sequence, optional
        Options of transports, at most one per transport, each typed by its transport:
        :class:`TcpOptions`, :class:`ShmOptions`, :class:`NixlOptions` (RDMA through
        NIXL/UCX), or the options class a Python transport registered. A transport
        without options here gets its defaults; options for a transport that is not
        enabled are still validated. The agent keeps copies (native classes) or the
        objects themselves (Python classes).
    default_timeout : float
        Deadline of transfers posted without one (0 or None: none).
    max_notif_bytes : int
        Largest notification accepted (sent or received).
    max_queued_notifs, max_queued_notif_bytes : int
        Received notifications not yet taken (:meth:`get_notifications`, ...): at most
        this many (default 65536) and this many bytes (default 64 MiB; an empty queue
        takes any one). One more is refused before it is accepted: the sender's
        transfer fails with ``ResourceExhausted``; nothing accepted is dropped.
    registry : pdkv.discovery.Registry or str, optional
        Discovery (``"etcd://host:port"`` or a Registry): the agent publishes itself under
        ``/pdkv/agents/<name>`` with a lease while it is open, and :meth:`connect` also
        takes a registered name. See docs/discovery.md.
    advertise_host : str, optional
        The host published for this agent when it listens on a wildcard address.
    """

    def __init__(
        self,
        name: str,
        *,
        secret: str | bytes | None = None,
        accepted_secrets: Sequence[str | bytes] | None = None,
        listen: str | None = None,
        transports: Sequence[str] | None = None,
        options: Sequence[Any] = (),
        default_timeout: float | None = 60.0,
        max_notif_bytes: int = 1 << 20,
        max_queued_notifs: int = 65536,
        max_queued_notif_bytes: int = 64 << 20,
        wait_spin_us: int = 50,
        registry: Any = None,
        advertise_host: str | None = None,
    ) -> None:
        if secret is None:
            secret = os.environ.get("PDKV_SECRET", "")
        if not isinstance(secret, (str, bytes)):
            raise InvalidArgument(f"secret must be str or bytes, got {type(secret).__name__}")
        if accepted_secrets is None:
            raw = os.environ.get("PDKV_ACCEPTED_SECRETS", "")
            accepted_secrets = [a for a in (x.strip() for x in raw.split(",")) if a]
        if isinstance(accepted_secrets, (str, bytes)):
            raise InvalidArgument("accepted_secrets must be a sequence of secrets, not one secret")
        default_timeout = _validate.wait_timeout(default_timeout, "default_timeout") or 0.0  # None, 0: no limit
        max_notif_bytes = _validate.positive_int(max_notif_bytes, "max_notif_bytes", maximum=2**32 - 1)
        wait_spin_us = _validate.count(wait_spin_us, "wait_spin_us")
        max_queued_notifs = _validate.positive_int(max_queued_notifs, "max_queued_notifs", maximum=2**32 - 1)
        max_queued_notif_bytes = _validate.positive_int(max_queued_notif_bytes, "max_queued_notif_bytes",
                                                        maximum=2**64 - 1)
        listen_at = None if listen is None else _listen_address(listen)
        from . import backends  # noqa: F401 - registers the transports written in Python

        m = _native.module()
        if transports is None:
            transports = m.default_transports()  # the viable ones, by priority
        if isinstance(options, (str, bytes, dict)) or not isinstance(options, Sequence):
            raise InvalidArgument(f"options must be a list of transport options (TcpOptions(...), ...), "
                                  f"got {type(options).__name__} {options!r}")
        config = m.AgentConfig(
            name=name, secret=_as_bytes(secret),
            accepted_secrets=[_as_bytes(s, "accepted secret") for s in accepted_secrets], transports=list(transports),
            options=list(options), default_timeout_s=float(default_timeout), max_notif_bytes=max_notif_bytes,
            wait_spin_us=wait_spin_us, max_queued_notifs=max_queued_notifs,
            max_queued_notif_bytes=max_queued_notif_bytes)
        if listen_at is not None:  # on a copy: the caller's TcpOptions stay as they are
            held = config.options
            tcp = next((o for o in held if isinstance(o, m.TcpOptions)), None) or m.TcpOptions()
            tcp.listen_host, tcp.listen_port = listen_at
            config.options = [o for o in held if not isinstance(o, m.TcpOptions)] + [tcp]
        self._n = m.Agent(config)
        self._max_notif_bytes = int(max_notif_bytes)
        self._regions: dict[int, Region] = {}
        self._layout_keep: dict[str, KVLayout] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._publish(registry, advertise_host, secret, accepted_secrets)

    def _publish(self, registry: Any, advertise_host: str | None, secret: str | bytes = "",
                 accepted: Sequence[str | bytes] = ()) -> None:
        from . import discovery

        # A URL's registry signs with the agent's secret and accepts its accepted ones.
        self._registry = discovery.resolve(registry, secret, list(accepted))
        self._publication = None
        if self._registry is not None:
            try:
                self._publication = self._registry.publish_agent(self, advertise_host=advertise_host)
            except PdkvError:
                self.close()
                raise

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        return self._n.name

    @property
    def secret(self) -> bytes:
        """The secret peers must prove they know (give it to peers that do not share yours)."""
        return self._n.secret

    @property
    def instance_id(self) -> int:
        """Random per Agent object; peers use it to detect restarts."""
        return self._n.instance_id

    @property
    def transports(self) -> list[str]:
        """Enabled transports in order of preference (a transport that exchanges metadata
        through another, such as nixl through tcp, brings it along, last)."""
        return list(self._n.transports)

    @property
    def address(self) -> str:
        """The tcp endpoint ``host:port`` peers can ``connect()`` to."""
        for t, a in self._n.endpoints:
            if t == "tcp":
                return a
        raise InvalidArgument("this agent has no tcp endpoint")

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        """Versioned binary description of this agent (endpoints, exported regions,
        layouts); give it to peers' :meth:`add_peer`. Contains no secret."""
        return self._n.metadata()

    def add_peer(self, metadata: bytes, *, secret: str | bytes | None = None, transport: str | None = None,
                 via_host: str | None = None) -> str:
        """Imports a peer's :meth:`metadata`; returns its name. Re-adding a name replaces
        it. ``secret``: the peer's, if it differs from ours. ``transport`` forces one;
        otherwise the first of this agent's transports that can reach the peer is used
        (see :meth:`peer_transport`). ``via_host``: the host the metadata came from
        (:meth:`connect` passes it): it replaces a wildcard or loopback tcp address that
        would not be reachable from here."""
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"metadata must be bytes (Agent.metadata()), got {type(metadata).__name__}")
        blob = bytes(metadata)
        transport = _transport_name(transport)
        return self._n.add_peer(blob, _as_bytes(secret), transport or "", via_host or "")

    def fetch_metadata(self, address: str, *, secret: str | bytes | None = None, timeout: float = 10.0) -> bytes:
        """Fetches a peer's metadata from its tcp ``address`` (``"host:port"``)."""
        tmo = _validate.timeout(timeout)
        address = _validate.text(address, "address")
        return self._n.fetch_metadata(address, _as_bytes(secret), 10.0 if tmo is None else tmo)

    def connect(self, address: str, *, secret: str | bytes | None = None, transport: str | None = None,
                timeout: float = 10.0) -> str:
        """Fetches the metadata of the agent at ``address`` and adds it; returns its name.
        With a registry, ``address`` may be a registered agent name (no ``:``): it is
        looked up in etcd (NotFound when absent, PeerConnectionError when etcd is down)."""
        wanted = None
        if self._registry is not None and ":" not in _validate.text(address, "address"):
            wanted, address = address, self._registry.lookup_agent(address)["address"]
        md = self.fetch_metadata(address, secret=secret, timeout=timeout)
        if wanted is not None and _native.module().decode_metadata(md)["name"] != wanted:
            raise NotFound(f"agent {wanted!r} is registered at {address}, but another agent answers there "
                           "(it went away; its registration expires with its lease)")
        host = address.rsplit(":", 1)[0].strip("[]")
        return self.add_peer(md, secret=secret, transport=transport, via_host=host)

    def remove_peer(self, name: str) -> None:
        """Forgets a peer; its in-flight transfers fail with PeerConnectionError."""
        self._n.remove_peer(name)

    @property
    def registry(self) -> Any:
        """The :class:`~pdkv.discovery.Registry` this agent publishes to, or None."""
        return self._registry

    @property
    def peers(self) -> list[str]:
        return self._n.peer_names()

    def peer_transport(self, name: str) -> str:
        """The transport that transfers to ``name`` use."""
        return self._n.peer_transport(name)

    def peer_info(self, name: str) -> dict:
        """The peer's decoded metadata (name, endpoints, regions, layouts, ...)."""
        return _native.module().decode_metadata(self._n.peer_metadata(name))

    def warm_up(self, peer: str, timeout: float = 10.0) -> None:
        """Opens the connections to ``peer`` now instead of on the first transfer."""
        tmo = _validate.timeout(timeout)
        self._n.connect(_validate.text(peer, "peer"), 10.0 if tmo is None else tmo)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stops the transports (failing in-flight transfers) and frees the agent."""
        if self._closed:
            return
        if getattr(self, "_publication", None) is not None:
            self._publication.close()  # peers stop finding this instance before it goes
        self._closed = True
        name = self._n.name
        n, self._n = self._n, _Closed(name)
        del n
        with self._lock:
            owned = [r for r in self._regions.values() if hasattr(r, "_agent_closed")]
            self._regions.clear()
            self._layout_keep.clear()
        for r in owned:  # device memory Agent.alloc made: freed once the agent no longer uses it
            r._agent_closed()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "Agent(closed)"
        try:
            where = f"address={self.address!r}"
        except InvalidArgument:  # no tcp endpoint
            where = "no tcp endpoint"
        return f"Agent({self.name!r}, transports={self.transports}, {where})"
