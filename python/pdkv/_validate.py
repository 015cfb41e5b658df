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

__all__ = ["notification", "timeout", "wait_timeout", "count", "positive_int", "flag", "text", "block_ids", "extents"]

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


def flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be True or False, got {type(value).__name__} {value!r}")
    return value


def text(value: Any, what: str) -> str:
    """A name argument (peer, layout, address)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, got {type(value).__name__} {value!r:.40}")
    return value


def block_ids(ids: Any, what: str) -> Any:
    """Block ids as the native binding takes them (it checks every element: integers,
    in range): arrays and sized sequences as they are, other iterables (generators)
    materialized once."""
    if hasattr(ids, "__array_interface__") or hasattr(ids, "__len__"):
        return ids
    try:
        return list(ids)
    except TypeError:
        raise InvalidArgument(f"{what} must be a sequence of integer block ids, got {type(ids).__name__}") from None


def extents(value: Any) -> list[tuple[int, int, int, int, int]]:
    """Raw extents as 5-tuples of non-negative ints (a float offset must not be
    truncated into another byte). Needs no numpy; a numpy array is checked by dtype."""
    shape = "(local_region, local_offset, remote_region, remote_offset, nbytes) tuples of integers"
    ai = getattr(value, "__array_interface__", None)
    if ai is not None:
        if ai["typestr"][1] not in "iu" or len(ai["shape"]) != 2 or ai["shape"][1] != 5:
            raise InvalidArgument(f"extents must be {shape}, got an array of shape {ai['shape']} and "
                                  f"type {ai['typestr']}")
        value = value.tolist()
    try:
        rows = iter(value)
    except TypeError:
        raise InvalidArgument(f"extents must be {shape}, got {type(value).__name__}") from None
    out = []
    for i, e in enumerate(rows):
        try:
            row = tuple(e)
        except TypeError:
            row = ()
        if len(row) != 5 or not all(type(x) is int or _is_int(x) for x in row):
            raise InvalidArgument(f"extent {i} must be one of {shape}, got {e!r:.80}")
        row = tuple(int(x) for x in row)
        if min(row) < 0:
            raise InvalidArgument(f"extent {i} has a negative field: {row}")
        out.append(row)
    return out
