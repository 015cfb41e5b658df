"""Discovery through etcd: agents and serving workers publish themselves under keys
bound to a lease they keep alive; peers and proxies look them up or watch them.

pdkv speaks etcd's v3 JSON gateway (``POST /v3/kv/put`` and friends, keys and values
base64-encoded) with the standard library only, so discovery needs no extra package.
etcd 3.4 serves the gateway under both ``/v3/`` and ``/v3beta/``; ``/v3/`` is the one
3.4 and later share. Without a registry nothing here is used (see docs/discovery.md).

Key space (``prefix`` defaults to ``/pdkv``)::

    /pdkv/agents/<agent name>   JSON: name, instance_id, address, metadata (base64)
    /pdkv/workers/<worker id>   JSON: url, role, model, capacity, load, state
    /pdkv/proxies/<proxy id>    JSON: url, mode, pid

Every published key is attached to its publisher's lease: when the publisher stops
refreshing (killed, frozen, partitioned from etcd), etcd deletes the key within the TTL.

Signed records: with a cluster credential (:class:`~pdkv.credential.Credential`, by
default from ``PDKV_SECRET``) every value is written as an envelope
``{"v": 1, "record": {...}, "lease": "<id>", "ts": <unix ms>, "mac": "<hex>"}`` whose
MAC (purpose ``etcd``) covers the version, the key, the record, the lease and the
timestamp. Readers with a credential ignore (and count, :meth:`Registry.rejected_records`)
every value that is unsigned, signed with another secret, copied from another key,
changed, attached to another lease than the one signed, dated more than
``max_skew_s`` ahead, or older than one already seen under the same lease. Readers
without a credential accept unsigned records and the records inside envelopes
unchecked. etcd's own user/password authentication and TLS: :class:`EtcdOptions`.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from .credential import Credential
from .errors import InvalidArgument, NotFound, PeerConnectionError

__all__ = ["EtcdClient", "EtcdOptions", "EtcdRefused", "KeyValue", "Registry", "Publication", "Watch",
           "WatchEvent", "WatchIdle", "canonical_json", "parse_registry_url", "RECORD_VERSION", "REJECT_REASONS"]

log = logging.getLogger("pdkv.discovery")

#: etcd refuses leases shorter than about 2 s (its election timeout bounds them).
MIN_TTL_S = 2


#: Version tag of the signed envelope (covered by the MAC).
RECORD_VERSION = 1
#: Purpose of the cluster-credential key that signs etcd records.
ETCD_PURPOSE = "etcd"
#: Why a reader ignored a record (the ``reason`` label of the rejection counter).
REJECT_REASONS = ("malformed", "unsigned", "bad_mac", "lease", "future", "replayed")


def _split_url(url: str) -> tuple[bool, str, int]:
    """``etcd://host:port`` (plain) or ``etcds://host:port`` (TLS) -> (tls, host, port)."""
    if not isinstance(url, str):
        raise InvalidArgument(f"registry must be an 'etcd://host:port' URL, got {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("etcd", "etcds") or not parts.hostname or parts.path not in ("", "/") \
            or parts.username is not None:
        raise InvalidArgument(f"registry must be an 'etcd://host:port' (or TLS: 'etcds://host:port') URL, "
                              f"got {url!r}")
    try:
        port = parts.port or 2379
    except ValueError:
        raise InvalidArgument(f"registry URL {url!r} has an invalid port") from None
    return parts.scheme == "etcds", parts.hostname, port


def parse_registry_url(url: str) -> tuple[str, int]:
    """``etcd://host:port`` or ``etcds://host:port`` (TLS) -> (host, port)."""
    _, host, port = _split_url(url)
    return host, port


@dataclass(frozen=True)
class EtcdOptions:
    """How pdkv authenticates to etcd (etcd's own security, apart from signed records).

    Parameters
    ----------
    user, password : str, optional
        etcd user name and password (etcd v3 auth: ``/v3/auth/authenticate`` gives a
        token sent on every call; a new one is fetched when etcd says it expired).
    ca_file : str, optional
        CA bundle that signed etcd's server certificate (``etcds://`` URLs; default:
        the system's CAs).
    cert_file, key_file : str, optional
        Client certificate and key, for an etcd started with ``--client-cert-auth``.

    :meth:`from_env` reads ``PDKV_ETCD_USER``, ``PDKV_ETCD_PASSWORD`` (or
    ``PDKV_ETCD_PASSWORD_FILE``), ``PDKV_ETCD_CA``, ``PDKV_ETCD_CERT`` and ``PDKV_ETCD_KEY``.
    """

    user: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise InvalidArgument("etcd authentication needs both a user and a password")
        if self.user is not None and (not self.user or not isinstance(self.user, str)):
            raise InvalidArgument(f"etcd user must be a non-empty string, got {self.user!r}")
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgument("an etcd client certificate needs both cert_file and key_file")

    @property
    def tls_files(self) -> bool:
        return any(f is not None for f in (self.ca_file, self.cert_file, self.key_file))

    @classmethod
    def from_env(cls) -> "EtcdOptions":
        env = os.environ
        password = env.get("PDKV_ETCD_PASSWORD") or None
        pw_file = env.get("PDKV_ETCD_PASSWORD_FILE")
        if password is None and pw_file:
            try:
                with open(pw_file, encoding="utf-8") as f:
                    password = f.read().strip()
            except OSError as e:
                raise InvalidArgument(f"PDKV_ETCD_PASSWORD_FILE: cannot read {pw_file!r}: {e}") from None
        return cls(user=env.get("PDKV_ETCD_USER") or None, password=password,
                   ca_file=env.get("PDKV_ETCD_CA") or None, cert_file=env.get("PDKV_ETCD_CERT") or None,
                   key_file=env.get("PDKV_ETCD_KEY") or None)

    def __repr__(self) -> str:  # never the password
        return (f"EtcdOptions(user={self.user!r}, password={'***' if self.password else None}, "
                f"ca_file={self.ca_file!r}, cert_file={self.cert_file!r}, key_file={self.key_file!r})")


def canonical_json(obj: Any) -> bytes:
    """The one encoding a record is signed in (sorted keys, no spaces)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key above every key that starts with ``prefix`` (etcd's range_end)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


class WatchIdle(PeerConnectionError):
    """A watch saw nothing for its idle timeout (etcd may be frozen, or just quiet)."""


class EtcdRefused(PeerConnectionError):
    """etcd answered and refused the call (auth, permission, bad request)."""


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix: ``value`` is None for a deletion (or expiry);
    ``lease`` is the lease etcd holds the key under (0: none)."""

    key: str
    value: bytes | None
    lease: int = 0


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it: its value and the lease it is attached to (0: none)."""

    key: str
    value: bytes
    lease: int = 0


def _kv(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(_unb64(kv.get("key")).decode(), _unb64(kv.get("value")), int(kv.get("lease", 0) or 0))


#: etcd's answers that mean "authenticate (again)": the token expired or none was sent.
_REAUTH = ("invalid auth token", "user name is empty", "auth token")


class EtcdClient:
    """A minimal etcd v3 client over the JSON gateway. Thread-safe (one HTTP connection
    per call). Every failure to reach etcd raises :class:`PeerConnectionError` naming
    etcd and its address; etcd's own refusals raise :class:`NotFound` (unknown lease) or
    :class:`EtcdRefused` (a PeerConnectionError) with etcd's message.

    ``tls``: speak https (``etcds://`` URLs); ``options``: user/password and the TLS
    files (:class:`EtcdOptions`). With a user, the client authenticates on its first
    call and again whenever etcd says the token is invalid (expired)."""

    def __init__(self, host: str, port: int, *, timeout: float = 5.0, tls: bool = False,
                 options: EtcdOptions | None = None) -> None:
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self.options = options or EtcdOptions()
        if self.options.tls_files and not tls:
            raise InvalidArgument("etcd TLS files are given but the registry URL is not etcds://host:port")
        self.tls = bool(tls)
        self._ssl: ssl.SSLContext | None = None
        if self.tls:
            o = self.options
            try:
                ctx = ssl.create_default_context(cafile=o.ca_file)
                if o.cert_file is not None:
                    ctx.load_cert_chain(o.cert_file, o.key_file)
            except (OSError, ssl.SSLError) as e:
                raise InvalidArgument(f"etcd TLS files: {type(e).__name__}: {e}") from None
            self._ssl = ctx
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self.authentications = 0  # tokens fetched (the first, then one per expiry)

    @classmethod
    def from_url(cls, url: str, *, timeout: float = 5.0, options: EtcdOptions | None = None) -> "EtcdClient":
        tls, host, port = _split_url(url)
        return cls(host, port, timeout=timeout, tls=tls, options=options)

    @property
    def url(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.host}:{self.port}"

    def _where(self) -> str:
        return f"etcd at {self.host}:{self.port}"

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self._ssl is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.options.user is not None:
            token = self._token or self._authenticate(None)
            h["Authorization"] = token
        return h

    def _authenticate(self, stale: str | None) -> str:
        """A token for the configured user (a new one unless another thread already
        replaced ``stale``)."""
        with self._auth_lock:
            if self._token is not None and self._token != stale:
                return self._token
            ans = self._post("auth/authenticate", {"name": self.options.user, "password": self.options.password},
                             {"Content-Type": "application/json"})
            token = ans.get("token")
            if not token:
                raise EtcdRefused(f"{self._where()} gave no auth token to user {self.options.user!r}")
            self._token = str(token)
            self.authentications += 1
            return self._token

    def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        conn = self._connection(self.timeout)
        try:
            conn.request("POST", "/v3/" + path, json.dumps(body), headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise PeerConnectionError(f"{self._where()} is unreachable ({path}): {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            text = raw[:300].decode(errors="replace").strip()
            hint = ""
            if "CommonName" in text:  # etcd 3.4's gateway, auth on: client certificates must not carry a CN
                hint = " (with etcd auth enabled, the client certificate must have no CommonName)"
            raise EtcdRefused(f"{self._where()} answered {path} with HTTP {resp.status} and no JSON: "
                              f"{text!r}{hint}") from None
        if resp.status != 200 or "error" in answer:
            msg = answer.get("message") or answer.get("error") or f"HTTP {resp.status}"
            if "lease not found" in str(msg):
                raise NotFound(f"{self._where()}: {msg}")
            raise EtcdRefused(f"{self._where()} refused {path}: {msg}")
        return answer

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POSTs ``body`` to ``/v3/<path>``; returns etcd's decoded answer."""
        headers = self._headers()
        try:
            return self._post(path, body, headers)
        except EtcdRefused as e:
            if self.options.user is None or not any(m in str(e) for m in _REAUTH):
                raise
            self._authenticate(headers.get("Authorization"))  # the token expired: once more with a new one
            return self._post(path, body, self._headers())

    # ------------------------------------------------------------------ keys
    def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("kv/put", body)

    def get(self, key: str) -> bytes | None:
        kv = self.get_kv(key)
        return None if kv is None else kv.value

    def get_kv(self, key: str) -> KeyValue | None:
        """``key``'s value and lease, or None."""
        kvs = self.call("kv/range", {"key": _b64(key.encode())}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix_kvs(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (with its lease) and the store revision they were read at."""
        p = prefix.encode()
        ans = self.call("kv/range", {"key": _b64(p), "range_end": _b64(_prefix_end(p))})
        return [_kv(kv) for kv in ans.get("kvs", [])], int(ans.get("header", {}).get("revision", 0))

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` and the store revision they were read at."""
        kvs, rev = self.get_prefix_kvs(prefix)
        return {kv.key: kv.value for kv in kvs}, rev

    def delete(self, key: str) -> None:
        self.call("kv/deleterange", {"key": _b64(key.encode())})

    # ------------------------------------------------------------------ leases
    def grant(self, ttl: int) -> int:
        return int(self.call("lease/grant", {"TTL": int(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refreshes a lease; returns its remaining TTL (0: it expired, re-grant)."""
        ans = self.call("lease/keepalive", {"ID": str(lease)})
        return int(ans.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except NotFound:
            pass  # already expired

    # ------------------------------------------------------------------ watch
    def watch_prefix(self, prefix: str, start_revision: int, opened: Callable[[Any], None], *,
                     idle_timeout: float | None = None) -> Iterator[WatchEvent]:
        """Yields the changes under ``prefix`` from ``start_revision`` on. ``opened`` gets
        the socket first: shutting it down from another thread ends the watch. Raises
        PeerConnectionError when etcd goes away, and :class:`WatchIdle` after
        ``idle_timeout`` seconds without a byte from etcd (a frozen etcd host sends
        nothing and closes nothing: the caller lists again, which has a deadline)."""
        p = prefix.encode()
        req = {"create_request": {"key": _b64(p), "range_end": _b64(_prefix_end(p)),
                                  "start_revision": str(start_revision)}}
        headers = self._headers()
        conn = self._connection(self.timeout)
        try:
            try:
                conn.request("POST", "/v3/watch", json.dumps(req), headers)
                resp = conn.getresponse()
                conn.sock.settimeout(idle_timeout)  # a watch is silent while nothing changes
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                opened(conn.sock)
            except (OSError, http.client.HTTPException) as e:
                raise PeerConnectionError(f"{self._where()} is unreachable (watch): {type(e).__name__}: {e}") \
                    from None
            while True:
                try:
                    line = resp.readline()
                except socket.timeout:
                    raise WatchIdle(f"{self._where()}: nothing on the watch for {idle_timeout:g} s") from None
                except (OSError, http.client.HTTPException) as e:
                    raise PeerConnectionError(f"{self._where()}: watch broke: {type(e).__name__}: {e}") from None
                if not line:
                    raise PeerConnectionError(f"{self._where()} closed the watch")
                try:
                    msg = json.loads(line)
                    result = msg.get("result", {})
                except (ValueError, AttributeError):
                    raise PeerConnectionError(f"{self._where()} sent a malformed watch line") from None
                if "error" in msg or result.get("canceled"):
                    why = msg.get("error") or result.get("cancel_reason") or "canceled"
                    why = why.get("message", why) if isinstance(why, dict) else why
                    if any(m in str(why) for m in _REAUTH):
                        self._token = None  # the next call authenticates again
                    raise EtcdRefused(f"{self._where()} ended the watch: {why}")
                for ev in result.get("events", []):
                    kv = ev.get("kv", {})
                    key = _unb64(kv.get("key")).decode()
                    yield WatchEvent(key, None if ev.get("type") == "DELETE" else _unb64(kv.get("value")),
                                     int(kv.get("lease", 0) or 0))
        finally:
            conn.close()


class Publication:
    """One key kept alive under a lease by a background thread (see :meth:`Registry.publish`).

    ``value`` is called on every refresh; a changed value is written again. When etcd is
    unreachable the thread keeps trying; when it comes back after the lease expired, the
    thread grants a new lease and writes the key again. :meth:`close` deletes the key
    (revokes the lease); a process that dies without closing disappears after the TTL."""

    def __init__(self, client: EtcdClient, key: str, value: Callable[[], bytes], ttl: int,
                 seal: Callable[[bytes, int], bytes] | None = None) -> None:
        self.client, self.key, self._value, self.ttl = client, key, value, ttl
        self._seal = seal or (lambda value, lease: value)  # what is written: value (signed) for the lease
        self._lease = 0
        self._written: bytes | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.last_error = ""
        self._write_now()  # the first write raises: a publisher learns at once that etcd is down
        self._thread = threading.Thread(target=self._run, name=f"pdkv-etcd {key}", daemon=True)
        self._thread.start()

    def _write_now(self) -> None:
        with self._lock:
            if not self._lease:
                self._lease = self.client.grant(self.ttl)
                self._written = None
            value = self._value()
            if value != self._written:
                self.client.put(self.key, self._seal(value, self._lease), lease=self._lease)
                self._written = value

    def refresh(self) -> None:
        """Writes the current value now (the thread does so every TTL/3 seconds)."""
        self._write_now()

    def _run(self) -> None:
        period = max(self.ttl / 3.0, 0.3)
        while not self._stop.wait(period):
            try:
                if self._lease and self.client.keepalive(self._lease) <= 0:
                    self._lease = 0  # expired while etcd was away: a new lease, the key again
                self._write_now()
                self.last_error = ""
            except NotFound:
                self._lease = 0
            except PeerConnectionError as e:
                if str(e) != self.last_error:
                    log.warning("keeping %s alive: %s", self.key, e)
                self.last_error = str(e)
            except Exception as e:  # noqa: BLE001 - a failing value() must not end the refreshes
                if str(e) != self.last_error:
                    log.exception("keeping %s alive", self.key)
                self.last_error = str(e)

    def close(self, *, delete: bool = True) -> None:
        """Stops refreshing; ``delete``: revoke the lease now (else the key lives out its TTL)."""
        self._stop.set()
        self._thread.join(timeout=self.client.timeout + 1)
        if delete and self._lease:
            try:
                self.client.revoke(self._lease)
            except PeerConnectionError as e:
                log.warning("could not remove %s (it expires after %d s): %s", self.key, self.ttl, e)


_FROM_ENV: Any = object()  # default of Registry(credential=, etcd=): read the environment


class Registry:
    """pdkv's view of one etcd: agents and workers publish here, peers look them up.

    Parameters
    ----------
    url : str
        ``etcd://host:port`` of one etcd member (its client URL); ``etcds://host:port``
        speaks TLS to it.
    ttl : int
        Lease of every key published through this registry, in seconds (>= 2): a
        publisher that stops refreshing disappears at most this long after.
    prefix : str
        Root of pdkv's keys (lets several deployments share one etcd).
    timeout : float
        Deadline of one request to etcd.
    credential : Credential or None
        Signs every record written and checks every record read (see the module
        docstring). Default: :meth:`Credential.from_env` (``PDKV_SECRET``,
        ``PDKV_ACCEPTED_SECRETS``); None: unsigned records, read unchecked.
    etcd : EtcdOptions
        etcd's user/password and TLS files (default: :meth:`EtcdOptions.from_env`).
    max_skew_s : float
        A record dated more than this far in the future is refused (clock skew bound).
    """

    def __init__(self, url: str, *, ttl: int = 10, prefix: str = "/pdkv", timeout: float = 5.0,
                 credential: Credential | None = _FROM_ENV, etcd: EtcdOptions | None = _FROM_ENV,
                 max_skew_s: float = 120.0) -> None:
        if not isinstance(ttl, int) or ttl < MIN_TTL_S:
            raise InvalidArgument(f"ttl must be an integer >= {MIN_TTL_S} seconds (etcd's minimum), got {ttl!r}")
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
            raise InvalidArgument(f"prefix must start with '/' and not end with one, got {prefix!r}")
        if credential is _FROM_ENV:
            credential = Credential.from_env()
        if credential is not None and not isinstance(credential, Credential):
            raise InvalidArgument(f"credential must be a pdkv.credential.Credential or None, "
                                  f"got {type(credential).__name__}")
        if etcd is _FROM_ENV or etcd is None:
            etcd = EtcdOptions.from_env() if etcd is _FROM_ENV else EtcdOptions()
        if not (isinstance(max_skew_s, (int, float)) and max_skew_s > 0):
            raise InvalidArgument(f"max_skew_s must be > 0 seconds, got {max_skew_s!r}")
        self.client = EtcdClient.from_url(url, timeout=timeout, options=etcd)
        self.url, self.ttl, self.prefix = url, ttl, prefix
        self.credential: Credential | None = credential
        self.max_skew_s = float(max_skew_s)
        self._lock = threading.Lock()
        self._rejected: dict[tuple[str, str], int] = {}  # (kind, reason) -> count
        self._warned: set[tuple[str, str]] = set()       # (key, reason) logged once
        self._newest: dict[str, tuple[int, int]] = {}    # key -> (lease, ts) of the newest accepted record
        self._last_ts: dict[str, int] = {}                # key -> ts of the last record this registry signed

    def __repr__(self) -> str:
        return f"Registry({self.url!r}, ttl={self.ttl}, signed={self.credential is not None})"

    def key(self, kind: str, name: str) -> str:
        if not name or "/" in name:
            raise InvalidArgument(f"a registered {kind[:-1]} name must be non-empty without '/', got {name!r}")
        return f"{self.prefix}/{kind}/{name}"

    # ------------------------------------------------------------------ signed records
    def _mac_fields(self, key: str, record: bytes, lease: int, ts: int) -> tuple:
        return ("pdkv etcd record", RECORD_VERSION, key, record, str(lease), str(ts))

    def seal(self, key: str, record: bytes, lease: int) -> bytes:
        """What is written under ``key`` for ``record`` (canonical JSON) on ``lease``:
        the record itself without a credential, else the signed envelope."""
        if self.credential is None:
            return record
        with self._lock:  # strictly increasing per key, even if the wall clock steps back
            ts = max(int(time.time() * 1000), self._last_ts.get(key, 0) + 1)
            self._last_ts[key] = ts
        mac = self.credential.sign(ETCD_PURPOSE, *self._mac_fields(key, record, lease, ts))
        return (b'{"lease":"%d","mac":"%s","record":%s,"ts":%d,"v":%d}'
                % (lease, mac.encode(), record, ts, RECORD_VERSION))

    def open(self, key: str, raw: bytes, lease: int | None) -> dict[str, Any] | None:
        """The record stored as ``raw`` under ``key`` (attached to ``lease`` in etcd; None:
        unknown), or None when it is refused (logged once per key and reason, counted)."""
        record, why = self._check(key, raw, lease)
        if why[0]:
            self._reject(key, why[0], why[1])
            return None
        return record

    def _check(self, key: str, raw: bytes, lease: int | None) -> tuple[dict[str, Any] | None, tuple[str, str]]:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None, ("malformed", "not JSON")
        if not isinstance(doc, dict):
            return None, ("malformed", "not a JSON object")
        envelope = "mac" in doc or "v" in doc
        if not envelope:
            if self.credential is not None:
                return None, ("unsigned", "the record is not signed (this reader has the cluster secret)")
            return doc, ("", "")
        record = doc.get("record")
        if not isinstance(record, dict):
            return None, ("malformed", "an envelope without a record object")
        if self.credential is None:
            return record, ("", "")  # no secret here: the content is taken unchecked
        mac, v, signed_lease, ts = doc.get("mac"), doc.get("v"), doc.get("lease"), doc.get("ts")
        if not isinstance(mac, str) or not mac:
            return None, ("unsigned", "the envelope has no MAC")
        try:
            signed_lease_i, ts_i = int(signed_lease), int(ts)
        except (TypeError, ValueError):
            return None, ("malformed", "the envelope's lease or ts is not an integer")
        if v != RECORD_VERSION or str(signed_lease) != str(signed_lease_i) or isinstance(ts, bool) \
                or not isinstance(ts, int):
            return None, ("bad_mac", f"unknown envelope version {v!r} or field encoding")
        if not self.credential.verify(ETCD_PURPOSE, mac, *self._mac_fields(key, canonical_json(record),
                                                                          signed_lease_i, ts_i)):
            return None, ("bad_mac", "the MAC does not match (another secret, another key, or changed)")
        if lease is not None and lease != signed_lease_i:
            return None, ("lease", f"signed for lease {signed_lease_i:x}, held in etcd under lease {lease:x}")
        ahead = ts_i / 1000.0 - time.time()
        if ahead > self.max_skew_s:
            return None, ("future", f"dated {ahead:.0f} s in the future (more than max_skew_s={self.max_skew_s:g})")
        with self._lock:
            newest = self._newest.get(key)
            if newest is not None and newest[0] == signed_lease_i and ts_i < newest[1]:
                return None, ("replayed", "older than a record already seen under the same lease")
            self._newest[key] = (signed_lease_i, ts_i)
        return record, ("", "")

    def _reject(self, key: str, reason: str, detail: str) -> None:
        kind = key[len(self.prefix) + 1:].split("/", 1)[0] if key.startswith(self.prefix + "/") else "?"
        with self._lock:
            self._rejected[(kind, reason)] = self._rejected.get((kind, reason), 0) + 1
            first = (key, reason) not in self._warned
            if first:
                if len(self._warned) > 10000:  # a writer spraying keys must not grow this without end
                    self._warned.clear()
                self._warned.add((key, reason))
        if first:
            log.warning("ignoring the record under %s in %s: %s: %s (counted in "
                        "pdkv_discovery_rejected_records_total)", key, self.client._where(), reason, detail)

    def forget(self, key: str) -> None:
        """``key`` was deleted: its next record starts a new history."""
        with self._lock:
            self._newest.pop(key, None)

    def rejected_records(self) -> list[tuple[tuple[str, str], int]]:
        """Records refused so far, as ``((kind, reason), count)`` pairs (reasons:
        :data:`REJECT_REASONS`)."""
        with self._lock:
            return sorted(self._rejected.items())

    def rejected_total(self) -> int:
        with self._lock:
            return sum(self._rejected.values())

    # ------------------------------------------------------------------ publish and read
    def publish(self, kind: str, name: str, value: Callable[[], dict[str, Any]]) -> Publication:
        """Keeps ``value()`` (JSON) under ``<prefix>/<kind>/<name>`` while the returned
        publication is open, signed when this registry has a credential. Raises
        PeerConnectionError when etcd cannot be reached now."""
        key = self.key(kind, name)
        return Publication(self.client, key, lambda: canonical_json(json.loads(canonical_json(value()))),
                           self.ttl, seal=lambda record, lease: self.seal(key, record, lease))

    def lookup(self, kind: str, name: str) -> dict[str, Any]:
        key = self.key(kind, name)
        kv = self.client.get_kv(key)
        where = f"etcd at {self.client.host}:{self.client.port}"
        if kv is None:
            raise NotFound(f"no {kind[:-1]} named {name!r} is registered in {where} (key {key})")
        record = self.open(key, kv.value, kv.lease)
        if record is None:
            raise NotFound(f"no {kind[:-1]} named {name!r} is registered in {where}: the record under {key} "
                           "was refused (not signed with the cluster secret, or altered; see the log)")
        return record

    def list(self, kind: str) -> tuple[dict[str, dict[str, Any]], int]:
        """Every entry of ``kind`` (name -> value) and the revision to watch from
        (refused records are left out)."""
        base = f"{self.prefix}/{kind}/"
        kvs, rev = self.client.get_prefix_kvs(base)
        out = {}
        for kv in kvs:
            record = self.open(kv.key, kv.value, kv.lease)
            if record is not None:
                out[kv.key[len(base):]] = record
        return out, rev

    # ------------------------------------------------------------------ agents
    def publish_agent(self, agent: Any, *, advertise_host: str | None = None) -> Publication:
        """Publishes ``agent`` under ``<prefix>/agents/<name>``: its tcp address (with
        ``advertise_host`` replacing the bound host, for a wildcard listen), instance id
        and metadata (refreshed when regions or layouts change)."""

        def record() -> dict[str, Any]:
            address = agent.address
            if advertise_host:
                address = f"{advertise_host}:{address.rsplit(':', 1)[1]}"
            return {"name": agent.name, "instance_id": agent.instance_id, "address": address,
                    "metadata": _b64(agent.metadata())}

        return self.publish("agents", agent.name, record)

    def lookup_agent(self, name: str) -> dict[str, Any]:
        """The record of agent ``name`` (NotFound when none is registered)."""
        return self.lookup("agents", name)

    def watch(self, kind: str, on_change: Callable[[str, dict[str, Any] | None], None], *,
              retry_s: float = 1.0, idle_s: float = 30.0) -> "Watch":
        """Calls ``on_change(name, value or None)`` from a background thread for every
        entry of ``kind`` now and for every later change, until the returned watch is
        closed. While etcd is away it retries every ``retry_s``; when etcd returns it
        lists again, so entries that expired meanwhile are reported removed. A watch
        that hears nothing for ``idle_s`` lists again and re-opens (so a frozen etcd is
        noticed within ``idle_s`` plus the registry's ``timeout``); only what changed
        is reported."""
        if not (isinstance(idle_s, (int, float)) and idle_s > 0):
            raise InvalidArgument(f"idle_s must be > 0 seconds, got {idle_s!r}")
        return Watch(self, kind, on_change, retry_s, idle_s)


class Watch:
    """A background watch of one kind of entry (see :meth:`Registry.watch`)."""

    def __init__(self, registry: Registry, kind: str, on_change: Callable[[str, dict[str, Any] | None], None],
                 retry_s: float, idle_s: float = 30.0) -> None:
        self._registry, self._kind, self._on_change, self._retry_s = registry, kind, on_change, retry_s
        self._idle_s = idle_s
        self._stop = threading.Event()
        self._sock: Any = None
        self.synced = threading.Event()  # set once the first listing was delivered
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name=f"pdkv-etcd watch {kind}", daemon=True)
        self._thread.start()

    def _opened(self, sock: Any) -> None:
        self._sock = sock
        if self._stop.is_set():
            self._shutdown()

    def _shutdown(self) -> None:
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        known: dict[str, Any] = {}  # name -> the value last reported
        reg = self._registry
        base = f"{reg.prefix}/{self._kind}/"
        while not self._stop.is_set():
            try:
                items, rev = reg.list(self._kind)
                for gone in known.keys() - items.keys():
                    del known[gone]
                    self._on_change(gone, None)
                for name, value in items.items():
                    if known.get(name) != value:
                        known[name] = value
                        self._on_change(name, value)
                self.last_error = ""
                self.synced.set()
                for ev in reg.client.watch_prefix(base, rev + 1, self._opened, idle_timeout=self._idle_s):
                    name = ev.key[len(base):]
                    record = None
                    if ev.value is None:
                        reg.forget(ev.key)
                    else:
                        record = reg.open(ev.key, ev.value, ev.lease)  # None: refused, as if absent
                    if record is None:
                        if known.pop(name, None) is not None or ev.value is None:
                            self._on_change(name, None)
                    elif known.get(name) != record:
                        known[name] = record
                        self._on_change(name, record)
            except WatchIdle:
                log.debug("watching %s: quiet for %g s; listing again", base, self._idle_s)
            except PeerConnectionError as e:
                if not self._stop.is_set():
                    if str(e) != self.last_error:  # once per outage, not once per retry
                        log.warning("watching %s: %s", base, e)
                    self.last_error = str(e)
                    self._stop.wait(self._retry_s)
            except Exception:  # noqa: BLE001 - a bad entry or callback must not end the watch
                log.exception("watching %s", base)
                self._stop.wait(self._retry_s)

    def close(self) -> None:
        self._stop.set()
        self._shutdown()
        self._thread.join(timeout=5.0)


def resolve(registry: "Registry | str | None", secret: str | bytes | None = None,
            accepted: "Sequence[str | bytes] | None" = None) -> Registry | None:
    """A Registry from an ``etcd://`` URL (or the Registry itself, or None). A URL's
    registry signs with ``secret`` (the agent's cluster secret) when given, else with
    ``PDKV_SECRET``, and accepts ``accepted`` too (else ``PDKV_ACCEPTED_SECRETS``)."""
    if registry is None or isinstance(registry, Registry):
        return registry
    return Registry(registry, credential=Credential.from_env(secret or None, accepted))

