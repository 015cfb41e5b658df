"""The P/D proxy speaks vLLM's disaggregation protocol (fake vLLM servers; no vLLM
needed), and the vLLM integration stays out of ``import pdkv``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from pdkv.integrations.vllm_proxy import _prefill_body, make_app  # noqa: E402

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 9],
          "remote_agents": ["127.0.0.1:1"], "remote_request_id": "p-1", "remote_num_tokens": 200}


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _fake_vllm(role: str, seen: list) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((role, request.path, body))
        if role == "prefill":
            return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if not body.get("stream"):
            return web.json_response({"id": "d", "choices": [{"text": "hello"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("he", "llo"):
            await resp.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": f"model-{role}"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def test_prefill_body_asks_for_one_token_and_the_kv():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    p = _prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is untouched


def test_proxy_runs_prefill_then_decode_with_its_params():
    seen: list = []

    async def main() -> tuple:
        runners = []
        try:
            for role in ("prefill", "decode"):
                r, url = await _serve(_fake_vllm(role, seen))
                runners.append((r, url))
            proxy, purl = await _serve(make_app([runners[0][1]], [runners[1][1]]))
            runners.append((proxy, purl))
            async with aiohttp.ClientSession() as s:
                async with s.get(purl + "/health") as r:
                    health = r.status
                async with s.get(purl + "/v1/models") as r:
                    models = await r.json()
                async with s.post(purl + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 8}) as r:
                    plain = await r.json()
                async with s.post(purl + "/v1/chat/completions",
                                  json={"messages": [], "max_tokens": 8, "stream": True}) as r:
                    streamed = (await r.read()).decode()
            return health, models, plain, streamed
        finally:
            for r, _ in reversed(runners):
                await r.cleanup()

    health, models, plain, streamed = asyncio.run(main())
    assert health == 200
    assert models["data"][0]["id"] == "model-decode"
    assert plain["choices"][0]["text"] == "hello"
    assert streamed.count("data: ") == 3 and streamed.endswith("data: [DONE]\n\n")
    roles = [(role, path) for role, path, _ in seen]
    assert roles == [("prefill", "/v1/completions"), ("decode", "/v1/completions"),
                     ("prefill", "/v1/chat/completions"), ("decode", "/v1/chat/completions")]
    for role, _path, body in seen:
        if role == "prefill":
            assert body["max_tokens"] == 1 and body["stream"] is False
            assert body["kv_transfer_params"]["do_remote_decode"] is True
        else:
            assert body["kv_transfer_params"] == PARAMS and body["max_tokens"] == 8
    assert seen[3][2]["stream"] is True


def test_prefill_error_is_returned_to_the_client():
    async def main() -> tuple[int, dict]:
        async def fail(request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "boom"}}, status=400)

        bad = web.Application()
        bad.router.add_post("/v1/completions", fail)
        seen: list = []
        r1, purl_p = await _serve(bad)
        r2, purl_d = await _serve(_fake_vllm("decode", seen))
        r3, purl = await _serve(make_app([purl_p], [purl_d]))
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(purl + "/v1/completions", json={"prompt": "x", "max_tokens": 3}) as r:
                    return r.status, await r.json(), seen
        finally:
            for r in (r3, r2, r1):
                await r.cleanup()

    status, body, seen = asyncio.run(main())
    assert status == 400 and body["error"]["message"] == "boom"
    assert seen == []  # decode never saw it


def test_import_pdkv_does_not_import_vllm():
    code = ("import sys, pdkv, pdkv.integrations, pdkv.integrations.vllm_proxy, pdkv.integrations.vllm_deploy; "
            "bad = [m for m in ('vllm', 'torch', 'aiohttp') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_tiny_llama_doc_example():
    import doctest

    import pdkv.integrations.tiny_llama as tl

    res = doctest.testmod(tl)
    assert res.attempted > 0 and res.failed == 0


def test_bench_table_and_percentiles():
    from pdkv.lab.vllm.bench import _pct, table

    assert _pct([], 50) is None
    assert _pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and _pct([5.0], 90) == 5.0
    row = {"connector": "pdkv", "transport": ["shm"], "kv_wait_s": {"p50": 0.0067, "p90": 0.0214},
           "ttft_s": {"p50": 0.296, "p90": 0.41}, "bytes_per_request": 16 << 20, "bytes_total": 320 << 20,
           "pulls": 20, "failed_pulls": 1, "idle_cores": {"prefill": 0.016, "decode": 0.015}}
    lines = table([row]).splitlines()
    assert lines[0].startswith("| connector | KV pull p50 (ms)")
    assert lines[2] == "| pdkv (shm) | 6.7 | 21.4 | 296.0 | 410.0 | 16 | 320 | 19/20 | 0.03 |"
