"""The nixl transport's options (stdlib only: registered with its factory before NIXL
is imported; pdkv/backends/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import _validate
from ..errors import InvalidArgument
from ._nixl import PTHR_DELAY_US

__all__ = ["NixlOptions"]


@dataclass(frozen=True)
class NixlOptions:
    """Tuning of the nixl transport (``pdkv.Agent(..., options=[NixlOptions(...)])``).

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
        Introducing a peer to NIXL (on the first prepare, notify or warm-up after
        ``add_peer``) waits this long for the peer's handshake answer.
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

    #: The transport these options configure (the registry name).
    transport: ClassVar[str] = "nixl"

    pthr_delay_us: int = PTHR_DELAY_US
    poll_min_s: float = 100e-6
    poll_busy_max_s: float = 1e-3
    poll_idle_max_s: float = 10e-3
    wait_spin_s: float = 200e-6
    handshake_timeout_s: float = 5.0
    revoke_timeout_s: float = 5.0
    max_idle_requests: int = 4
    restart_probe_s: float = 1.0

    def validate(self) -> None:
        """Raises InvalidArgument naming the first field of the wrong type or out of range."""
        if not isinstance(self.pthr_delay_us, int) or isinstance(self.pthr_delay_us, bool):
            raise InvalidArgument(f"nixl.pthr_delay_us must be an int, got {self.pthr_delay_us!r}")
        for f in ("poll_min_s", "poll_busy_max_s", "poll_idle_max_s", "handshake_timeout_s", "revoke_timeout_s",
                  "restart_probe_s"):
            if getattr(self, f) is None or _validate.timeout(getattr(self, f), f"nixl.{f}") is None:
                raise InvalidArgument(f"nixl.{f} must be a finite number of seconds > 0, got None")
        if _validate.wait_timeout(self.wait_spin_s, "nixl.wait_spin_s") is None:
            raise InvalidArgument("nixl.wait_spin_s must be a finite number of seconds >= 0, got None")
        _validate.count(self.max_idle_requests, "nixl.max_idle_requests")
