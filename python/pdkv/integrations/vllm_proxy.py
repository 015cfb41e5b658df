"""A proxy speaking vLLM's prefill/decode disaggregation protocol.

::

    python -m pdkv.integrations.vllm_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

For each ``/v1/completions`` or ``/v1/chat/completions`` request it

1. sends the request to a prefill instance with ``max_tokens=1``, no streaming and
   ``kv_transfer_params={"do_remote_decode": true}``;
2. sends the original request to a decode instance with the ``kv_transfer_params``
   prefill answered (which blocks hold the prompt's KV and where), and relays
   decode's answer (streamed or not) to the client.

It works with any vLLM KV connector that follows this protocol (pdkv's
:class:`~pdkv.integrations.vllm.PdkvConnector`, vLLM's NixlConnector). Several
``--prefill``/``--decode`` URLs are used round-robin. ``GET /health`` answers 200
when every instance does; ``GET /v1/models`` is decode's.

Faults are answered like an OpenAI server: a JSON error object
(``{"error": {"message", "type", "code"}}``) with 503 when no prefill instance
answers (504 when they all timed out; every prefill instance is tried once first),
502 when decode does not, an instance's own 4xx/5xx relayed as JSON, one log line per
failure and never a traceback. A pooled keep-alive connection the instance closed
meanwhile is retried once on a new connection. ``--fallback decode`` sends a request
no prefill instance answered (within ``--prefill-timeout``) to decode as it is: decode
prefills the prompt itself. A client that disconnects (e.g. right after ``[DONE]``) is
not an error.

Needs ``aiohttp`` (installed with vLLM, or ``pip install pdkv[serve]``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from typing import Any, Sequence

__all__ = ["make_app", "main"]

log = logging.getLogger("pdkv.vllm_proxy")

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, and ask the connector to hand the KV over."""
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return p


def error_body(status: int, message: str, type_: str) -> dict[str, Any]:
    """An OpenAI error object (what vLLM's own server answers with)."""
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Upstream(Exception):
    """An instance did not answer (refused, reset, timed out): which one and why."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(f"{url}: {_reason(cause)}")
        self.url = url
        self.timeout = isinstance(cause, TimeoutError)


def make_app(prefill: Sequence[str], decode: Sequence[str], *, timeout_s: float = 600.0,
             prefill_timeout_s: float | None = None, fallback: str = "none") -> Any:
    """The aiohttp application of the proxy (see the module docstring).

    Parameters
    ----------
    prefill, decode : sequence of str
        Instance URLs, used round-robin.
    timeout_s : float
        Deadline of one upstream request.
    prefill_timeout_s : float, optional
        Deadline of the prefill leg (default ``timeout_s``); past it the next prefill
        instance is tried, then the fallback.
    fallback : {"none", "decode"}
        When no prefill instance answers: ``"none"`` answers 503 (or 504 on a
        timeout); ``"decode"`` sends the request to decode as it is (decode prefills
        the prompt itself).
    """
    import aiohttp
    from aiohttp import ClientSession, ClientTimeout, web

    if not prefill or not decode:
        raise ValueError("need at least one prefill and one decode URL")
    if fallback not in ("none", "decode"):
        raise ValueError(f"fallback must be 'none' or 'decode', got {fallback!r}")
    prefill = [u.rstrip("/") for u in prefill]
    decode = [u.rstrip("/") for u in decode]
    rr_p, rr_d = itertools.cycle(prefill), itertools.cycle(decode)
    p_timeout = ClientTimeout(total=prefill_timeout_s or timeout_s)
    #: what a reused keep-alive connection the peer closed looks like: retried once
    stale_conn = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
    unreachable = (aiohttp.ClientConnectionError, TimeoutError, OSError)

    @web.middleware
    async def json_errors(request: Any, handler: Any) -> Any:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.content_type == "application/json":
                raise
            return web.json_response(error_body(e.status, e.reason, "invalid_request_error"), status=e.status)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            log.info("%s %s: the client went away", request.method, request.path)
            raise
        except Exception as e:  # noqa: BLE001 - one line, a JSON 500, never a traceback per request
            log.error("%s %s: %s", request.method, request.path, _reason(e))
            return web.json_response(error_body(500, f"proxy error: {_reason(e)}", "internal_server_error"),
                                     status=500)

    app = web.Application(client_max_size=64 << 20, middlewares=[json_errors])
    state: dict[str, Any] = {}

    async def on_startup(app: Any) -> None:
        state["session"] = ClientSession(timeout=ClientTimeout(total=timeout_s))

    async def on_cleanup(app: Any) -> None:
        await state.pop("session").close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    async def health(request: Any) -> Any:
        s = state["session"]
        for u in prefill + decode:
            try:
                async with s.get(u + "/health", timeout=ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        return web.Response(status=503, text=f"{u}: HTTP {r.status}")
            except Exception as e:  # noqa: BLE001 - any failure means not healthy
                return web.Response(status=503, text=f"{u}: {_reason(e)}")
        return web.Response(text="ok")

    async def models(request: Any) -> Any:
        url = next(rr_d)
        try:
            async with state["session"].get(url + "/v1/models") as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except unreachable as e:
            log.warning("GET /v1/models: decode %s: %s", url, _reason(e))
            return web.json_response(error_body(503, f"decode instance {url} did not answer", "service_unavailable"),
                                     status=503)

    async def post(url: str, body: dict[str, Any], timeout: Any = None) -> Any:
        """Posts and returns the response (the caller releases it), retrying once when a
        reused connection turns out closed by the peer before any answer."""
        s = state["session"]
        for attempt in (0, 1):
            try:
                return await (s.post(url, json=body) if timeout is None else s.post(url, json=body, timeout=timeout))
            except stale_conn as e:
                if attempt or isinstance(e, aiohttp.ClientConnectorError):  # refused: not a stale connection
                    raise Upstream(url, e) from None
                log.info("%s: %s; retrying on a new connection", url, _reason(e))
            except unreachable as e:
                raise Upstream(url, e) from None
        raise AssertionError("unreachable")

    async def relay_error(r: Any) -> Any:
        """An instance's error answer, as JSON whatever it sent."""
        raw = await r.read()
        try:
            obj = json.loads(raw)
            if isinstance(obj, dict) and "error" in obj:
                return web.json_response(obj, status=r.status)
        except ValueError:
            pass
        text = raw.decode("utf-8", "replace").strip()[:500] or r.reason or "error"
        kind = "invalid_request_error" if r.status < 500 else "upstream_error"
        return web.json_response(error_body(r.status, text, kind), status=r.status)

    async def run_prefill(path: str, body: dict[str, Any]) -> tuple[Any, list[str], bool]:
        """Prefill on one instance after another: (its JSON answer or an error
        response, the failures seen, whether every failure was a timeout)."""
        failures: list[str] = []
        all_timeouts = True
        for _ in range(len(prefill)):
            url = next(rr_p)
            try:
                r = await post(url + path, _prefill_body(body), p_timeout)
            except Upstream as e:
                failures.append(str(e))
                all_timeouts &= e.timeout
                log.warning("prefill %s did not answer: %s", url, e)
                continue
            all_timeouts = False
            async with r:
                if r.status >= 500:
                    failures.append(f"{url}: HTTP {r.status}")
                    log.warning("prefill %s answered HTTP %d", url, r.status)
                    continue
                if r.status != 200:
                    return await relay_error(r), failures, False
                try:
                    return await r.json(content_type=None), failures, False
                except (ValueError, aiohttp.ClientPayloadError) as e:
                    failures.append(f"{url}: bad answer ({_reason(e)})")
                    log.warning("prefill %s: bad answer: %s", url, _reason(e))
        return None, failures, all_timeouts

    async def generate(request: Any) -> Any:
        path = request.path
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response(error_body(400, f"invalid JSON: {e}", "invalid_request_error"), status=400)
        if not isinstance(body, dict):
            return web.json_response(error_body(400, "the request body must be a JSON object",
                                                "invalid_request_error"), status=400)
        pre, failures, timed_out = await run_prefill(path, body)
        if isinstance(pre, web.Response):
            return pre
        d_body = dict(body)
        if pre is None:
            if fallback != "decode":
                status = 504 if timed_out else 503
                return web.json_response(error_body(status, "no prefill instance answered: " + "; ".join(failures),
                                                    "service_unavailable"), status=status)
            log.warning("no prefill instance answered; decode prefills the prompt itself")
        else:
            params = pre.get("kv_transfer_params") if isinstance(pre, dict) else None
            if params:
                d_body["kv_transfer_params"] = params
            else:
                log.warning("prefill returned no kv_transfer_params: decode computes the prompt itself")
        d_url = next(rr_d)
        try:
            r = await post(d_url + path, d_body)
        except Upstream as e:
            log.warning("decode %s did not answer: %s", d_url, e)
            return web.json_response(error_body(502, f"decode instance did not answer: {e}", "upstream_error"),
                                     status=502)
        async with r:
            if r.status != 200:
                return await relay_error(r)
            resp = web.StreamResponse(status=r.status, headers={k: v for k, v in r.headers.items()
                                                                if k.lower() not in _HOP_HEADERS})
            await resp.prepare(request)
            try:
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                # the client left (often right after [DONE]): nothing to answer
                log.debug("%s: the client disconnected", path)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
                log.warning("decode %s: the stream broke: %s", d_url, _reason(e))
            return resp

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdkv.integrations.vllm_proxy",
                                 description="Prefill/decode proxy for vLLM instances with a KV connector.")
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instance URL(s)")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instance URL(s)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    ap.add_argument("--prefill-timeout", type=float, help="seconds the prefill leg may take before the next "
                    "prefill instance (then the fallback) is tried (default: --timeout)")
    ap.add_argument("--fallback", choices=["none", "decode"], default="none",
                    help="when no prefill instance answers: 'none' answers 503/504, 'decode' lets decode "
                    "prefill the prompt itself (default none)")
    a = ap.parse_args(argv)
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("prefill %s, decode %s, listening on %s:%d", a.prefill, a.decode, a.host, a.port)
    web.run_app(make_app(a.prefill, a.decode, timeout_s=a.timeout, prefill_timeout_s=a.prefill_timeout,
                         fallback=a.fallback), host=a.host, port=a.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
