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

import asyncio
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Sequence

from . import _native, _validate
from . import transfer as _xfer
from . import transport as _transport
from .errors import InvalidArgument, NotFound, OutOfRange, PdkvError, error_class
from .layout import KVLayout, _describe_memory
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
    from ._pdkv import Blocks, PlanOptions, ShmOptions, StreamOptions, TcpCompression, TcpOptions, XferOptions

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


@dataclass(frozen=True)
class Notification:
    """A notification from ``peer``, queued after every byte of its transfer landed."""

    peer: str
    data: bytes


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


class Agent:
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

    # ------------------------------------------------------------------ memory
    def register(self, obj: Any, *, remote_access: bool = True) -> Region:
        """Registers the memory of ``obj``: a numpy array, a torch tensor (CPU or CUDA;
        its whole storage extent), any DLPack exporter (``__dlpack__`` and
        ``__dlpack_device__``: jax, cupy, ...; read natively from the capsule, so
        neither numpy nor torch is needed; CPU or CUDA, contiguous), or any contiguous
        writable buffer-protocol object. (Memory from :meth:`alloc` is registered
        already.) The region keeps ``obj`` alive until it is closed.

        Overlapping an existing registration raises :class:`~pdkv.errors.AlreadyExists`:
        register each pool once. ``remote_access=False`` keeps it local (a source for
        writes and a destination for reads, invisible to peers). Anything else (lists,
        DLPack capsules, read-only buffers peers could write into) raises
        :class:`~pdkv.errors.InvalidArgument`.
        """
        if isinstance(obj, Region):
            raise InvalidArgument(f"{obj!r} is registered already (Agent.alloc registers the memory it returns)")
        remote_access = _validate.flag(remote_access, "remote_access")
        mem = _describe_memory(obj)
        if mem.readonly and remote_access:
            raise InvalidArgument(f"cannot register a read-only {type(obj).__name__} with remote_access=True: "
                                  "peers would write into it (pass remote_access=False for a write source)")
        return self._register(mem.addr, mem.nbytes, mem.kind, mem.device, remote_access, mem.keepalive)

    def alloc(self, nbytes: int, *, remote_access: bool = True) -> SharedRegion:
        """Allocates ``nbytes`` of shareable memory (a memfd) and registers it.

        Same-host peers then reach it with one memcpy (the ``shm`` transport) instead
        of a socket. Build your KV pool on it with ``region.array(...)`` or
        ``region.tensor(...)``; the memory is zero-filled.
        """
        import mmap

        nbytes = _validate.positive_int(nbytes, "nbytes")
        remote_access = _validate.flag(remote_access, "remote_access")
        # Sealable: registration seals it against shrinking and growing, so no peer it
        # is shared with can truncate it under us (SIGBUS).
        fd = os.memfd_create(f"pdkv:{self.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            import ctypes

            view = ctypes.c_char.from_buffer(mm)
            addr = ctypes.addressof(view)
            del view
            desc = self._n.register_memory(addr, nbytes, _native.module().MemKind.HOST, -1, remote_access, fd)
        finally:
            os.close(fd)  # the agent keeps its own dup for peers
        region = SharedRegion(self, desc, mm)
        with self._lock:
            self._regions[region.id] = region
        return region

    def register_address(self, addr: int, nbytes: int, *, kind: str = "host", device: int = -1,
                         remote_access: bool = True, keepalive: Any = None) -> Region:
        """Registers raw memory ``[addr, addr + nbytes)``; the caller keeps it alive."""
        addr = _validate.positive_int(addr, "addr")
        if _validate.count(nbytes, "nbytes", maximum=2**64 - 1) == 0:
            raise InvalidArgument("cannot register an empty range (nbytes=0)")
        if not _validate._is_int(device) or int(device) < -1:
            raise InvalidArgument(f"device must be a CUDA ordinal or -1, got {device!r}")
        remote_access = _validate.flag(remote_access, "remote_access")
        return self._register(addr, int(nbytes), kind, int(device), remote_access, keepalive)

    def _register(self, addr: int, nbytes: int, kind: str, device: int, remote: bool, obj: Any) -> Region:
        m = _native.module()
        if kind not in ("host", "cuda"):
            raise InvalidArgument(f"kind must be 'host' or 'cuda', got {kind!r}")
        mk = m.MemKind.HOST if kind == "host" else m.MemKind.CUDA
        desc = self._n.register_memory(addr, nbytes, mk, device if kind == "cuda" else -1, remote)
        region = Region(self, desc, obj)
        with self._lock:
            self._regions[region.id] = region
        return region

    def deregister(self, region: Region) -> None:
        """Same as ``region.close()``."""
        region.close()

    def _deregister(self, region: Region) -> None:
        self._n.deregister_memory(region.id)
        with self._lock:
            self._regions.pop(region.id, None)
            for name in [n for n in self._layout_keep if n not in self._n.layout_names()]:
                del self._layout_keep[name]

    @property
    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    # ------------------------------------------------------------------ layouts
    def add_layout(self, name: str, layout: KVLayout) -> None:
        """Makes ``layout``'s blocks transferable under ``name`` and exports it to peers.
        Every segment must lie inside one registered region."""
        self._n.add_layout(name, layout.native)
        with self._lock:
            self._layout_keep[name] = layout

    def remove_layout(self, name: str) -> None:
        self._n.remove_layout(name)
        with self._lock:
            self._layout_keep.pop(name, None)

    def layout(self, name: str) -> KVLayout:
        return KVLayout(self._n.layout(name))

    # ------------------------------------------------------------------ block generations
    def generations(self, layout: str, block_ids: Iterable[int]) -> list[int]:
        """Current generations of blocks of a local layout (docs/generations.md).

        Hand them out with the block ids to whoever will write into (or read from) the
        blocks; they pass them as the remote side's ``pdkv.Blocks(layout, ids,
        generations=...)``.
        """
        return self._n.generations(_validate.text(layout, "layout"), _validate.block_ids(block_ids, "block_ids"))

    def bump_generations(self, layout: str, block_ids: Iterable[int], *, timeout: float | None = 30.0) -> list[int]:
        """Invalidates every outstanding reference to these blocks; returns their new
        generations. Call it when freeing or reusing blocks whose ids (and generations)
        were handed to a peer.

        From the moment this is called, a transfer that names the old generation fails
        with :class:`StaleBlock` at this agent before any byte lands (or is sent). The
        call returns once no transfer accepted under the old generation still touches
        the blocks, so they may be reused at once. (An shm read is not waited for: it
        checks this agent's published generations again after its copy, and one still
        copying when this is called fails with :class:`StaleBlock`.)

        Parameters
        ----------
        layout : str
            A local layout.
        block_ids : sequence of int
            Distinct block ids.
        timeout : float or None
            Seconds (finite, > 0) to wait for transfers already accepted under the old
            generation (every such transfer has a deadline); None: no limit.

        Raises
        ------
        TransferTimeout
            Such a transfer still runs after ``timeout``; the new generations are in
            force anyway (new transfers naming the old ones fail).
        NotFound, OutOfRange, InvalidArgument
            Unknown layout, block id beyond it, duplicate ids.
        """
        tmo = _validate.timeout(timeout)
        return self._n.bump_generations(_validate.text(layout, "layout"),
                                        _validate.block_ids(block_ids, "block_ids"), -1.0 if tmo is None else tmo)

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

    # ------------------------------------------------------------------ transfers
    def _op(self, op: str):
        m = _native.module().OpKind
        if not isinstance(op, str):
            raise InvalidArgument(f"op must be 'write' or 'read', got {type(op).__name__} {op!r}")
        if op == "write":
            return m.WRITE
        if op == "read":
            return m.READ
        raise InvalidArgument(f"op must be 'write' or 'read', got {op!r}")

    def prepare(self, op: str, peer: str, local: Blocks, remote: Blocks | None = None, *,
                plan: PlanOptions | None = None, options: XferOptions | None = None) -> PreparedTransfer:
        """Validates and lays out a block transfer once; ``.post()`` it many times.

        Parameters
        ----------
        op : {"write", "read"}
            ``"write"`` pushes local blocks into the peer's; ``"read"`` pulls the peer's
            blocks into local ones.
        peer : str
            A name returned by :meth:`add_peer` / :meth:`connect`.
        local : Blocks
            Blocks of one of this agent's layouts: ``pdkv.Blocks("kv", [0, 1, 2])``.
        remote : Blocks, optional
            Blocks of one of the peer's layouts, position i of ``local.ids`` mapped to
            position i of ``remote.ids`` (None: the same layout name and ids). The
            destination side (remote for a write, local for a read) must not name a
            block twice. ``remote.generations``, the generations the peer handed out
            with the ids (see :meth:`generations`), make every post have the peer check
            them before any byte lands (write) or is sent (read): a block freed or
            reused since (the peer called :meth:`bump_generations`) fails the transfer
            with :class:`StaleBlock` from ``wait()``, with nothing transferred and no
            notification delivered. tcp and shm only (NotSupported elsewhere). The
            local side carries no generations (InvalidArgument).
        plan : PlanOptions, optional
            For layouts of different shape (block size, NHD/HND, TP head split) and for
            a range of layers: ``num_tokens``, ``num_heads``, ``local_head_offset``,
            ``remote_head_offset``, ``first_layer``, ``num_layers``. 0 means "all",
            which is accepted only when both block lists hold the same number of tokens
            and both layouts the same number of kv heads: a plan never moves part of
            the data unless asked to. A layer range beyond the layouts' layers raises
            :class:`OutOfRange`. None: everything.
        options : XferOptions, optional
            ``transport`` forces one (it must reach the peer). ``compress`` (``"off"``,
            ``"lossless"``, ``"fp8"``, ``"auto"``) is how this transfer's payload travels
            on a tcp wire, overriding the agent's ``TcpOptions.compress.mode`` for this
            transfer only (its codec, dtype and FP8 grouping apply as they are);
            ``"fp8"`` (or ``"auto"`` with policy ``"lossy-allowed"``) allows lossy KV for
            this transfer. Reads ask the peer for compressed responses (a peer that
            cannot answer them sends plain). Other transports move the bytes exactly.
            See docs/compression.md.

        Raises
        ------
        InvalidArgument, OutOfRange, NotFound
            Caller errors only (arguments, block ids beyond the peer's metadata,
            mismatched geometries, unknown peer or layout). Faults of the peer itself
            surface from the transfer's ``wait()`` (docs/faults.md).
        """
        opk = self._op(op)
        peer = _validate.text(peer, "peer")
        local, remote = _xfer.sides(local, remote)
        native = self._n.prepare_blocks(peer, opk, local, remote, _xfer.plan_options(plan),
                                        _xfer.xfer_options(options))
        return PreparedTransfer(self, native)

    def prepare_extents(self, op: str, peer: str, extents: Sequence[tuple[int, int, int, int, int]], *,
                        options: XferOptions | None = None) -> PreparedTransfer:
        """Raw form: ``(local_region_id, local_offset, remote_region_id, remote_offset,
        nbytes)`` tuples of non-negative integers (remote ids from :meth:`peer_info`).
        ``options`` as :meth:`prepare`."""
        opk = self._op(op)
        peer = _validate.text(peer, "peer")
        rows = _validate.extents(extents)
        return PreparedTransfer(self, self._n.prepare_extents(peer, opk, rows, _xfer.xfer_options(options)))

    def write(self, peer: str, local: Blocks, remote: Blocks | None = None, *, plan: PlanOptions | None = None,
              options: XferOptions | None = None, notify: bytes | str | None = None,
              timeout: float | None = None) -> Transfer:
        """Pushes local blocks into the peer's blocks; returns at once. See :meth:`prepare`
        (the blocks, ``plan``, ``options``) and :meth:`PreparedTransfer.post` (``notify``,
        ``timeout``)."""
        self._check_post_args(notify, timeout)  # caller errors first, before any peer work
        return self.prepare("write", peer, local, remote, plan=plan, options=options).post(notify=notify,
                                                                                             timeout=timeout)

    def _check_post_args(self, notify: Any, timeout: Any) -> None:
        _validate.notification(notify, self._max_notif_bytes)
        _validate.timeout(timeout)

    def read(self, peer: str, local: Blocks, remote: Blocks | None = None, *, plan: PlanOptions | None = None,
             options: XferOptions | None = None, notify: bytes | str | None = None,
             timeout: float | None = None) -> Transfer:
        """Pulls the peer's blocks into local blocks; ``notify`` reaches the peer once
        every byte has landed here. See :meth:`prepare`; with ``options.compress`` the
        peer encodes its responses and this agent decodes them."""
        self._check_post_args(notify, timeout)
        return self.prepare("read", peer, local, remote, plan=plan, options=options).post(notify=notify,
                                                                                            timeout=timeout)

    def open_stream(self, peer: str, local: Blocks, remote: Blocks | None = None, *,
                    plan: PlanOptions | None = None, options: XferOptions | None = None,
                    stream: StreamOptions | None = None, notify: bytes | str | None = None,
                    timeout: float | None = None) -> StreamingWrite:
        """Opens a layer-wise streaming write of local blocks into the peer's blocks.

        The same write as :meth:`write`, but its layers are sent as the caller posts
        them (:meth:`StreamingWrite.post_layers`), so computing later layers overlaps
        sending earlier ones; the notification reaches the peer after the last layer
        landed. See docs/streaming.md.

        Parameters
        ----------
        peer, local, remote, options
            As :meth:`prepare`.
        plan : PlanOptions, optional
            As :meth:`prepare`, applied to every layer; ``first_layer`` and
            ``num_layers`` are the layers the stream carries (``num_layers`` 0: through
            the last layer).
        stream : StreamOptions, optional
            How layers are batched: ``min_batch_bytes`` (posted layers holding fewer
            bytes wait for more, or for close), ``max_inflight_batches`` (most transfers
            of this stream in flight; layers posted meanwhile leave together when one
            completes) and ``progress_prefix`` (when given, every batch also delivers
            the notification ``progress_prefix + b"<first>-<end>"``, its layer range,
            once it landed, for a receiver that starts on early layers).
        notify : bytes or str, optional
            Delivered once every layer landed (``close(notify=...)`` may replace it).
        timeout : float, optional
            Seconds (finite, > 0) for the whole stream, from now to the notification's
            delivery (None: the agent's ``default_timeout``).

        Raises
        ------
        InvalidArgument, OutOfRange, NotFound
            As :meth:`prepare`, checked now on the first layer, before anything is sent.
        """
        notif = _validate.notification(notify, self._max_notif_bytes)
        tmo = _validate.timeout(timeout)
        peer = _validate.text(peer, "peer")
        local, remote = _xfer.sides(local, remote)
        native = _native.module().open_stream(self._n, peer, local, remote, _xfer.plan_options(plan),
                                              _xfer.xfer_options(options), notif, -1.0 if tmo is None else tmo,
                                              _xfer.stream_options(stream))
        return StreamingWrite(native, self._max_notif_bytes)

    def notify(self, peer: str, data: bytes | str, *, timeout: float | None = None) -> Transfer:
        """Sends a notification alone (ordered after earlier transfers on the same connection)."""
        data = _validate.notification(data, self._max_notif_bytes, "data")
        if not data:
            raise InvalidArgument("notification data is empty")
        tmo = _validate.timeout(timeout)
        peer = _validate.text(peer, "peer")
        return Transfer(self._n.send_notification(peer, data, -1.0 if tmo is None else tmo))

    # ------------------------------------------------------------------ notifications
    def get_notifications(self, max_count: int = 0) -> list[Notification]:
        """Takes queued notifications without blocking (``max_count=0``: all)."""
        return [Notification(p, d) for p, d in self._n.take_notifications(_validate.count(max_count, "max_count"))]

    def wait_notifications(self, timeout: float | None = None, max_count: int = 0) -> list[Notification]:
        """Blocks (without spinning) until at least one notification is queued or
        ``timeout`` passes; returns them (possibly empty on timeout)."""
        timeout = _validate.wait_timeout(timeout)
        return [Notification(p, d) for p, d in self._n.wait_notifications(-1.0 if timeout is None else timeout,
                                                                         _validate.count(max_count, "max_count"))]

    @property
    def notifications_unacknowledged(self) -> int:
        """Notifications this agent sent whose transfers completed when they were sent
        (``ShmOptions(notify_on_send=True)``) and that the peer then never acknowledged
        (its connection closed, or the transfer's deadline passed, first): the peer may
        not have received them. Monotonic; each is also logged (docs/api.md,
        "Notifications")."""
        return self._n.notifications_unacknowledged

    @property
    def notification_fd(self) -> int:
        """An eventfd readable exactly while notifications are queued (for select/epoll)."""
        return self._n.notification_fd

    async def notifications(self) -> AsyncIterator[Notification]:
        """Async iterator over incoming notifications (uses :attr:`notification_fd`)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(self.notification_fd, ready.set)
        try:
            while True:
                batch = self.get_notifications()
                for n in batch:
                    yield n
                if not batch:
                    # The fd is level-triggered: a notification that lands after the
                    # take above makes the reader fire on the next loop iteration.
                    ready.clear()
                    await ready.wait()
        finally:
            loop.remove_reader(self.notification_fd)

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
            self._regions.clear()
            self._layout_keep.clear()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "Agent(closed)"
        return f"Agent({self.name!r}, transports={self.transports}, address={self.address!r})"
