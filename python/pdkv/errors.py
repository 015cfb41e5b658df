"""The pdkv exception hierarchy.

Every error raised by pdkv is a :class:`PdkvError`. Each C++ ``StatusCode`` maps to
exactly one subclass here (``error_class``); several also derive from the closest
builtin so that ``except TimeoutError`` or ``except ValueError`` work as expected.
"""

from __future__ import annotations

__all__ = [
    "PdkvError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "OutOfRange",
    "AuthFailed",
    "ProtocolError",
    "VersionMismatch",
    "StalePeer",
    "PeerConnectionError",
    "TransferTimeout",
    "Cancelled",
    "NotSupported",
    "ResourceExhausted",
    "InternalError",
    "StaleBlock",
    "DataCorrupted",
    "error_class",
]


class PdkvError(Exception):
    """Base class of every pdkv error. ``code`` is the C++ StatusCode name."""

    code = "Unknown"


class InvalidArgument(PdkvError, ValueError):
    """The caller passed something malformed or inconsistent."""

    code = "InvalidArgument"


class NotFound(PdkvError, LookupError):
    """Unknown region, layout, peer or transport."""

    code = "NotFound"


class AlreadyExists(PdkvError, ValueError):
    """Duplicate name or overlapping memory registration."""

    code = "AlreadyExists"


class OutOfRange(PdkvError, IndexError):
    """An offset, length or block id lies outside a region or layout."""

    code = "OutOfRange"


class AuthFailed(PdkvError, PermissionError):
    """Wrong secret, or the connection reached a different agent."""

    code = "AuthFailed"


class ProtocolError(PdkvError):
    """Malformed frame or metadata on the wire."""

    code = "ProtocolError"


class VersionMismatch(PdkvError):
    """Metadata or wire protocol of a version this pdkv does not speak."""

    code = "VersionMismatch"


class StalePeer(PdkvError):
    """The peer restarted: fetch its metadata again and re-add it."""

    code = "StalePeer"


class PeerConnectionError(PdkvError, ConnectionError):
    """The peer is unreachable, or the connection to it broke."""

    code = "ConnectionError"


class TransferTimeout(PdkvError, TimeoutError):
    """A transfer's deadline passed (the peer stalled or the link is too slow)."""

    code = "Timeout"


class Cancelled(PdkvError):
    """The transfer was cancelled by the caller."""

    code = "Cancelled"


class NotSupported(PdkvError, NotImplementedError):
    """The transport or this build lacks the capability."""

    code = "NotSupported"


class ResourceExhausted(PdkvError, MemoryError):
    """A queue or memory limit was hit."""

    code = "ResourceExhausted"


class InternalError(PdkvError):
    """A bug in pdkv; please report it with the message."""

    code = "Internal"


class StaleBlock(PdkvError):
    """A block named by the transfer was freed or reused since its generation was
    handed out (the owner bumped it): no byte of the transfer landed. Not retryable
    with the same block reference; ask the owner for fresh blocks."""

    code = "StaleBlock"


class DataCorrupted(PdkvError):
    """Bytes arrived but their end-to-end checksum (over the uncompressed data) does
    not match what the sender computed: corruption on the way or in memory."""

    code = "DataCorrupted"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        OutOfRange,
        AuthFailed,
        ProtocolError,
        VersionMismatch,
        StalePeer,
        PeerConnectionError,
        TransferTimeout,
        Cancelled,
        NotSupported,
        ResourceExhausted,
        InternalError,
        StaleBlock,
        DataCorrupted,
    )
}


def error_class(code: str) -> type[PdkvError]:
    """The exception class for a C++ ``StatusCode`` name (e.g. ``"Timeout"``)."""
    return _BY_CODE.get(code, PdkvError)
