"""Writing a transport in Python: subclass :class:`Transport`, register a factory.

A Python transport implements the same interface as the native ones (C++
``pdkv::Transport``, ``cpp/include/pdkv/spi/transport.h``) through a pybind11 trampoline:
the agent calls these methods (with the GIL taken) exactly where it calls a native
transport's. The core keeps routing, peer selection, bounds checks against registered
regions and the transfer state; a transport only moves bytes that were already
resolved and checked.

Contract (see cpp/include/pdkv/spi/transport.h for the full text):

* ``prepare`` gets the extents as ONE ``[n, 7]`` int64 numpy array whose columns are
  :data:`EXTENT_COLUMNS` (``local_addr, len, local_kind, local_device, remote_region,
  remote_offset, remote_addr``); ``local_kind`` is 0 for host, 1 for CUDA memory. Its
  result is opaque to the core and given back to ``post``.
* ``post``/``notify`` get the native :class:`pdkv._pdkv.Transfer`: call
  ``transfer.set_parts(n)`` once, then ``transfer.resolve_part(nbytes)`` per part that
  landed, or ``transfer.resolve_part(0, error)`` with a :class:`pdkv.PdkvError` (errors
  after ``post`` returns go through the transfer, never as exceptions). The
  transfer's deadline is ``transfer.remaining_s``.
* Notifications received go to ``hooks.deliver_notification(peer_name, data)`` (the
  ``hooks`` object ``start`` got), queued after every byte of their transfer landed. It
  raises :class:`pdkv.errors.ResourceExhausted` (nothing queued) when the agent's queue is
  full (``Agent(max_queued_notifs=, max_queued_notif_bytes=)``): fail the sender's
  transfer with it where the protocol can tell the sender.
* Threads of the transport must not call a blocking agent method that waits on
  something needing the GIL; the transport-side Transfer methods never block.
* ``shutdown`` fails everything in flight; the agent calls it once, then drops the object.

Register with :func:`register_transport` (one line, next to the class), with the
transport's options class if it has one (a class attribute ``transport`` names the
transport; ``pdkv.Agent(options=[MyOptions(...)])`` passes an instance, which the
factory receives); the agent creates one instance per :class:`pdkv.Agent` that
enables the transport.
"""

from __future__ import annotations

from typing import Any, Callable

from . import _native
from .errors import NotSupported

__all__ = ["Transport", "register_transport", "EXTENT_COLUMNS", "HOST", "CUDA"]

#: Columns of the extents array ``prepare`` gets.
EXTENT_COLUMNS = ("local_addr", "len", "local_kind", "local_device", "remote_region", "remote_offset",
                  "remote_addr")
#: ``local_kind`` values and mem-kind bits of :class:`TransportCaps`.
HOST, CUDA = 0, 1


class Transport:
    """Base of transports written in Python (the methods the trampoline calls).

    Required: ``name`` (class attribute, the registry name), :meth:`caps`,
    :meth:`start`, :meth:`shutdown`, :meth:`can_reach`, :meth:`prepare`, :meth:`post`,
    :meth:`notify`, :meth:`drop_peer`. The others have working defaults.
    """

    name = ""

    def caps(self) -> Any:
        """A :class:`pdkv._pdkv.TransportCaps`, read once before :meth:`start`."""
        raise NotImplementedError

    def start(self, hooks: Any) -> None:
        """Called once, before anything else but :meth:`caps`; ``hooks`` is the
        agent's :class:`pdkv._pdkv.AgentHooks` (valid until :meth:`shutdown` returns)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Fails everything in flight (PeerConnectionError "agent shutting down") and
        stops the transport's threads."""
        raise NotImplementedError

    def endpoints(self) -> list[tuple[str, str]]:
        """``(transport, address)`` pairs published in the agent's metadata."""
        return []

    def metadata_extra(self) -> bytes:
        """Bytes published under this transport's name (``peer.md.extra(name)``)."""
        return b""

    def can_reach(self, peer_md: Any) -> bool:
        """Whether a peer (its :class:`pdkv._pdkv.AgentMetadata`) is reachable from here."""
        raise NotImplementedError

    def prepare(self, peer: Any, op: Any, extents: Any) -> Any:
        """Lays out a transfer of resolved, bounds-checked extents once; raise a
        :class:`pdkv.PdkvError` to refuse it."""
        raise NotImplementedError

    def post(self, prepared: Any, transfer: Any, notif: bytes) -> None:
        """Starts a prepared transfer; completes ``transfer`` (see the module docstring).
        ``notif`` (may be empty: none) reaches the peer after every byte landed."""
        raise NotImplementedError

    def notify(self, peer: Any, transfer: Any, notif: bytes) -> None:
        """Sends a notification alone; resolves the one part the agent declared."""
        raise NotImplementedError

    def connect(self, peer: Any, timeout_s: float) -> None:
        """Opens connections now instead of on first use (optional)."""

    def drop_peer(self, name: str) -> None:
        """Forgets a peer; its in-flight transfers fail with PeerConnectionError."""
        raise NotImplementedError

    def region_added(self, region: dict) -> None:
        """A region was registered (``id, addr, len, kind, device, remote_access``)."""

    def region_removed(self, region: dict) -> None:
        """A region is being removed; return once this transport no longer uses it."""

    def fetch_metadata(self, address: str, secret: bytes, timeout_s: float) -> bytes:
        """A remote agent's metadata by address (only with ``caps().serves_metadata``)."""
        raise NotSupported(f"transport {self.name!r} cannot fetch metadata")


def register_transport(name: str, create: Callable[[Any, Any], Transport], *, options: type | None = None,
                       description: str = "", priority: int | Callable[[], int] = 0,
                       viable: Callable[[], str | None] | None = None, metadata_via: str = "") -> None:
    """Adds a transport to the registry native transports register in.

    Parameters
    ----------
    name : str
        Registry name (``Agent(transports=[name])``); must equal ``create(...).name``.
    create : callable
        ``create(config, options) -> Transport``, called once per agent enabling it:
        ``config`` is the agent's :class:`pdkv._pdkv.AgentConfig` (``config.name`` its
        name), ``options`` the instance of ``options`` the caller of :class:`pdkv.Agent`
        gave (``options=[...]``), else ``options()``; None when the transport has no
        options class.
    options : type, optional
        The transport's options class: constructible with no arguments (the defaults),
        with a class attribute ``transport = name``, and optionally ``validate()``
        raising :class:`pdkv.errors.InvalidArgument` naming a bad field (the agent calls
        it before creating the transport). An agent given options of another class for
        this transport refuses them.
    priority : int or callable
        Place in the default transport order (highest first); 0: enabled only when
        named. Native: cuda_ipc 300, shm 200, tcp 100. A callable returning it makes
        the priority depend on the host (asked whenever a default order is made).
    viable : callable, optional
        ``viable() -> None`` if the transport can run on this host, else the reason
        (a str). It is not enabled by default, and refused by name, where it cannot.
    metadata_via : str
        A transport this one exchanges metadata through (added to agents that enable
        this one without it), e.g. ``"tcp"``.

    Raises
    ------
    AlreadyExists
        A transport of that name is registered.
    InvalidArgument
        ``options`` is not a class naming this transport.
    """
    _native.module().register_transport(name, description, priority if callable(priority) else int(priority),
                                        viable or (lambda: None), create, metadata_via, options)
