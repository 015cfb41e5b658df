"""``loopback``: the example transport, written against :class:`pdkv.transport.Transport`.

It moves bytes with ``memmove`` between agents of one process, so it needs no network
and no library, and shows every duty of a transport in one page: capabilities, what it
publishes in metadata, which peers it reaches, preparing once and posting many times,
completing the native transfer part by part, delivering notifications after the data,
checking inbound access against what the target exports now, failing transfers to a
dead peer, and making deregistration wait for copies in progress. It is registered
with priority 0 (``pdkv/backends/__init__.py``): only agents that name it use it,
together with its options class (:class:`LoopbackOptions`; ``pdkv.Agent(...,
transports=["loopback"], options=[LoopbackOptions(max_extents=...)])``), which its
factory receives. The conformance suite (tests/library/test_conformance.py) runs against it
like against tcp. (The C++ example beside it: cpp/src/transport/example/.)
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import _native
from ..errors import InvalidArgument, NotFound, OutOfRange, PdkvError, PeerConnectionError
from ..transport import HOST, Transport

# The live transports of this process, by agent instance id: a peer that is not here
# is dead (its agent closed).
_LIVE: dict[int, "LoopbackTransport"] = {}
_LIVE_LOCK = threading.Lock()


@dataclass(frozen=True)
class LoopbackOptions:
    """Options of the ``loopback`` transport (registered with its factory).

    Attributes
    ----------
    max_extents : int
        A transfer of more extents is refused at prepare (InvalidArgument): each extent
        is one ``memmove`` under the target's lock (1..2**32-1).
    """

    #: The transport these options configure (the registry name).
    transport: ClassVar[str] = "loopback"

    max_extents: int = 1 << 20

    def validate(self) -> None:
        """Raises InvalidArgument naming the field out of range."""
        if isinstance(self.max_extents, bool) or not isinstance(self.max_extents, int) or \
                not 1 <= self.max_extents < 2**32:
            raise InvalidArgument(f"loopback.max_extents must be an integer in 1..2**32-1, got {self.max_extents!r}")


class LoopbackTransport(Transport):
    """Copies between agents of this process. Thread-safe (one lock per agent guards
    its exported regions and every copy into or out of them)."""

    name = "loopback"

    def __init__(self, options: LoopbackOptions | None = None) -> None:
        self._opts = options or LoopbackOptions()
        self._lock = threading.Lock()
        self._exported: dict[int, tuple[int, int]] = {}  # region id -> (addr, len)

    def caps(self) -> Any:
        bit = 1 << HOST
        return _native.module().TransportCaps(cross_host=False, local_mem_kinds=bit, remote_mem_kinds=bit)

    def start(self, hooks: Any) -> None:
        self._hooks = hooks
        self._agent = hooks.agent_name
        self._instance = hooks.instance_id
        with _LIVE_LOCK:
            _LIVE[self._instance] = self

    def shutdown(self) -> None:
        # Copies are synchronous: nothing is in flight once this agent is unlisted.
        with _LIVE_LOCK:
            _LIVE.pop(self._instance, None)
        with self._lock:
            self._exported.clear()

    def metadata_extra(self) -> bytes:
        return f"pid={os.getpid()}".encode()

    def can_reach(self, peer_md: Any) -> bool:
        return peer_md.extra(self.name) == self.metadata_extra()

    # -------------------------------------------------------------- memory
    def region_added(self, region: dict) -> None:
        if region["remote_access"]:
            with self._lock:
                self._exported[region["id"]] = (region["addr"], region["len"])

    def region_removed(self, region: dict) -> None:
        with self._lock:  # waits for a copy into or out of it in progress
            self._exported.pop(region["id"], None)

    # -------------------------------------------------------------- transfers
    def prepare(self, peer: Any, op: Any, extents: Any) -> tuple:
        if len(extents) > self._opts.max_extents:
            raise InvalidArgument(f"loopback: {len(extents)} extents exceed loopback.max_extents "
                                  f"({self._opts.max_extents})")
        rows = [(int(r[0]), int(r[4]), int(r[5]), int(r[1])) for r in extents.tolist()]
        return peer.md.instance_id, peer.name, op == _native.module().OpKind.WRITE, rows

    def post(self, prepared: tuple, transfer: Any, notif: bytes) -> None:
        instance, peer, write, rows = prepared
        transfer.set_parts(1)
        target = self._target(instance, peer)
        if isinstance(target, Exception):
            transfer.resolve_part(0, target)
            return
        err = target._copy(rows, write)
        if err is not None:
            transfer.resolve_part(0, err)
            return
        if notif:  # after every byte landed (copies are synchronous)
            try:
                target._hooks.deliver_notification(self._agent, notif)
            except PdkvError as e:  # the target's queue is full: this transfer fails with it
                transfer.resolve_part(0, e)
                return
        transfer.resolve_part(sum(r[3] for r in rows))

    def notify(self, peer: Any, transfer: Any, notif: bytes) -> None:
        target = self._target(peer.md.instance_id, peer.name)
        if isinstance(target, Exception):
            transfer.resolve_part(0, target)
            return
        try:
            target._hooks.deliver_notification(self._agent, notif)
        except PdkvError as e:  # the target's queue is full
            transfer.resolve_part(0, e)
            return
        transfer.resolve_part(0)

    def drop_peer(self, name: str) -> None:
        pass  # no connections to close; transfers are never in flight after post()

    def _target(self, instance: int, peer: str) -> "LoopbackTransport | Exception":
        with _LIVE_LOCK:
            target = _LIVE.get(instance)
        if target is None:
            return PeerConnectionError(f"peer {peer!r} is gone (its agent closed)")
        return target

    def _copy(self, rows: list, write: bool) -> Exception | None:
        """Copies into (write) or out of this agent's exported regions, checking each
        access against what it exports now (the initiator checked its metadata)."""
        with self._lock:
            for i, (local_addr, region, offset, n) in enumerate(rows):
                r = self._exported.get(region)
                if r is None:
                    return NotFound(f"region {region} is not exported any more")
                if offset + n > r[1]:
                    return OutOfRange(f"extent {i}: bytes [{offset}, +{n}) fall outside region {region}")
                if write:
                    ctypes.memmove(r[0] + offset, local_addr, n)
                else:
                    ctypes.memmove(local_addr, r[0] + offset, n)
        return None
