"""Discovery through etcd: agents and serving workers publish themselves under keys
bound to a lease they keep alive; peers and proxies look them up or watch them.

pdkv speaks etcd's v3 JSON gateway (``POST /v3/kv/put`` and friends, keys and values
base64-encoded) with the standard library only, so discovery needs no extra package.
etcd 3.4 serves the gateway under both ``/v3/`` and ``/v3beta/``; ``/v3/`` is the one
3.4 and later share. Without a registry nothing here is used (see docs/discovery.md).

Key space (``prefix`` defaults to ``/pdkv``)::

    /pdkv/agents/<agent name>   JSON: name, instance_id, address, metadata (base64)
    /pdkv/workers/<worker id>   JSON: url, role, model, capacity, load, state

Every published key is attached to its publisher's lease: when the publisher stops
refreshing (killed, frozen, partitioned from etcd), etcd deletes the key within the TTL.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .errors import InvalidArgument, NotFound, PeerConnectionError

__all__ = ["EtcdClient", "Registry", "Publication", "Watch", "WatchEvent", "WatchIdle", "parse_registry_url"]

log = logging.getLogger("pdkv.discovery")

#: etcd refuses leases shorter than about 2 s (its election timeout bounds them).
MIN_TTL_S = 2


def parse_registry_url(url: str) -> tuple[str, int]:
    """``etcd://host:port`` -> (host, port). The only registry scheme is ``etcd``."""
    if not isinstance(url, str):
        raise InvalidArgument(f"registry must be an 'etcd://host:port' URL, got {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "etcd" or not parts.hostname or parts.path not in ("", "/"):
        raise InvalidArgument(f"registry must be an 'etcd://host:port' URL, got {url!r}")
    try:
        port = parts.port or 2379
    except ValueError:
        raise InvalidArgument(f"registry URL {url!r} has an invalid port") from None
    return parts.hostname, port


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


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix: ``value`` is None for a deletion (or expiry)."""

    key: str
    value: bytes | None


class EtcdClient:
    """A minimal etcd v3 client over the JSON gateway. Thread-safe (one HTTP connection
    per call). Every failure to reach etcd raises :class:`PeerConnectionError` naming
    etcd and its address; etcd's own refusals raise :class:`NotFound` (unknown lease) or
    :class:`PeerConnectionError` with etcd's message."""

    def __init__(self, host: str, port: int, *, timeout: float = 5.0) -> None:
        self.host, self.port, self.timeout = host, int(port), float(timeout)

    @classmethod
    def from_url(cls, url: str, *, timeout: float = 5.0) -> "EtcdClient":
        host, port = parse_registry_url(url)
        return cls(host, port, timeout=timeout)

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    def _where(self) -> str:
        return f"etcd at {self.host}:{self.port}"

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POSTs ``body`` to ``/v3/<path>``; returns etcd's decoded answer."""
        conn = self._connection(self.timeout)
        try:
            conn.request("POST", "/v3/" + path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise PeerConnectionError(f"{self._where()} is unreachable ({path}): {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            raise PeerConnectionError(f"{self._where()} answered {path} with HTTP {resp.status} and no JSON") \
                from None
        if resp.status != 200 or "error" in answer:
            msg = answer.get("message") or answer.get("error") or f"HTTP {resp.status}"
            if "lease not found" in str(msg):
                raise NotFound(f"{self._where()}: {msg}")
            raise PeerConnectionError(f"{self._where()} refused {path}: {msg}")
        return answer

    # ------------------------------------------------------------------ keys
    def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("kv/put", body)

    def get(self, key: str) -> bytes | None:
        kvs = self.call("kv/range", {"key": _b64(key.encode())}).get("kvs", [])
        return _unb64(kvs[0].get("value")) if kvs else None

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` and the store revision they were read at."""
        p = prefix.encode()
        ans = self.call("kv/range", {"key": _b64(p), "range_end": _b64(_prefix_end(p))})
        items = {_unb64(kv["key"]).decode(): _unb64(kv.get("value")) for kv in ans.get("kvs", [])}
        return items, int(ans.get("header", {}).get("revision", 0))

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
        conn = self._connection(self.timeout)
        try:
            try:
                conn.request("POST", "/v3/watch", json.dumps(req), {"Content-Type": "application/json"})
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
                    result = json.loads(line).get("result", {})
                except ValueError:
                    raise PeerConnectionError(f"{self._where()} sent a malformed watch line") from None
                for ev in result.get("events", []):
                    kv = ev.get("kv", {})
                    key = _unb64(kv.get("key")).decode()
                    yield WatchEvent(key, None if ev.get("type") == "DELETE" else _unb64(kv.get("value")))
        finally:
            conn.close()


class Publication:
    """One key kept alive under a lease by a background thread (see :meth:`Registry.publish`).

    ``value`` is called on every refresh; a changed value is written again. When etcd is
    unreachable the thread keeps trying; when it comes back after the lease expired, the
    thread grants a new lease and writes the key again. :meth:`close` deletes the key
    (revokes the lease); a process that dies without closing disappears after the TTL."""

    def __init__(self, client: EtcdClient, key: str, value: Callable[[], bytes], ttl: int) -> None:
        self.client, self.key, self._value, self.ttl = client, key, value, ttl
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
                self.client.put(self.key, value, lease=self._lease)
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


class Registry:
    """pdkv's view of one etcd: agents and workers publish here, peers look them up.

    Parameters
    ----------
    url : str
        ``etcd://host:port`` of one etcd member (its client URL).
    ttl : int
        Lease of every key published through this registry, in seconds (>= 2): a
        publisher that stops refreshing disappears at most this long after.
    prefix : str
        Root of pdkv's keys (lets several deployments share one etcd).
    timeout : float
        Deadline of one request to etcd.
    """

    def __init__(self, url: str, *, ttl: int = 10, prefix: str = "/pdkv", timeout: float = 5.0) -> None:
        if not isinstance(ttl, int) or ttl < MIN_TTL_S:
            raise InvalidArgument(f"ttl must be an integer >= {MIN_TTL_S} seconds (etcd's minimum), got {ttl!r}")
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
            raise InvalidArgument(f"prefix must start with '/' and not end with one, got {prefix!r}")
        self.client = EtcdClient.from_url(url, timeout=timeout)
        self.url, self.ttl, self.prefix = url, ttl, prefix

    def __repr__(self) -> str:
        return f"Registry({self.url!r}, ttl={self.ttl})"

    def key(self, kind: str, name: str) -> str:
        if not name or "/" in name:
            raise InvalidArgument(f"a registered {kind[:-1]} name must be non-empty without '/', got {name!r}")
        return f"{self.prefix}/{kind}/{name}"

    def publish(self, kind: str, name: str, value: Callable[[], dict[str, Any]]) -> Publication:
        """Keeps ``value()`` (JSON) under ``<prefix>/<kind>/<name>`` while the returned
        publication is open. Raises PeerConnectionError when etcd cannot be reached now."""
        return Publication(self.client, self.key(kind, name), lambda: json.dumps(value(), sort_keys=True).encode(),
                           self.ttl)

    def lookup(self, kind: str, name: str) -> dict[str, Any]:
        raw = self.client.get(self.key(kind, name))
        if raw is None:
            raise NotFound(f"no {kind[:-1]} named {name!r} is registered in etcd at "
                           f"{self.client.host}:{self.client.port} (key {self.key(kind, name)})")
        return json.loads(raw)

    def list(self, kind: str) -> tuple[dict[str, dict[str, Any]], int]:
        """Every entry of ``kind`` (name -> value) and the revision to watch from."""
        base = f"{self.prefix}/{kind}/"
        items, rev = self.client.get_prefix(base)
        return {k[len(base):]: json.loads(v) for k, v in items.items()}, rev

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
                    if ev.value is None:
                        known.pop(name, None)
                        self._on_change(name, None)
                    else:
                        known[name] = json.loads(ev.value)
                        self._on_change(name, known[name])
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


def resolve(registry: "Registry | str | None") -> Registry | None:
    """A Registry from an ``etcd://`` URL (or the Registry itself, or None)."""
    if registry is None or isinstance(registry, Registry):
        return registry
    return Registry(registry)

