"""``XferState``: the lifecycle of a transfer (one definition for every transport).

The C++ core owns the state of every transfer (``pdkv::XferState``, bound as
``pdkv._pdkv.XferState``); this enum is its Python face, member for member (same names,
mapped by name, checked by tests/library/test_conformance.py). It lives in a module of its own
so that the agent and transports written in Python can both import it.
"""

from __future__ import annotations

import enum
from typing import Any

from . import _native

__all__ = ["XferState", "from_native"]


class XferState(enum.Enum):
    """Lifecycle of a transfer."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_BY_NATIVE: dict[Any, XferState] = {}


def from_native(state: Any) -> XferState:
    """The :class:`XferState` of a bound ``_pdkv.XferState`` value."""
    if not _BY_NATIVE:
        for name, value in _native.module().XferState.__members__.items():
            _BY_NATIVE[value] = XferState[name]
    return _BY_NATIVE[state]
