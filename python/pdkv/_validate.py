"""One validation layer for the public API's scalar arguments.

Every public entry point (``Agent``, ``PreparedTransfer.post``, ``Transfer.wait``, the
nixl transport, ``plan_blocks``) passes its arguments through these functions before
anything reaches the native core, so a wrong type or value is an
:class:`~pdkv.errors.InvalidArgument` that names the argument, never a pybind11
``TypeError``/``RuntimeError`` or a silently reinterpreted value (``bytes(123)`` is 123
zero bytes). Block ids are checked once, in the native binding (``ids_from`` in
cpp/bindings/module.cc): integers only, bools and floats rejected, in range.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from .errors import InvalidArgument

__all__ = ["notification", "timeout", "wait_timeout", "count", "positive_int"]

def _is_int(v: Any) -> bool:
    """True for Python and numpy integers; False for bools (numpy's too) and floats."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def count(value: Any, what: str, *, maximum: int = 2**32 - 1) -> int:
    """A non-negative integer argument such as ``num_tokens`` or a head offset."""
    if not _is_int(value):
        raise InvalidArgument(f"{what} must be a non-negative integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < 0 or v > maximum:
        raise InvalidArgument(f"{what} must be between 0 and {maximum}, got {v}")
    return v


def positive_int(value: Any, what: str, *, maximum: int = 2**64 - 1) -> int:
    """A strictly positive integer (sizes, addresses)."""
    v = count(value, what, maximum=maximum)
    if v == 0:
        raise InvalidArgument(f"{what} must be positive, got 0")
    return v


def timeout(value: Any, what: str = "timeout") -> float | None:
    """A deadline in seconds: None (the default) or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_number(value):
        raise InvalidArgument(f"{what} must be a number of seconds or None, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise InvalidArgument(f"{what} must be a finite number of seconds > 0 (or None), got {value!r}")
    return v


def wait_timeout(value: Any, what: str = "timeout") -> float | None:
    """How long a wait may block: None (forever) or a finite number >= 0 (0 polls)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_number(value):
        raise InvalidArgument(f"{what} must be a number of seconds or None, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise InvalidArgument(f"{what} must be a finite number of seconds >= 0 (or None), got {value!r}")
    return v


def _is_number(v: Any) -> bool:
    # numpy scalars (np.float32(1.5), np.int64(3)) without importing numpy.
    return type(v).__module__ == "numpy" and hasattr(v, "__float__") and type(v).__name__ != "bool_"


def notification(value: Any, limit: int, what: str = "notify") -> bytes:
    """A notification payload: bytes-like or str (UTF-8), at most ``limit`` bytes.
    ``None`` is ``b""`` (no notification)."""
    if value is None:
        return b""
    if isinstance(value, str):
        data = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        raise InvalidArgument(f"{what} must be bytes or str, got {type(value).__name__} {value!r:.40}")
    if len(data) > limit:
        raise InvalidArgument(f"{what}: the notification is {len(data)} bytes, more than the limit of {limit} "
                              "bytes (Agent(max_notif_bytes=...))")
    return data
