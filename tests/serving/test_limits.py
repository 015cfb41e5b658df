"""Connection limits and read deadlines of the serving HTTP servers: idle and
half-sent connections are closed after their deadline, small requests keep being
served meanwhile, a server at its connection limit evicts idle connections or answers
a 503 OpenAI error, file handles do not leak; body limits and flag checks of
``pdkv serve`` (before the model loads); the ``--model`` argument as given is a model
name."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402

from pdkv.serving.aio import HttpServer, ServerThread  # noqa: E402
from pdkv.serving.frontend import openai_error_middleware  # noqa: E402
from pdkv.serving.limits import ServerLimits, raise_nofile_limit, read_body  # noqa: E402

IDLE = 500


class _App:
    """A tiny server: ``/ping`` answers at once, ``/echo`` reads its body (deadline),
    ``/hold`` waits until released."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.http: HttpServer | None = None
        self.release: asyncio.Event | None = None

    async def start(self, host: str, port: int) -> str:
        self.release = asyncio.Event()
        app = web.Application()
        app.middlewares.append(openai_error_middleware())
        app.router.add_get("/ping", self._ping)
        app.router.add_post("/echo", self._echo)
        app.router.add_get("/hold", self._hold)
        self.http = HttpServer(app, limits=self.limits)
        return await self.http.start(host, port)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _echo(self, request: web.Request) -> web.Response:
        raw = await read_body(request, 1 << 20, self.limits.body_timeout_s)
        return web.json_response({"n": len(raw)})

    async def _hold(self, request: web.Request) -> web.Response:
        assert self.release is not None
        await asyncio.wait_for(self.release.wait(), 30)
        return web.json_response({"held": True})


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _get(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def _closed_by_server(s: socket.socket, deadline: float) -> bytes | None:
    """What the server sent before closing ``s`` (None: still open at ``deadline``)."""
    got = b""
    while True:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return None
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


@pytest.fixture
def nofile():
    if raise_nofile_limit(8192) < 4 * IDLE:
        pytest.skip("cannot raise the file-handle limit far enough for the idle-socket test")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_idle_and_half_sent_connections_are_closed_and_small_requests_served(nofile) -> None:
    app = _App(ServerLimits(keepalive_timeout_s=1.0, body_timeout_s=1.0))
    with ServerThread(app) as t:
        addr = _addr(t.url)
        assert _get(t.url + "/ping")[0] == 200
        base = _fds()
        socks: list[socket.socket] = []
        try:
            for i in range(IDLE):
                s = socket.create_connection(addr, timeout=5)
                if i % 3 == 1:    # half-sent request headers
                    s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                elif i % 3 == 2:  # headers sent, body half-sent
                    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
                socks.append(s)
            # Small requests are served while the idle sockets are open.
            t0 = time.monotonic()
            for _ in range(20):
                status, body = _get(t.url + "/ping")
                assert (status, body) == (200, {"ok": True})
            assert time.monotonic() - t0 < 20, "small requests stalled behind idle sockets"
            deadline = time.monotonic() + 15
            outcomes = [_closed_by_server(s, deadline) for s in socks]
            assert all(o is not None for o in outcomes), \
                f"{sum(o is None for o in outcomes)} of {IDLE} connections still open after their deadline"
            # The half-sent bodies were answered 408 (OpenAI JSON) before the close.
            slow_bodies = [outcomes[i] for i in range(2, IDLE, 3)]
            assert all(o.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in o for o in slow_bodies), \
                slow_bodies[:2]
        finally:
            for s in socks:
                s.close()
        # Every server-side socket was released (no leak); a little slack for the loop.
        end = time.monotonic() + 10
        while _fds() > base + 5 and time.monotonic() < end:
            time.sleep(0.1)
        assert _fds() <= base + 5, f"{_fds() - base} file handles leaked"
        assert app.http is not None and app.http.server.open_connections() <= 1


def test_connection_limit_evicts_idle_then_answers_503_when_all_busy() -> None:
    app = _App(ServerLimits(max_connections=4, keepalive_timeout_s=60.0))
    with ServerThread(app) as t:
        addr = _addr(t.url)
        idle = [socket.create_connection(addr, timeout=5) for _ in range(4)]
        try:
            time.sleep(0.2)
            # At the limit with idle connections: the oldest idle one makes room.
            assert _get(t.url + "/ping") == (200, {"ok": True})
            assert app.http is not None and app.http.server.evicted >= 1
            assert _closed_by_server(idle[0], time.monotonic() + 5) == b""
        finally:
            for s in idle:
                s.close()
        time.sleep(0.2)
        # Every connection busy with a request: a new one gets a 503 at once.
        busy = []
        try:
            for _ in range(4):
                s = socket.create_connection(addr, timeout=5)
                s.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
                busy.append(s)
            time.sleep(0.3)
            status, body = _get(t.url + "/ping")
            assert status == 503
            assert body["error"]["code"] == "too_many_connections"
            assert app.http.server.rejected >= 1
            t.call(lambda: _set(app.release))
            for s in busy:
                assert (_closed_by_server(s, time.monotonic() + 1) or b"HTTP/1.1 200") .startswith(b"HTTP/1.1 200")
        finally:
            for s in busy:
                s.close()
        assert _get(t.url + "/ping") == (200, {"ok": True})


async def _set(ev: asyncio.Event | None) -> None:
    assert ev is not None
    ev.set()


def test_limits_are_validated() -> None:
    from pdkv.errors import InvalidArgument

    for kw in ({"max_connections": 0}, {"keepalive_timeout_s": 0}, {"body_timeout_s": -1}):
        with pytest.raises(InvalidArgument):
            ServerLimits(**kw)


def test_cli_has_connection_flags() -> None:
    from pdkv.serving.cli import build_parser

    for role in ("proxy", "prefill", "decode", "colocated"):
        extra = ["--decode", "http://x:1"] if role == "proxy" else []
        a = build_parser().parse_args([role, *extra, "--max-connections", "10", "--keepalive-timeout", "3",
                                       "--body-timeout", "4"])
        assert (a.max_connections, a.keepalive_timeout, a.body_timeout) == (10, 3.0, 4.0)
    a = build_parser().parse_args(["colocated", "--max-body-bytes", "1234"])
    assert a.max_body_bytes == 1234


def test_invalid_flag_combination_fails_before_loading_the_model(tmp_path, caplog) -> None:
    from pdkv.serving import cli

    loaded = []
    import pdkv.serving.models as models

    orig = models.load_model
    models.load_model = lambda *a, **k: loaded.append(a) or orig(*a, **k)
    try:
        rc = cli.main(["colocated", "--model", str(tmp_path), "--mode", "chunked", "--max-batch-tokens", "32"])
    finally:
        models.load_model = orig
    assert rc == 1 and not loaded
    assert "max_batch_tokens (32)" in caplog.text and "--max-batch-tokens" in caplog.text
    rc = cli.main(["colocated", "--model", str(tmp_path / "missing")])
    assert rc == 1 and "is not a model directory" in caplog.text
