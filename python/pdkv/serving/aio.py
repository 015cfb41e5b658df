"""asyncio and aiohttp plumbing shared by the workers, the proxy and their tests.

* :class:`HttpServer`: an aiohttp application bound to ``host:port`` (port 0 picks a
  free one), with handler cancellation on client disconnect and no access log.
* :class:`ServerThread`: runs a server object (anything with ``async start(host,
  port) -> url`` and ``async close()``) on a private event loop in a thread, so tests
  and tools can host workers and proxies in-process.
* :func:`ndjson_lines`: reads newline-delimited JSON from an HTTP response body with a
  timeout per line.
* :func:`run_until_signal`: the ``main`` of a serving process (SIGINT/SIGTERM stop it
  cleanly; a ready file tells launchers where it listens).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from aiohttp import web

from pdkv.errors import InvalidArgument

from .limits import LimitedServer, ServerLimits

__all__ = ["HttpServer", "Serveable", "ServerThread", "json_error", "ndjson_lines", "run_until_signal",
           "start_ndjson", "write_ready_file"]

log = logging.getLogger("pdkv.serving")


class Serveable(Protocol):
    """What :class:`ServerThread` and :func:`run_until_signal` host."""

    async def start(self, host: str, port: int) -> str:
        """Starts listening; returns the base URL ``http://host:port``."""

    async def close(self) -> None:
        """Stops serving and frees everything (idempotent)."""


def json_error(status: int, message: str, *, type: str | None = None, code: str | None = None,
               param: str | None = None) -> web.Response:
    """An OpenAI-style error response ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type or ("invalid_request_error" if status < 500 else
                                                            "server_error"), "param": param, "code": code}}
    return web.json_response(body, status=status)


async def start_ndjson(request: web.Request) -> web.StreamResponse:
    """Starts a streamed ``application/x-ndjson`` 200 response."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson",
                                                   "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def ndjson_lines(content: Any, *, timeout: float | None) -> AsyncIterator[dict[str, Any]]:
    """Decoded objects of an NDJSON body, one per line.

    Parameters
    ----------
    content : aiohttp.StreamReader
        ``response.content``.
    timeout : float or None
        Seconds to wait for each line.

    Raises
    ------
    asyncio.TimeoutError
        A line took longer than ``timeout``.
    ConnectionError
        The stream ended in the middle of a line, or a line is not a JSON object.
    """
    while True:
        line = await asyncio.wait_for(content.readline(), timeout)
        if not line:
            return
        if not line.endswith(b"\n"):
            raise ConnectionError("the worker's stream ended in the middle of a line")
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise ConnectionError(f"the worker sent a line that is not JSON: {line[:80]!r}") from None
        if not isinstance(obj, dict):
            raise ConnectionError(f"the worker sent a line that is not a JSON object: {line[:80]!r}")
        yield obj


async def sse_events(response: Any) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """Parsed events of an OpenAI-style SSE stream (an aiohttp response), each with the
    ``time.perf_counter()`` at which its chunk arrived; stops at ``[DONE]`` or the end.

    Raises
    ------
    RuntimeError
        On a non-200 status or an ``{"error": ...}`` event in the stream.
    """
    import time

    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
    buf = b""
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"the stream failed: {obj['error'].get('message')}")
            yield now, obj


class HttpServer:
    """An aiohttp application listening on one TCP address, with connection limits and
    read deadlines (:class:`~pdkv.serving.limits.ServerLimits`).

    Parameters
    ----------
    app : aiohttp.web.Application
    shutdown_timeout : float
        On :meth:`close`, seconds running handlers get to finish before they are cancelled.
    limits : ServerLimits, optional
        Default: ``ServerLimits()`` (see :mod:`pdkv.serving.limits`).
    """

    def __init__(self, app: web.Application, *, shutdown_timeout: float = 1.0,
                 limits: ServerLimits | None = None) -> None:
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self.server = LimitedServer(app, limits or ServerLimits(), shutdown_timeout=shutdown_timeout)
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        """Binds and serves; returns ``http://host:port`` (the real port if ``port`` is 0)."""
        addr = (await self.server.start(host, port))[0]
        h = addr[0]
        self.url = f"http://{'[' + h + ']' if ':' in h else h}:{addr[1]}"
        return self.url

    async def close(self) -> None:
        """Stops accepting, cancels running handlers and closes connections."""
        await self.server.close()


class ServerThread:
    """Hosts a :class:`Serveable` on its own event loop in a daemon thread.

    Parameters
    ----------
    server : Serveable
    host : str
    port : int
        0 picks a free port.

    Examples
    --------
    >>> with ServerThread(worker) as t:          # doctest: +SKIP
    ...     requests.get(t.url + "/health")
    """

    def __init__(self, server: Serveable, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 120.0) -> str:
        """Starts the thread and the server; returns its URL.

        Raises
        ------
        Exception
            Whatever the server's ``start`` raised.
        TimeoutError
            Not started within ``timeout`` seconds.
        """
        self._thread = threading.Thread(target=self._run, name=f"server-{type(self.server).__name__}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"{type(self.server).__name__} did not start within {timeout} s")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self.url

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            self.url = await self.server.start(self.host, self.port)
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            self._error = e
            self._started.set()
            try:
                await self.server.close()
            finally:
                return
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await self.server.close()

    def call(self, coro_fn: Callable[[], Awaitable[Any]], timeout: float = 60.0) -> Any:
        """Runs ``coro_fn()`` on the server's loop and returns its result."""
        if self.loop is None:
            raise InvalidArgument("the server thread is not running")
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Closes the server and joins the thread (idempotent)."""
        if self._thread is None:
            return
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # the loop already ended
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "ServerThread":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def write_ready_file(path: str | os.PathLike, info: dict[str, Any]) -> None:
    """Writes ``info`` as JSON to ``path`` atomically (launchers poll for it)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, p)


def run_until_signal(server: Serveable, host: str, port: int, *, ready_file: str | None = None,
                     ready_info: Callable[[str], dict[str, Any]] | None = None) -> int:
    """Serves until SIGINT or SIGTERM, then closes the server. The process's ``main``.

    Parameters
    ----------
    server : Serveable
    host, port : str, int
    ready_file : str, optional
        Written (JSON: ``url``, ``pid`` plus ``ready_info(url)``) once serving.
    ready_info : callable, optional

    Returns
    -------
    int
        Exit status (0).
    """

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            url = await server.start(host, port)
            info = {"url": url, "pid": os.getpid(), **(ready_info(url) if ready_info else {})}
            log.info("serving on %s", url)
            if ready_file:
                write_ready_file(ready_file, info)
            await stop.wait()
            log.info("shutting down")
        finally:
            await server.close()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    asyncio.run(main())
    return 0
