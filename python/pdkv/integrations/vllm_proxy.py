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


def make_app(prefill: Sequence[str], decode: Sequence[str], *, timeout_s: float = 600.0) -> Any:
    """The aiohttp application of the proxy (see the module docstring)."""
    from aiohttp import ClientSession, ClientTimeout, web

    if not prefill or not decode:
        raise ValueError("need at least one prefill and one decode URL")
    prefill = [u.rstrip("/") for u in prefill]
    decode = [u.rstrip("/") for u in decode]
    rr_p, rr_d = itertools.cycle(prefill), itertools.cycle(decode)
    app = web.Application(client_max_size=64 << 20)
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
                return web.Response(status=503, text=f"{u}: {type(e).__name__}: {e}")
        return web.Response(text="ok")

    async def models(request: Any) -> Any:
        async with state["session"].get(next(rr_d) + "/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def generate(request: Any) -> Any:
        s = state["session"]
        path = request.path
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"error": {"message": f"invalid JSON: {e}", "type": "BadRequest"}}, status=400)
        p_url, d_url = next(rr_p), next(rr_d)
        async with s.post(p_url + path, json=_prefill_body(body)) as r:
            if r.status != 200:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            pre = await r.json()
        params = pre.get("kv_transfer_params")
        if not params:
            log.warning("prefill %s returned no kv_transfer_params: decode computes the prompt itself", p_url)
        d_body = dict(body)
        if params:
            d_body["kv_transfer_params"] = params
        async with s.post(d_url + path, json=d_body) as r:
            resp = web.StreamResponse(status=r.status, headers={k: v for k, v in r.headers.items()
                                                                if k.lower() not in _HOP_HEADERS})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
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
    a = ap.parse_args(argv)
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("prefill %s, decode %s, listening on %s:%d", a.prefill, a.decode, a.host, a.port)
    web.run_app(make_app(a.prefill, a.decode, timeout_s=a.timeout), host=a.host, port=a.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
