"""pdkv: KV-cache transfer for prefill/decode disaggregated LLM serving.

Core objects (see each one's docstring):

* :class:`Agent` — one endpoint per process: registers memory and KV layouts, meets
  peers (``connect("host:port")`` or ``add_peer(metadata)``), and moves blocks with
  asynchronous ``write``/``read`` that notify the peer once the bytes have landed.
* :class:`Blocks`, :class:`PlanOptions`, :class:`XferOptions`, :class:`StreamOptions` —
  what a transfer moves and how (``agent.write(peer, Blocks("kv", ids), Blocks("kv",
  remote_ids), plan=PlanOptions(num_tokens=40))``).
* :class:`KVGeometry`, :class:`KVLayout` — how a paged KV pool is laid out.
* :mod:`pdkv.errors` — the exception hierarchy (every error is a :class:`PdkvError`).

Importing pdkv needs neither torch, transformers, CUDA nor NIXL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .agent import Agent, Notification, XferState
from .errors import (
    AlreadyExists,
    AuthFailed,
    Cancelled,
    DataCorrupted,
    InvalidArgument,
    NotFound,
    NotSupported,
    OutOfRange,
    PdkvError,
    PeerConnectionError,
    ProtocolError,
    StaleBlock,
    StalePeer,
    TransferTimeout,
    VersionMismatch,
)
from .layout import KVGeometry, KVLayout, plan_blocks, tensor_address
from .region import Region, SharedRegion
from .tp import HeadRange, TPMapping, TPTransfer
from .transfer import PreparedTransfer, StreamingWrite, Transfer

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ._pdkv import Blocks, PlanOptions, ShmOptions, StreamOptions, TcpCompression, TcpOptions, XferOptions
    from .backends._nixl_options import NixlOptions


def __getattr__(name: str) -> Any:
    # TcpOptions and ShmOptions are native classes, loaded on first use so that
    # `import pdkv` loads no native code (see agent.py).
    if name in ("TcpOptions", "ShmOptions", "TcpCompression"):
        from . import agent

        return getattr(agent, name)
    if name in ("Blocks", "PlanOptions", "XferOptions", "StreamOptions"):  # likewise (see transfer.py)
        from . import transfer

        return getattr(transfer, name)
    if name == "NixlOptions":  # the nixl transport's (Python) options class; NIXL itself is not imported
        from .backends._nixl_options import NixlOptions

        return NixlOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Agent",
    "AlreadyExists",
    "AuthFailed",
    "Blocks",
    "Cancelled",
    "InvalidArgument",
    "HeadRange",
    "KVGeometry",
    "KVLayout",
    "NixlOptions",
    "NotFound",
    "NotSupported",
    "Notification",
    "OutOfRange",
    "PlanOptions",
    "PdkvError",
    "PeerConnectionError",
    "PreparedTransfer",
    "ProtocolError",
    "Region",
    "SharedRegion",
    "ShmOptions",
    "StaleBlock",
    "DataCorrupted",
    "StalePeer",
    "TcpOptions",
    "TcpCompression",
    "StreamOptions",
    "StreamingWrite",
    "TPMapping",
    "TPTransfer",
    "Transfer",
    "TransferTimeout",
    "VersionMismatch",
    "XferOptions",
    "XferState",
    "available_transports",
    "decode_metadata",
    "plan_blocks",
    "set_thread_cpus",
    "tensor_address",
    "thread_cpus",
]


def available_transports() -> list[str]:
    """Transports usable on this host: every registered one (native, and Python ones
    such as ``nixl`` whose library is installed) that is viable here."""
    from . import _native, backends  # noqa: F401 - backends registers the Python transports

    return _native.module().available_transports()


def set_thread_cpus(cpus) -> None:
    """Puts every thread pdkv starts from now on (progress, copy, codec, staging
    threads of agents created or connecting later) on these CPUs.

    By default a pdkv thread inherits the affinity of the thread that starts it, so an
    engine that pins its worker thread to a core (vLLM's CPU backend, OpenMP binding)
    gets pdkv's threads on that core too, behind its compute. Give them their own
    cores instead, before creating the agent (threads already running keep theirs).
    Process-wide.

    Parameters
    ----------
    cpus : iterable of int, or None
        CPU numbers (as ``os.sched_getaffinity`` lists them); ``None`` or empty: inherit
        again (the default).

    Raises
    ------
    InvalidArgument
        A CPU that is not an int, out of range, or a set the kernel refuses for this
        process (offline, outside its cpuset); nothing changes then.
    """
    from . import _native

    if cpus is None:
        cpus = []
    if isinstance(cpus, (str, bytes)) or not hasattr(cpus, "__iter__"):
        raise InvalidArgument(f"cpus must be an iterable of CPU numbers or None, got {cpus!r}")
    out = []
    for c in cpus:
        if isinstance(c, bool) or not isinstance(c, int):
            raise InvalidArgument(f"cpus: {c!r} is not a CPU number (int)")
        if c < 0 or c >= 1 << 20:
            raise InvalidArgument(f"cpus: CPU {c} is out of range")
        out.append(int(c))
    _native.module().set_thread_cpus(out)


def thread_cpus() -> list[int]:
    """The CPUs :func:`set_thread_cpus` put pdkv's new threads on (sorted), or ``[]``
    when they inherit their starter's affinity (the default)."""
    from . import _native

    return list(_native.module().thread_cpus())


def decode_metadata(blob: bytes) -> dict:
    """Decodes an agent's metadata blob into a dict (for inspection and debugging)."""
    from . import _native

    return _native.module().decode_metadata(bytes(blob))
