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


# ---------------------------------------------------------------- faults (issue 31)
def _fault_app(handler) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    return app


async def _dead_url() -> str:
    """A URL where nothing listens (a port just released)."""
    runner, url = await _serve(web.Application())
    await runner.cleanup()
    return url


def _run_faults(prefill_app, decode_app, body: dict, *, dead: str = "", stream_until_done: bool = False,
                **proxy_kw) -> tuple[int, object, list]:
    """Serves the two fakes (or a dead URL for ``dead`` = "prefill"/"decode") behind the
    proxy, posts ``body`` and returns (status, JSON answer or streamed text, seen)."""
    async def main():
        runners, urls = [], {}
        try:
            for role, app in (("prefill", prefill_app), ("decode", decode_app)):
                if dead == role:
                    urls[role] = await _dead_url()
                else:
                    r, urls[role] = await _serve(app)
                    runners.append(r)
            proxy, purl = await _serve(make_app([urls["prefill"]], [urls["decode"]], **proxy_kw))
            runners.append(proxy)
            async with aiohttp.ClientSession() as s:
                async with s.post(purl + "/v1/completions", json=body) as r:
                    if stream_until_done:
                        text = b""
                        async for chunk in r.content.iter_any():
                            text += chunk
                            if b"[DONE]" in text:
                                break  # leave before the stream ends
                        r.close()
                        await asyncio.sleep(0.5)  # the proxy writes the rest to a gone client
                        return r.status, text.decode()
                    return r.status, await r.json(content_type=None)
        finally:
            for r in reversed(runners):
                await r.cleanup()

    return asyncio.run(main())


def _no_tracebacks(caplog) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelname == "ERROR" or "Traceback" in r.getMessage()]
    assert bad == [], [r.getMessage() for r in bad]


def _openai_error(body, status: int) -> str:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["type"], err
    return err["message"]


def test_prefill_down_is_an_openai_503_with_one_log_line(caplog):
    seen: list = []
    status, body = _run_faults(None, _fake_vllm("decode", seen), {"prompt": [1], "max_tokens": 3}, dead="prefill")
    assert status == 503
    assert "no prefill instance answered" in _openai_error(body, 503)
    assert seen == []
    _no_tracebacks(caplog)
    assert sum("did not answer" in r.getMessage() for r in caplog.records) == 1


def test_prefill_down_falls_back_to_decode_when_asked(caplog):
    seen: list = []
    status, body = _run_faults(None, _fake_vllm("decode", seen), {"prompt": [1], "max_tokens": 3}, dead="prefill",
                               fallback="decode")
    assert status == 200 and body["choices"][0]["text"] == "hello"
    (role, _path, d_body), = seen
    assert role == "decode" and "kv_transfer_params" not in d_body  # decode prefills it itself
    _no_tracebacks(caplog)


def test_frozen_prefill_times_out_to_504_or_the_fallback(caplog):
    async def frozen(request: web.Request) -> web.Response:
        await asyncio.sleep(3)  # past the proxy's 0.5 s prefill deadline
        return web.json_response({})

    seen: list = []
    status, body = _run_faults(_fault_app(frozen), _fake_vllm("decode", seen), {"prompt": [1], "max_tokens": 3},
                               prefill_timeout_s=0.5)
    assert status == 504 and seen == []
    _openai_error(body, 504)
    status, body = _run_faults(_fault_app(frozen), _fake_vllm("decode", seen), {"prompt": [1], "max_tokens": 3},
                               prefill_timeout_s=0.5, fallback="decode")
    assert status == 200 and [r for r, _, _ in seen] == ["decode"]
    _no_tracebacks(caplog)


def test_keepalive_connection_closed_by_the_instance_is_retried(caplog):
    """The second request finds the pooled connection closed by prefill without an
    answer (what a vLLM that was frozen does to idle keep-alive connections): the
    proxy retries it once on a new connection and the client never sees it."""
    calls = {"n": 0}

    async def flaky(request: web.Request) -> web.Response:
        calls["n"] += 1
        await request.read()
        if calls["n"] == 2:
            request.transport.close()  # drop the connection, no answer
            await asyncio.sleep(0.1)
        return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": PARAMS})

    seen: list = []

    async def main():
        runners = []
        try:
            rp, up = await _serve(_fault_app(flaky))
            rd, ud = await _serve(_fake_vllm("decode", seen))
            rx, ux = await _serve(make_app([up], [ud]))
            runners += [rp, rd, rx]
            out = []
            async with aiohttp.ClientSession() as s:
                for _ in range(2):
                    async with s.post(ux + "/v1/completions", json={"prompt": [1], "max_tokens": 2}) as r:
                        out.append((r.status, await r.json()))
            return out
        finally:
            for r in reversed(runners):
                await r.cleanup()

    out = asyncio.run(main())
    assert [st for st, _ in out] == [200, 200], out
    assert calls["n"] == 3  # one retry
    assert len(seen) == 2 and all(b["kv_transfer_params"] == PARAMS for _, _, b in seen)
    _no_tracebacks(caplog)


def test_decode_errors_are_json_and_decode_down_is_502(caplog):
    async def plain500(request: web.Request) -> web.Response:
        return web.Response(status=500, text="Internal Server Error")

    seen: list = []
    status, body = _run_faults(_fake_vllm("prefill", seen), _fault_app(plain500), {"prompt": [1], "max_tokens": 3})
    assert status == 500 and "Internal Server Error" in _openai_error(body, 500)
    status, body = _run_faults(_fake_vllm("prefill", seen), None, {"prompt": [1], "max_tokens": 3}, dead="decode")
    assert status == 502
    _openai_error(body, 502)
    _no_tracebacks(caplog)


def test_bad_bodies_get_openai_400s():
    seen: list = []
    status, body = _run_faults(_fake_vllm("prefill", seen), _fake_vllm("decode", seen), ["not", "an", "object"])
    assert status == 400
    _openai_error(body, 400)
    assert seen == []


def test_client_leaving_after_done_is_quiet(caplog):
    async def done_then_more(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: [DONE]\n\n")
        await asyncio.sleep(0.2)
        await resp.write(b": trailing keep-alive comment\n\n" * 64)
        return resp

    seen: list = []
    status, text = _run_faults(_fake_vllm("prefill", seen), _fault_app(done_then_more),
                               {"prompt": [1], "max_tokens": 3, "stream": True}, stream_until_done=True)
    assert status == 200 and "[DONE]" in text
    _no_tracebacks(caplog)
