"""What the nixl transport puts on the wire: its metadata extra (``extras["nixl"]``) and
its control messages (NIXL notifications tagged ``C``), with their size limits and
validation (docs/wire.md "nixl control messages"; fuzzed by tests/library/nixl/test_nixl_ctl.py)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import struct
from typing import Any, Sequence

from ..errors import ProtocolError


def nixl_agent_name(name: str, instance_id: int) -> str:
    """The NIXL agent name of a pdkv agent: unique per agent *instance*, so a restarted
    peer (same pdkv name) never collides with its predecessor inside NIXL."""
    return f"{name}#{instance_id:016x}"


def _pdkv_name(nixl_name: str) -> str:
    return nixl_name.rpartition("#")[0] or nixl_name  # pdkv names never contain spaces; '#' may


# ---------------------------------------------------------------------------- metadata
_MAGIC = b"PDKVNIXL"
_VERSION = 1


def _encode_extra(nixl_name: str, mds: Sequence[bytes]) -> bytes:
    """``extras["nixl"]``: magic, version, NIXL agent name, NIXL metadata blobs, sha256."""
    name = nixl_name.encode()
    out = [_MAGIC, struct.pack("<HH", _VERSION, len(name)), name, struct.pack("<H", len(mds))]
    for md in mds:
        out += [struct.pack("<I", len(md)), md]
    body = b"".join(out)
    return body + hashlib.sha256(body).digest()


def _decode_extra(blob: bytes) -> tuple[str, list[bytes]]:
    """Inverse of :func:`_encode_extra`; raises ProtocolError on anything malformed
    (NIXL's own deserializer never sees bytes that fail the checksum)."""
    if len(blob) < len(_MAGIC) + 6 + 32 or not blob.startswith(_MAGIC):
        raise ProtocolError("nixl metadata extra: bad magic or truncated")
    body, digest = blob[:-32], blob[-32:]
    if not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
        raise ProtocolError("nixl metadata extra: checksum mismatch (corrupted metadata)")
    version, nlen = struct.unpack_from("<HH", body, len(_MAGIC))
    if version != _VERSION:
        from ..errors import VersionMismatch

        raise VersionMismatch(f"nixl metadata extra version {version} (this pdkv speaks {_VERSION})")
    pos = len(_MAGIC) + 4
    try:
        name = body[pos:pos + nlen].decode()
        pos += nlen
        (count,) = struct.unpack_from("<H", body, pos)
        pos += 2
        mds = []
        for _ in range(count):
            (n,) = struct.unpack_from("<I", body, pos)
            pos += 4
            if pos + n > len(body):
                raise ProtocolError("nixl metadata extra: length past the end")
            mds.append(body[pos:pos + n])
            pos += n
    except (struct.error, UnicodeDecodeError) as e:
        raise ProtocolError(f"nixl metadata extra: {e}") from None
    if pos != len(body) or not name:
        raise ProtocolError("nixl metadata extra: trailing bytes or empty name")
    return name, mds


# Every NIXL notification between pdkv agents starts with a tag byte: user data, or a
# control message of the transport's own protocol (JSON; control path only).
log = logging.getLogger("pdkv.nixl")

_USER = b"U"
_CTL = b"C"


def _ctl(**msg: Any) -> bytes:
    return _CTL + json.dumps(msg, separators=(",", ":")).encode()


# Limits on control messages from a peer (NIXL notifications starting with _CTL),
# checked before they are parsed; docs/wire.md "nixl control messages".
_MAX_CTL_BYTES = 64 << 10            # every kind but hello
_MAX_HELLO_BYTES = 64 << 20          # hello carries the peer's NIXL metadata (base64)
_MAX_REVOKE_REGIONS = 4096
_MAX_CTL_TEXT = 4096                 # hello-ack error, mac
_U63 = (1 << 63) - 1
# kind -> {field: type}; every field is required, no other field is accepted.
_CTL_SCHEMA: dict[str, dict[str, type]] = {
    # The handshake (pdkv/spi/auth.h through the bindings): hello -> challenge -> proof
    # -> hello-ack; nonces, keys and MACs are hex.
    "hello": {"epoch": int, "md": str, "nonce": str, "pub": str},
    "challenge": {"epoch": int, "nonce": str, "pub": str},
    "proof": {"epoch": int, "mac": str},
    "hello-ack": {"epoch": int, "error": str, "mac": str},
    "bye": {"epoch": int},
    "revoke": {"regions": list, "seq": int},
    "revoke-ack": {"seq": int},
}


def _parse_ctl(raw: bytes) -> dict[str, Any]:
    """Decodes and validates one control message (without its _CTL prefix).

    Raises ProtocolError naming the problem: over its size limit (checked before
    parsing), not JSON, not an object, unknown kind, a missing, extra or mistyped
    field, an integer outside [0, 2**63), a string over its limit, a revoke naming
    too many regions.
    """
    limit = _MAX_HELLO_BYTES if raw.startswith(b'{"k":"hello",') else _MAX_CTL_BYTES
    if len(raw) > limit:
        raise ProtocolError(f"nixl control message of {len(raw)} bytes (limit {limit})")
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested input
        raise ProtocolError(f"nixl control message is not JSON: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("nixl control message is not an object")
    kind = msg.get("k")
    schema = _CTL_SCHEMA.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"nixl control message of unknown kind {str(kind)[:32]!r}")
    if set(msg) != {"k", *schema}:
        raise ProtocolError(f"nixl {kind} message has fields {sorted(msg)[:8]}, expected {['k', *sorted(schema)]}")
    for field, typ in schema.items():
        v = msg[field]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ProtocolError(f"nixl {kind} message: {field} is not {typ.__name__}")
        if typ is int and not 0 <= v <= _U63:
            raise ProtocolError(f"nixl {kind} message: {field} out of range")
        if typ is str and field != "md" and len(v) > _MAX_CTL_TEXT:
            raise ProtocolError(f"nixl {kind} message: {field} longer than {_MAX_CTL_TEXT}")
    if kind == "revoke":
        ids = msg["regions"]
        if not 0 < len(ids) <= _MAX_REVOKE_REGIONS:
            raise ProtocolError(f"nixl revoke names {len(ids)} regions (1 to {_MAX_REVOKE_REGIONS})")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _U63 for i in ids):
            raise ProtocolError("nixl revoke: region ids must be integers in [0, 2**63)")
    return msg


# The nixl handshake's transcript names the transport and this version of it.
_HS_TRANSPORT = "nixl"
_HS_VERSION = 2


def _hex32(msg: dict[str, Any], field: str) -> bytes:
    """A 32-byte value sent as 64 hex digits, or ProtocolError."""
    v = msg[field]
    try:
        b = bytes.fromhex(v)
    except ValueError:
        b = b""
    if len(b) != 32:
        raise ProtocolError(f"nixl {msg['k']} message: {field} is not 64 hex digits")
    return b
