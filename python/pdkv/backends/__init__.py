"""Transports written in Python, registered in the same registry as the native ones.

Each transport is one module here implementing :class:`pdkv.transport.Transport`, plus
one registration line below. A module is imported only when an agent enables its
transport (the factories import lazily), so ``import pdkv`` never loads NIXL.
"""

from __future__ import annotations

import importlib
import os

from .. import _native
from ..transport import register_transport


def rdma_device_present() -> bool:
    """True when the host has an RDMA device (InfiniBand, RoCE, EFA)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _nixl_viable() -> str | None:
    from ._nixl import nixl_installed  # stdlib only: NIXL itself is not imported here

    if not nixl_installed():
        return "it needs the nixl package: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
    return None


def _nixl_priority() -> int:
    # First by default only where RDMA makes it faster than tcp; usable anywhere when named.
    return 400 if rdma_device_present() else 0


def _nixl_options() -> type:
    from ._nixl_options import NixlOptions  # stdlib only: NIXL itself is not imported here

    return NixlOptions


def _create_nixl(config, options):
    from .nixl import NixlTransport

    # UCX stays on the loopback device when the agent's metadata channel (tcp) listens
    # on a loopback address: every peer it can meet is then on this host.
    tcp = next((o for o in config.options if getattr(o, "transport", "") == "tcp"), None)
    return NixlTransport(options, listen_host=tcp.listen_host if tcp is not None else "127.0.0.1")


def _load(module: str):
    """The module of a transport here, imported on first use (by its factory)."""
    return importlib.import_module(f"{__name__}.{module}")


if "nixl" not in _native.module().registered_transports():  # (a re-import registers nothing twice)
    register_transport("nixl", _create_nixl, options=_nixl_options(), description="RDMA through NIXL (UCX)",
                       priority=_nixl_priority, viable=_nixl_viable, metadata_via="tcp")
    from .example import LoopbackOptions  # (the class only; the module imports nothing heavy)

    register_transport("loopback", lambda config, options: _load("example").LoopbackTransport(options),
                       options=LoopbackOptions, description="example: memcpy between agents of one process")
