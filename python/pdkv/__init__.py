"""pdkv: KV-cache transfer for prefill/decode disaggregated LLM serving.

Core objects (see each one's docstring):

* :class:`Agent` — one endpoint per process: registers memory and KV layouts, meets
  peers (``connect("host:port")`` or ``add_peer(metadata)``), and moves blocks with
  asynchronous ``write``/``read`` that notify the peer once the bytes have landed.
* :class:`KVGeometry`, :class:`KVLayout` — how a paged KV pool is laid out.
* :mod:`pdkv.errors` — the exception hierarchy (every error is a :class:`PdkvError`).

Importing pdkv needs neither torch, transformers, CUDA nor NIXL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .agent import (
    Agent,
    Notification,
    PreparedTransfer,
    Region,
    SharedRegion,
    StreamingWrite,
    Transfer,
    XferState,
)
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
from .tp import HeadRange, TPMapping, TPTransfer

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ._pdkv import ShmOptions, TcpCompression, TcpOptions


def __getattr__(name: str) -> Any:
    # TcpOptions and ShmOptions are native classes, loaded on first use so that
    # `import pdkv` loads no native code (see agent.py).
    if name in ("TcpOptions", "ShmOptions", "TcpCompression"):
        from . import agent

        return getattr(agent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Agent",
    "AlreadyExists",
    "AuthFailed",
    "Cancelled",
    "InvalidArgument",
    "HeadRange",
    "KVGeometry",
    "KVLayout",
    "NotFound",
    "NotSupported",
    "Notification",
    "OutOfRange",
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
    "StreamingWrite",
    "TPMapping",
    "TPTransfer",
    "Transfer",
    "TransferTimeout",
    "VersionMismatch",
    "XferState",
    "available_transports",
    "decode_metadata",
    "plan_blocks",
    "tensor_address",
]


def available_transports() -> list[str]:
    """Transports usable on this host: every registered one (native, and Python ones
    such as ``nixl`` whose library is installed) that is viable here."""
    from . import _native, backends  # noqa: F401 - backends registers the Python transports

    return _native.module().available_transports()


def decode_metadata(blob: bytes) -> dict:
    """Decodes an agent's metadata blob into a dict (for inspection and debugging)."""
    from . import _native

    return _native.module().decode_metadata(bytes(blob))
