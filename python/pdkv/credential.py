"""The cluster credential: proving knowledge of the cluster secret without sending it.

Every control-plane message that must come from a member of the cluster (a worker's
``/pd/*`` HTTP call, an etcd registration) carries an HMAC-SHA256 over its fields,
keyed with a key derived from the cluster secret for that one *purpose*. The secret
itself never leaves the process.

Key derivation::

    master  = PBKDF2-HMAC-SHA256(secret, salt="pdkv cluster credential v1", 20000 rounds)
    key(p)  = HMAC-SHA256(master, "pdkv purpose v1\\0" + p)

The slow master derivation is done once per secret per process (cached); it makes
each offline guess of a weak secret from a captured MAC cost 20,000 HMACs. It is a
mitigation, not a substitute for a random secret: use :func:`new_secret` (128 bits).
Per-purpose keys keep a MAC made for one purpose (say, an HTTP call) from being
accepted for another (an etcd record).

Rotation: a :class:`Credential` signs with its first secret and accepts a MAC made
with any of its secrets. Rotate a cluster in three steps: add the new secret to
every member's accepted list; make it everyone's first secret; drop the old one.

Thread safety: a Credential is immutable after construction; safe from any thread.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets as _secrets
import struct
from typing import Iterable, Sequence, Union

from .errors import InvalidArgument

__all__ = ["Credential", "new_secret", "SECRET_ENV", "ACCEPTED_ENV", "MAX_SECRET_BYTES"]

#: Environment variable holding the secret a process proves with.
SECRET_ENV = "PDKV_SECRET"
#: Environment variable holding further accepted secrets (comma separated), for rotation.
ACCEPTED_ENV = "PDKV_ACCEPTED_SECRETS"
#: Longest secret accepted (bytes), the same bound as the native agent's.
MAX_SECRET_BYTES = 1024
#: Most secrets one credential accepts at once.
MAX_SECRETS = 8

_SALT = b"pdkv cluster credential v1"
_ROUNDS = 20000

Secret = Union[str, bytes]


def new_secret() -> str:
    """A fresh random cluster secret (128 bits, hex)."""
    return _secrets.token_hex(16)


def _as_bytes(s: Secret, what: str) -> bytes:
    if isinstance(s, str):
        b = s.encode()
    elif isinstance(s, (bytes, bytearray, memoryview)):
        b = bytes(s)
    else:
        raise InvalidArgument(f"{what} must be str or bytes, not {type(s).__name__}")
    if not b:
        raise InvalidArgument(f"{what} is empty")
    if len(b) > MAX_SECRET_BYTES:
        raise InvalidArgument(f"{what} is longer than {MAX_SECRET_BYTES} bytes ({len(b)})")
    return b


@functools.lru_cache(maxsize=64)
def _master(secret: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret, _SALT, _ROUNDS)


def _fields(fields: Iterable[Union[bytes, str, int]]) -> bytes:
    """Length-prefixed concatenation: no two field lists encode alike."""
    out = bytearray()
    for f in fields:
        if isinstance(f, int) and not isinstance(f, bool):
            f = str(f)
        if isinstance(f, str):
            f = f.encode()
        if not isinstance(f, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"cannot sign a field of type {type(f).__name__}")
        f = bytes(f)
        out += struct.pack("<Q", len(f)) + f
    return bytes(out)


class Credential:
    """The secret this process proves with, and the secrets it accepts.

    Parameters
    ----------
    secret : str or bytes
        The secret this process signs with (its first secret).
    accepted : sequence of str or bytes, optional
        Further secrets whose MACs are accepted (rotation). Duplicates are ignored.

    Examples
    --------
    >>> c = Credential("s3cret")
    >>> mac = c.sign("http", "POST", "/pd/role", b"{}")
    >>> c.verify("http", mac, "POST", "/pd/role", b"{}")
    True
    >>> c.verify("etcd", mac, "POST", "/pd/role", b"{}")
    False
    """

    __slots__ = ("_secrets", "_keys")

    def __init__(self, secret: Secret, accepted: Sequence[Secret] = ()) -> None:
        if isinstance(accepted, (str, bytes)):
            raise InvalidArgument("accepted must be a sequence of secrets, not one secret")
        first = _as_bytes(secret, "the cluster secret")
        all_ = [first]
        for i, s in enumerate(accepted):
            b = _as_bytes(s, f"accepted secret {i}")
            if b not in all_:
                all_.append(b)
        if len(all_) > MAX_SECRETS:
            raise InvalidArgument(f"at most {MAX_SECRETS} secrets may be accepted at once ({len(all_)} given)")
        self._secrets = tuple(all_)
        self._keys: dict = {}

    @classmethod
    def from_env(cls, secret: Secret | None = None, accepted: Sequence[Secret] | None = None) -> "Credential | None":
        """The credential from arguments, else from ``PDKV_SECRET`` / ``PDKV_ACCEPTED_SECRETS``.

        Returns None when no secret is given either way.
        """
        s = secret if secret else os.environ.get(SECRET_ENV)
        if not s:
            return None
        if accepted is None:
            raw = os.environ.get(ACCEPTED_ENV, "")
            accepted = [a for a in (x.strip() for x in raw.split(",")) if a]
        return cls(s, accepted)

    @property
    def secret(self) -> bytes:
        """The secret this process proves with (never send it anywhere)."""
        return self._secrets[0]

    @property
    def accepted(self) -> tuple:
        """Every accepted secret, the signing one first."""
        return self._secrets

    def _key(self, secret: bytes, purpose: str) -> bytes:
        k = (secret, purpose)
        key = self._keys.get(k)
        if key is None:
            key = hmac.new(_master(secret), b"pdkv purpose v1\0" + purpose.encode(), hashlib.sha256).digest()
            self._keys[k] = key
        return key

    def sign(self, purpose: str, *fields: Union[bytes, str, int]) -> str:
        """HMAC-SHA256 (hex) of ``fields`` under this credential's first secret, for ``purpose``."""
        return hmac.new(self._key(self._secrets[0], purpose), _fields(fields), hashlib.sha256).hexdigest()

    def verify(self, purpose: str, mac: str, *fields: Union[bytes, str, int]) -> bool:
        """Whether ``mac`` was made by :meth:`sign` with any accepted secret (constant time per secret)."""
        if not isinstance(mac, str) or len(mac) != 64:
            return False
        data = _fields(fields)
        ok = False
        for s in self._secrets:
            good = hmac.new(self._key(s, purpose), data, hashlib.sha256).hexdigest()
            ok |= hmac.compare_digest(good, mac)
        return ok

    def __repr__(self) -> str:  # never the secrets themselves
        return f"Credential({len(self._secrets)} secret(s))"
