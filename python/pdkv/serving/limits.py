"""Connection limits and read deadlines of the serving HTTP servers (proxy and workers).

What a client can hold and for how long, using aiohttp's own settings where it has
them:

* **Idle and request-header deadline** (``keepalive_timeout_s``): aiohttp's
  ``keepalive_timeout``. It is armed when a connection is accepted and again after each
  response, so it closes both an idle keep-alive connection and one that never finished
  sending its request headers (a half-sent request).
* **Body deadline** (``body_timeout_s``): reading a request body
  (:func:`read_body`) must finish within it; else 408 and the connection is closed.
* **Connection limit** (``max_connections``): past it, the oldest *idle* connection (no
  request being handled: an idle keep-alive or a half-sent request) is closed to make
  room; when every connection is busy with a request, the new one is answered at once
  with a 503 OpenAI JSON error (``Retry-After: 1``) and closed, so file handles never run
  out. Default: from the process's file-handle limit (``RLIMIT_NOFILE``).
* **Rate-limited logging**: accept errors (``Too many open files``...) and aiohttp's
  per-connection errors are logged at most once per ``LOG_INTERVAL_S`` per kind, with a
  count of what was suppressed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdkv.errors import InvalidArgument

__all__ = ["BODY_KEY", "DEFAULT_BODY_TIMEOUT_S", "DEFAULT_KEEPALIVE_TIMEOUT_S", "LimitedServer", "ServerLimits",
           "default_max_connections", "raise_nofile_limit", "read_body"]

log = logging.getLogger("pdkv.serving")

#: Where a request's body, once read and bounded (by the signature check, auth.py), is
#: left for :func:`read_body` to return.
BODY_KEY: Any = web.RequestKey("pdkv.body", bytes) if hasattr(web, "RequestKey") else "pdkv.body"
DEFAULT_KEEPALIVE_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0
#: File handles kept free for everything but client connections (worker links, logs...).
NOFILE_RESERVE = 256
#: Seconds between two log records of one kind of connection error.
LOG_INTERVAL_S = 10.0


def _nofile() -> int:
    try:
        import resource

        return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return 1024


def default_max_connections() -> int:
    """Client connections a server accepts by default: the soft ``RLIMIT_NOFILE`` less
    ``NOFILE_RESERVE``, between 64 and 16384."""
    n = _nofile()
    if n < 0:  # RLIM_INFINITY
        return 16384
    return max(64, min(16384, n - NOFILE_RESERVE))


def raise_nofile_limit(want: int = 65536) -> int:
    """Raises the soft ``RLIMIT_NOFILE`` towards ``min(want, hard)``; returns the soft limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError):
        pass
    return _nofile()


@dataclass(frozen=True)
class ServerLimits:
    """Limits of one HTTP server.

    Attributes
    ----------
    max_connections : int, optional
        Client connections held at once (see the module docstring). Default:
        :func:`default_max_connections` at start.
    keepalive_timeout_s : float
        Seconds an idle connection, or one still sending its request headers, is kept.
    body_timeout_s : float
        Seconds a request body may take to arrive.
    """

    max_connections: int | None = None
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections is not None and (not isinstance(self.max_connections, int)
                                                 or self.max_connections < 1):
            raise InvalidArgument(f"max_connections must be an integer >= 1, got {self.max_connections!r}")
        for k in ("keepalive_timeout_s", "body_timeout_s"):
            if not getattr(self, k) > 0:
                raise InvalidArgument(f"{k} must be > 0, got {getattr(self, k)!r}")

    def connections(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()

    def runner_kwargs(self) -> dict[str, Any]:
        """aiohttp ``AppRunner``/``Server`` settings: the idle/header deadline, and a
        lingering close (draining an unread body) no longer than the body deadline."""
        return {"keepalive_timeout": self.keepalive_timeout_s,
                "lingering_time": min(10.0, self.body_timeout_s)}


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The request body, at most ``limit`` bytes (aiohttp's 413 above) within ``timeout`` s.

    Raises
    ------
    aiohttp.web.HTTPRequestEntityTooLarge
        Over ``limit`` (declared or read).
    aiohttp.web.HTTPRequestTimeout
        Not all there in time (the connection is closed after the answer).
    """
    stashed = request.get(BODY_KEY)  # read (and bounded) already by the signature check (auth.py)
    if stashed is not None:
        return stashed
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:
        return await asyncio.wait_for(request.clone(client_max_size=limit).read(), timeout)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout:g} s",
                                     headers={"Connection": "close"}) from None


def _reject_response() -> bytes:
    body = json.dumps({"error": {"message": "the server is at its connection limit; retry shortly",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
    return head + body


class _Reject(asyncio.Protocol):
    """A connection past the limit: a 503 at once, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_reject_response())
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass


class LimitedServer:
    """An aiohttp application served with :class:`ServerLimits` on one TCP address.

    Built from aiohttp's public pieces: an ``AppRunner`` (its ``Server`` is the
    connection factory and knows the open ``connections``), and ``loop.create_server``
    with a factory that enforces the connection limit in front of it.
    """

    def __init__(self, app: web.Application, limits: ServerLimits, *, shutdown_timeout: float = 1.0) -> None:
        self.app = app
        self.limits = limits
        self.max_connections = limits.connections()
        self.shutdown_timeout = shutdown_timeout
        self.rejected = 0   # connections answered 503
        self.evicted = 0    # idle connections closed to make room
        self._busy: dict[Any, int] = {}  # RequestHandler -> requests being handled
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        app.middlewares.insert(0, self._mark_busy)

    @web.middleware
    async def _mark_busy(self, request: web.Request, handler: Any) -> web.StreamResponse:
        proto = request.protocol
        self._busy[proto] = self._busy.get(proto, 0) + 1
        try:
            return await handler(request)
        finally:
            n = self._busy.get(proto, 1) - 1
            if n <= 0:
                self._busy.pop(proto, None)
            else:
                self._busy[proto] = n

    def open_connections(self) -> int:
        srv = self._runner.server if self._runner is not None else None
        return len(srv.connections) if srv is not None else 0

    def _factory(self) -> asyncio.Protocol:
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        # Connections being closed (their handler still finishing) are on their way out.
        live = [h for h in server.connections if h.transport is not None and not h.transport.is_closing()]
        if len(live) >= self.max_connections:
            idle = [h for h in live if h not in self._busy]
            if not idle:
                self.rejected += 1
                _rate_limited("connection limit", logging.WARNING,
                              "connection limit (%d) reached with every connection busy: answering 503",
                              self.max_connections)
                return _Reject()
            idle[0].force_close()  # the oldest idle (connections are kept in accept order)
            self.evicted += 1
        return server()

    async def start(self, host: str, port: int) -> list[tuple[str, int]]:
        """Binds and serves; returns the bound addresses."""
        install_log_filters()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.shutdown_timeout, **self.limits.runner_kwargs())
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(self._factory, host, port, reuse_address=True, backlog=1024)
        except OSError:
            await self._runner.cleanup()
            self._runner = None
            raise
        return [s.getsockname()[:2] for s in self._server.sockets]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


# ---------------------------------------------------------------------- rate-limited logs
_seen: dict[str, list[float]] = {}   # kind -> [last logged at, suppressed since]
_seen_lock = threading.Lock()


def _allow(kind: str) -> int | None:
    """None to suppress; else how many of this kind were suppressed since the last one."""
    now = time.monotonic()
    with _seen_lock:
        s = _seen.get(kind)
        if s is not None and now - s[0] < LOG_INTERVAL_S:
            s[1] += 1
            return None
        suppressed = int(s[1]) if s is not None else 0
        _seen[kind] = [now, 0]
        return suppressed


def _rate_limited(kind: str, level: int, msg: str, *args: Any) -> None:
    n = _allow(kind)
    if n is not None:
        log.log(level, msg + (f" ({n} more like it suppressed)" if n else ""), *args)


class _RateLimit(logging.Filter):
    """Lets one record per message kind through every ``LOG_INTERVAL_S``; the first one
    after a quiet period says how many were suppressed (tracebacks only on that one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        kind = f"{record.name}:{record.msg}:{type(exc).__name__ if exc else ''}:{getattr(exc, 'errno', '')}"
        n = _allow(kind)
        if n is None:
            return False
        if n:
            record.msg = f"{record.msg} ({n} more like it suppressed in the last {LOG_INTERVAL_S:g} s)"
        return True


_filters_installed = False


def install_log_filters() -> None:
    """Rate-limits asyncio's accept errors and aiohttp's per-connection error logs."""
    global _filters_installed
    if _filters_installed:
        return
    _filters_installed = True
    for name in ("asyncio", "aiohttp.server", "aiohttp.web"):
        logging.getLogger(name).addFilter(_RateLimit())
