"""Transports implemented in Python on top of another library (NIXL).

A Python transport plugs into :class:`pdkv.Agent` through :class:`PyTransport`:
the agent keeps doing memory registration, layouts, planning and metadata, and
hands the transport resolved byte extents ``(local_addr, remote_addr, nbytes)``.
Notifications it receives go into the agent's queue (``agent._n.push_notification``)
so ``wait_notifications``/``notification_fd`` work the same for every transport.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ..agent import Agent, PreparedTransfer, Region, Transfer

# name -> "module:Class"; each module imports its library lazily.
PY_TRANSPORTS = {"nixl": "pdkv.backends.nixl:NixlTransport"}
# The Python package each needs, for availability checks without importing it.
_REQUIRES = {"nixl": "nixl"}


def py_transport_available(name: str) -> bool:
    mod = _REQUIRES.get(name)
    return mod is not None and importlib.util.find_spec(mod) is not None


def rdma_device_present() -> bool:
    """True when the host has an RDMA device (InfiniBand, RoCE, EFA)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def create(name: str, options: Any = None) -> "PyTransport":
    mod_name, cls_name = PY_TRANSPORTS[name].split(":")
    cls = getattr(importlib.import_module(mod_name), cls_name)
    return cls(options)


class PyTransport:
    """Interface of a transport implemented in Python. See the module docstring."""

    name = ""

    def start(self, agent: "Agent") -> None:
        """Called once by the agent, before any other method."""
        raise NotImplementedError

    def close(self) -> None:
        """Fail in-flight transfers and release everything (called by Agent.close)."""
        raise NotImplementedError

    def metadata_extra(self) -> bytes:
        """Bytes published in the agent's metadata under this transport's name."""
        raise NotImplementedError

    def can_reach(self, peer_md: dict) -> bool:
        """Whether a peer (its decoded metadata, ``peer_md["extras"]`` included) is reachable."""
        raise NotImplementedError

    def add_peer(self, name: str, peer_md: dict, secret: bytes) -> None:
        raise NotImplementedError

    def remove_peer(self, name: str) -> None:
        raise NotImplementedError

    def on_register(self, region: "Region") -> None:
        """A region was registered with the agent."""
        raise NotImplementedError

    def on_deregister(self, region: "Region") -> None:
        """A region is being deregistered; return once the transport no longer uses it."""
        raise NotImplementedError

    def prepare(self, op: str, peer: str, extents: Sequence[tuple[int, int, int]]) -> "PreparedTransfer":
        """Lays out a transfer of absolute ``(local_addr, remote_addr, nbytes)`` extents
        (the agent passes a ``[n, 3]`` int64 numpy array, already bounds-checked).

        The result must behave like :class:`pdkv.PreparedTransfer` (``post(notify=, timeout=)``
        returning a :class:`pdkv.Transfer`-like handle, ``nbytes``, ``num_extents``,
        ``peer``, ``transport``).
        """
        raise NotImplementedError

    def notify(self, peer: str, data: bytes, timeout: float | None) -> "Transfer":
        raise NotImplementedError
