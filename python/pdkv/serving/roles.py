"""What a serving worker does, and what registration and role switching need of one.

Kept apart from :mod:`pdkv.serving.worker` so that :mod:`pdkv.serving.discovery` (which
the worker uses to register and switch roles) depends on this small contract, not on
the worker.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Protocol

__all__ = ["RoleSwitchable", "WorkerRole"]


class WorkerRole(str, enum.Enum):
    """What a worker does."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class RoleSwitchable(Protocol):
    """The parts of a worker (:class:`pdkv.serving.worker.Worker`) that its registration,
    drain and role switch (:mod:`pdkv.serving.discovery`) read or call."""

    url: str
    config: Any  # WorkerConfig: its model_name and capacity
    engine: Any  # the Engine, or None before start
    registration: Optional[Any]  # its WorkerRegistration, when registered
    _in_flight: int  # requests between arrival and answer

    @property
    def role(self) -> WorkerRole: ...

    def switch_role(self, role: WorkerRole) -> None: ...
