"""The load generator against a fake OpenAI SSE server on 127.0.0.1.

Latency bounds here are deliberately loose (a loaded 2-core CI machine): they check
that the client measures the injected delays, not how fast anything is.
"""

from __future__ import annotations

import asyncio
import io
import socket
import statistics

import pytest

from fake_openai import FakeOpenAI
from pdkv.lab.serve.client import (
    ClientConfig,
    _StreamState,
    ProgressBar,
    ServerUnavailable,
    SSEParser,
    build_body,
    normalize_base_url,
    run_trace,
    wait_until_ready,
)
from pdkv.lab.serve.metrics import SLO, RequestRecord, summarize
from pdkv.lab.serve.trace import Trace, TraceRequest


def _run(coro):
    return asyncio.run(coro)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_records_match_injected_delays():
    reqs = [TraceRequest(i, 0.05 * i, 12 + i, 6) for i in range(4)]

    async def go():
        async with FakeOpenAI(ttft_s=0.1, itl_s=0.03) as srv:
            recs = await run_trace(srv.url, Trace(tuple(reqs), seed=3))
            return srv, recs

    srv, recs = _run(go())
    assert [r.index for r in recs] == [0, 1, 2, 3]
    for r, q in zip(recs, reqs):
        assert r.ok, r.error
        assert 0.1 <= r.ttft_s < 0.35
        assert len(r.chunk_times_s) == 6 and r.output_tokens == 6
        assert 0.025 <= statistics.median(r.itls_s) < 0.1
        assert 0.0 <= r.lag_s < 0.1  # sent on schedule
        assert r.prompt_tokens == q.prompt_len  # the fake counts token ids
        assert r.finish_reason == "length" and r.http_status == 200
    sends = [r.send_s for r in recs]
    assert sends == sorted(sends) and sends[-1] - sends[0] >= 0.15 - 1e-3
    # Request bodies: greedy, streaming, exact-length token prompts, model from /v1/models.
    bodies = sorted(srv.bodies, key=lambda b: len(b["prompt"]))
    for b, q in zip(bodies, reqs):
        assert b["model"] == "fake-model" and b["stream"] is True and b["temperature"] == 0.0
        assert b["ignore_eos"] is True
        assert b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert b["max_tokens"] == 6 and len(b["prompt"]) == q.prompt_len
        assert all(isinstance(t, int) for t in b["prompt"])
    s = summarize(recs, SLO(ttft_s=1.0, itl_s=0.2))
    assert s.num_good == 4 and s.output_tokens == 24


def test_multi_token_chunks_counted_from_usage():
    reqs = [TraceRequest(0, 0.0, 4, 7)]

    async def go(**kw):
        async with FakeOpenAI(ttft_s=0.01, itl_s=0.01, tokens_per_chunk=3, **kw.pop("server", {})) as srv:
            return (await run_trace(srv.url, reqs, model="m", **kw))[0]

    final_usage = _run(go())
    assert final_usage.chunk_tokens == [1, 1, 1] and final_usage.output_tokens == 7
    per_chunk = _run(go(server={"continuous_usage": True}))
    assert per_chunk.chunk_tokens == [3, 3, 1] and per_chunk.output_tokens == 7
    no_usage = _run(go(include_usage=False))
    assert no_usage.output_tokens == 3  # no usage at all: one token per chunk
    assert no_usage.ok


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_itl_per_token_from_continuous_usage(endpoint):
    # 3 tokens per chunk, as a detokenizer holding back incomplete text sends them.
    reqs = [TraceRequest(i, 0.02 * i, 4, 6 + 3 * i) for i in range(3)]

    async def go(**server):
        async with FakeOpenAI(ttft_s=0.01, itl_s=0.03, tokens_per_chunk=3, **server) as srv:
            return srv, await run_trace(srv.url, reqs, model="m", endpoint=endpoint)

    srv, recs = _run(go(continuous_usage=True))
    assert all(b["stream_options"]["continuous_usage_stats"] is True for b in srv.bodies)
    for r, q in zip(recs, reqs):
        assert r.ok and r.usage_per_chunk
        assert sum(r.chunk_tokens) == r.output_tokens == q.output_len
        assert r.chunk_tokens == [3] * (q.output_len // 3)
        assert len(r.itls_s) == r.output_tokens - 1  # one sample per token after the first
        gaps = [b - a for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
        assert r.itls_s == [0.0, 0.0] + [g / 3 for g in gaps for _ in range(3)]  # gap / 3, three times
        assert min(gaps) >= 0.025  # the fake's 30 ms between chunks
    s = summarize(recs, SLO(ttft_s=1.0, itl_s=0.02))
    assert s.itl_per_token and s.itl.count == sum(q.output_len - 1 for q in reqs)

    # The same server without per-chunk usage: ITL falls back to per chunk, and says so.
    srv, recs = _run(go(continuous_usage=False))
    for r, q in zip(recs, reqs):
        assert r.ok and not r.usage_per_chunk and r.output_tokens == q.output_len
        assert len(r.itls_s) == len(r.chunk_times_s) - 1 < r.output_tokens - 1
    s = summarize(recs, SLO(ttft_s=1.0, itl_s=0.02))
    assert not s.itl_per_token and s.itl.count == sum(len(r.chunk_times_s) - 1 for r in recs)


def test_continuous_usage_can_be_left_out():
    body = build_body(ClientConfig(model="m", continuous_usage=False), [1, 2], 4)
    assert body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in build_body(ClientConfig(model="m", include_usage=False), [1, 2], 4)


def _chunk(text, finish=None, usage=None, chat=False):
    choice = {"index": 0, "finish_reason": finish}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    obj = {"choices": [choice]}
    if usage is not None:
        obj["usage"] = {"prompt_tokens": 5, "completion_tokens": usage}
    return obj


def test_usage_on_the_last_content_chunk_is_a_total_not_a_chunk_count():
    r = RequestRecord(0, 0.0)
    state = _StreamState(r)
    state.handle_object(_chunk("a"), 0.1)
    state.handle_object(_chunk("b"), 0.2)
    state.handle_object(_chunk("c", finish="length", usage=6), 0.3)  # 6 tokens in 3 chunks
    state.finish()
    assert r.chunk_tokens == [1, 1, 1] and r.output_tokens == 6 and r.prompt_tokens == 5
    assert r.finish_reason == "length"


def test_chunks_without_output_are_not_token_arrivals():
    r = RequestRecord(0, 0.0)
    state = _StreamState(r)
    state.handle_object({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, 0.1)
    state.handle_object(_chunk("", chat=True), 0.15)
    state.handle_object({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}, 0.2)
    state.handle_object(_chunk("x", chat=True), 0.3)
    state.handle_object(_chunk("", finish="stop", chat=True), 0.4)
    state.handle_object({"choices": [], "usage": {"completion_tokens": 2}}, 0.5)
    state.finish()
    assert r.chunk_times_s == [0.2, 0.3] and r.output_tokens == 2 and r.finish_reason == "stop"


def test_chat_endpoint_and_text_prompts():
    async def go():
        async with FakeOpenAI(ttft_s=0.01, itl_s=0.005) as srv:
            recs = await run_trace(srv.url + "/v1/", [TraceRequest(0, 0.0, 20, 5)], model="m", endpoint="chat")
            return srv, recs[0]

    srv, r = _run(go())
    assert r.ok and len(r.chunk_times_s) == 5  # the role-only chunk is not a token
    body = srv.bodies[0]
    assert "prompt" not in body and body["messages"][0]["role"] == "user"
    assert len(body["messages"][0]["content"].split()) == 20
    with pytest.raises(ValueError, match="text"):
        _run(run_trace("http://127.0.0.1:1", [TraceRequest(0, 0.0, 2, 2)], model="m", endpoint="chat",
                       prompt_kind="tokens"))
    replayed = Trace((TraceRequest(0, 0.0, 2, 2, prompt=[1, 2]),))
    with pytest.raises(ValueError, match="token-id"):
        _run(run_trace("http://127.0.0.1:1", replayed, model="m", endpoint="chat"))


def test_errors_are_recorded_and_the_run_goes_on():
    behaviours = {3: "http500", 4: "malformed", 5: "truncate", 6: "stream_error", 7: "json"}
    reqs = [TraceRequest(i, 0.02 * i, 8, n) for i, n in enumerate([2, 3, 4, 5, 6, 7, 8])]

    async def go():
        async with FakeOpenAI(ttft_s=0.02, itl_s=0.005, behaviour_by_max_tokens=behaviours) as srv:
            return await run_trace(srv.url, reqs, model="m")

    recs = {r.max_tokens: r for r in _run(go())}
    assert recs[2].ok and recs[8].ok and recs[8].output_tokens == 8
    assert recs[3].error == "HTTP 500: boom" and recs[3].http_status == 500
    assert recs[4].error.startswith("MalformedSSE:") and len(recs[4].chunk_times_s) == 2
    assert recs[5].error.startswith("IncompleteStream:")
    assert recs[6].error == "StreamError: decode worker died"
    assert recs[7].ok and len(recs[7].chunk_times_s) == 1 and recs[7].output_tokens == 7  # non-streaming answer
    for r in recs.values():
        assert r.end_s is not None and r.end_s >= r.send_s
    s = summarize(list(recs.values()), SLO(1, 1))
    assert s.num_errors == 4
    assert s.errors == {"HTTP 500": 1, "IncompleteStream": 1, "MalformedSSE": 1, "StreamError": 1}


def test_connection_refused_is_recorded():
    url = f"http://127.0.0.1:{_free_port()}"
    recs = _run(run_trace(url, [TraceRequest(i, 0.0, 3, 3) for i in range(3)], model="m", connect_timeout_s=2))
    assert all(not r.ok and r.error.startswith("ConnectionError:") for r in recs)
    assert all(r.http_status is None and r.end_s is not None for r in recs)
    with pytest.raises(ServerUnavailable):
        _run(run_trace(url, [TraceRequest(0, 0.0, 3, 3)]))  # model lookup needs the server


def test_timeout_is_recorded():
    async def go():
        async with FakeOpenAI(ttft_s=2.0) as srv:
            return await run_trace(srv.url, [TraceRequest(0, 0.0, 3, 3)], model="m", request_timeout_s=0.2)

    (r,) = _run(go())
    assert r.error.startswith("Timeout:") and 0.15 < r.end_s - r.send_s < 1.5


def test_concurrency_cap():
    reqs = [TraceRequest(i, 0.0, 4, 3) for i in range(6)]

    async def go():
        async with FakeOpenAI(ttft_s=0.05, itl_s=0.01) as srv:
            recs = await run_trace(srv.url, reqs, model="m", concurrency=2)
            return srv.max_in_flight, recs

    peak, recs = _run(go())
    assert peak <= 2 and all(r.ok for r in recs)
    lags = sorted(r.lag_s for r in recs)
    assert lags[-1] >= 0.1  # the last pair waited for two earlier pairs (~0.07 s each)


def test_progress_bar_output():
    out = io.StringIO()

    async def go():
        async with FakeOpenAI(ttft_s=0.005, itl_s=0.001) as srv:
            reqs = [TraceRequest(i, 0.0, 2, 2) for i in range(5)]
            await run_trace(srv.url, reqs, model="m", progress=out, label="x @ 1 req/s")

    _run(go())
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("x @ 1 req/s [########################] 5/5 done, 0 in flight, 0 errors")
    assert len(lines) == len(set(lines))  # no duplicate final line

    bar = ProgressBar(0, "empty", io.StringIO())
    bar.close()
    assert "0/0 done" in bar.stream.getvalue()


def test_wait_until_ready():
    async def go():
        async with FakeOpenAI() as srv:
            await wait_until_ready(srv.url, timeout_s=5)

    _run(go())
    with pytest.raises(ServerUnavailable, match="not ready"):
        _run(wait_until_ready(f"http://127.0.0.1:{_free_port()}", timeout_s=0.3, interval_s=0.1))


def test_sse_parser_handles_any_split():
    stream = (
        b": keep-alive comment\r\n\r\n"
        b"data: {\"a\": 1}\r\n\r\n"
        b"event: message\ndata:{\"b\": 2}\n\n"
        b"data: line1\ndata: line2\n\n"
        b"data: [DONE]"
    )
    whole = SSEParser()
    got = whole.feed(stream) + whole.flush()
    assert got == ['{"a": 1}', '{"b": 2}', "line1\nline2", "[DONE]"]
    bytewise = SSEParser()
    pieces = []
    for i in range(len(stream)):
        pieces += bytewise.feed(stream[i : i + 1])
    assert pieces + bytewise.flush() == got


def test_url_body_and_config_validation():
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert normalize_base_url(" https://h ") == "https://h"
    with pytest.raises(ValueError):
        normalize_base_url("127.0.0.1:8000")
    extra = {"min_tokens": 2, "temperature": 0.5}
    cfg = ClientConfig(model="m", ignore_eos=False, include_usage=False, extra_body=extra)
    body = build_body(cfg, [1, 2], 9)
    assert body == {
        "model": "m", "prompt": [1, 2], "max_tokens": 9, "temperature": 0.5, "stream": True, "min_tokens": 2
    }
    assert "api_key" not in ClientConfig(model="m", api_key="secret").to_dict()
    for bad in ({"endpoint": "embeddings"}, {"prompt_kind": "bytes"}, {"concurrency": 0}, {"request_timeout_s": 0}):
        with pytest.raises(ValueError):
            ClientConfig(model="m", **bad)
