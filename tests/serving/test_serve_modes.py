"""The proxy over in-process workers: greedy output in colocated, chunked, disagg and
hybrid modes equals ``model.generate`` for concurrent requests; the official openai
client, streaming and not; bad requests; /metrics; KV transfer failures and dead
workers."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from servers import (HYBRID_THRESHOLD, MAX_NEW, Stack, completion_ids, concurrently, get,  # noqa: E402
                     post, stream, tiny)  # tiny: a fixture


@pytest.fixture(scope="module")
def stack(tiny):
    s = Stack()
    try:
        s.p = s.worker(tiny, "prefill")
        # Small step budgets so that prompts are prefilled in chunks next to decodes.
        s.d = s.worker(tiny, "decode", mode="chunked", max_batch_tokens=16)
        s.col = s.worker(tiny, "colocated", mode="colocated")
        s.chk = s.worker(tiny, "colocated", mode="chunked", max_batch_tokens=16)
        s.proxies = {
            "colocated": s.proxy("colocated", decode=[s.col]),
            "chunked": s.proxy("colocated", decode=[s.chk]),
            "disagg": s.proxy("disagg", prefill=[s.p], decode=[s.d]),
            "hybrid": s.proxy("hybrid", prefill=[s.p], decode=[s.d], hybrid_threshold=HYBRID_THRESHOLD),
        }
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["colocated", "chunked", "disagg", "hybrid"])
def test_greedy_through_proxy_equals_generate(tiny, stack, mode: str, streamed: bool) -> None:
    base = stack.proxies[mode]
    results = concurrently(lambda p: completion_ids(base, tiny.name, p, streamed=streamed), tiny.prompts)
    assert [ids for ids, _ in results] == tiny.refs
    for (_ids, st), p in zip(results, tiny.prompts):
        assert st["recomputed"] is False
        if mode in ("colocated", "chunked"):
            assert st["route"] == "local"
        elif mode == "disagg" or len(p) > HYBRID_THRESHOLD:
            assert st["route"] == "disagg" and st["kv_transport"] == "shm" and st["kv_bytes"] > 0
            assert st["prefill_worker"] == stack.p and st["decode_worker"] == stack.d
        else:
            assert st["route"] == "local" and st["kv_bytes"] == 0


def test_colocated_worker_serves_the_openai_api_itself(tiny, stack) -> None:
    ids, st = completion_ids(stack.col, tiny.name, tiny.prompts[3])
    assert ids == tiny.refs[3] and st["route"] == "engine"


def test_first_token_ends_the_request(tiny, stack) -> None:
    for mode in ("disagg", "hybrid", "colocated"):
        ids, st = completion_ids(stack.proxies[mode], tiny.name, tiny.prompts[4], max_tokens=1)
        assert ids == tiny.refs[4][:1]
    # the decode worker got the notification only and freed the reservation
    assert stack.workers[stack.d].engine.num_free_blocks == stack.workers[stack.d].engine.pool.num_blocks


def test_openai_client_streaming_and_not(tiny, stack) -> None:
    openai = pytest.importorskip("openai")
    tok = tiny.codec.tokenizer
    with openai.OpenAI(base_url=stack.proxies["disagg"] + "/v1", api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [tiny.name]
        text = tok.decode(tiny.prompts[2], skip_special_tokens=True)
        expect_ids = client.completions.create(model=tiny.name, prompt=tiny.prompts[2], max_tokens=MAX_NEW,
                                               temperature=0, extra_body={"return_token_ids": True})
        assert expect_ids.choices[0].model_extra["token_ids"] == tiny.refs[2]
        assert expect_ids.usage.prompt_tokens == len(tiny.prompts[2])
        assert expect_ids.choices[0].text == tok.decode(tiny.refs[2], skip_special_tokens=True)
        full = client.completions.create(model=tiny.name, prompt=text, max_tokens=MAX_NEW, temperature=0)
        parts = client.completions.create(model=tiny.name, prompt=text, max_tokens=MAX_NEW, temperature=0,
                                          stream=True, stream_options={"include_usage": True})
        chunks = list(parts)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason

        messages = [{"role": "user", "content": "hello, tiny model"}]
        chat = client.chat.completions.create(model=tiny.name, messages=messages, max_tokens=MAX_NEW, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.prompt_tokens == len(tiny.codec.chat(messages))
        pieces = list(client.chat.completions.create(model=tiny.name, messages=messages, max_tokens=MAX_NEW,
                                                     temperature=0, stream=True))
        assert pieces[0].choices[0].delta.role == "assistant"
        assert "".join(p.choices[0].delta.content or "" for p in pieces) == chat.choices[0].message.content
        assert pieces[-1].choices[0].finish_reason == chat.choices[0].finish_reason

        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="nope", prompt="x", max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=tiny.name, messages=messages, max_tokens=-3)


def test_sampling_is_seeded_and_mode_independent(tiny, stack) -> None:
    body = {"model": tiny.name, "prompt": tiny.prompts[4], "max_tokens": 8, "temperature": 1.0, "seed": 1234,
            "return_token_ids": True, "ignore_eos": True}
    outs = {m: post(stack.proxies[m] + "/v1/completions", body)[1]["choices"][0]["token_ids"]
            for m in ("colocated", "disagg", "hybrid")}
    assert outs["colocated"] == outs["disagg"] == outs["hybrid"] and len(outs["disagg"]) == 8


def test_stop_strings_end_the_answer(tiny, stack) -> None:
    base = stack.proxies["disagg"]
    text = tiny.codec.tokenizer.decode(tiny.refs[3], skip_special_tokens=True)
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[:i + 2]
                 and text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the reference answer has no usable stop string")
    body = {"model": tiny.name, "prompt": tiny.prompts[3], "max_tokens": MAX_NEW, "temperature": 0, "stop": [stop]}
    status, obj = post(base + "/v1/completions", body)
    assert status == 200
    assert obj["choices"][0]["finish_reason"] == "stop"
    assert obj["choices"][0]["text"] == text[:text.find(stop)]
    chunks = stream(base + "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c.get("choices")) == text[:text.find(stop)]


BAD = [
    ("completions", {"prompt": [1, 2]}, 400, "model"),
    ("completions", {"model": "nope", "prompt": [1, 2]}, 404, "model"),
    ("completions", {"model": "M", "prompt": ""}, 400, "prompt"),
    ("completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("completions", {"model": "M"}, 400, "prompt"),
    ("completions", {"model": "M", "prompt": [[1], [2]]}, 400, "prompt"),
    ("completions", {"model": "M", "prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"model": "M", "prompt": [5] * 3000}, 400, "prompt"),
    ("completions", {"model": "M", "prompt": [5, 6], "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"model": "M", "prompt": [5, 6], "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "M", "prompt": [5, 6], "max_tokens": 1.5}, 400, "max_tokens"),
    ("completions", {"model": "M", "prompt": [5, 6], "max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {"model": "M", "prompt": [5, 6], "temperature": -0.5}, 400, "temperature"),
    ("completions", {"model": "M", "prompt": [5, 6], "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": "M", "prompt": [5, 6], "top_p": 0}, 400, "top_p"),
    ("completions", {"model": "M", "prompt": [5, 6], "n": 2}, 400, "n"),
    ("completions", {"model": "M", "prompt": [5, 6], "logprobs": 3}, 400, "logprobs"),
    ("completions", {"model": "M", "prompt": [5, 6], "stop": 7}, 400, "stop"),
    ("completions", {"model": "M", "prompt": [5, 6], "stream": "yes"}, 400, "stream"),
    ("chat", {"model": "M", "messages": []}, 400, "messages"),
    ("chat", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat", {"model": "M", "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat", {"model": "M", "messages": [{"role": "user", "content": "x" * 3000}]}, 400, "messages"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(tiny, stack, endpoint: str, body: dict, status: int, param: str) -> None:
    if body.get("model") == "M":
        body = {**body, "model": tiny.name}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    got, obj = post(stack.proxies["hybrid"] + path, body)
    assert got == status, obj
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_malformed_json_is_a_400(stack) -> None:
    status, obj = post(stack.proxies["disagg"] + "/v1/completions", b"{not json")
    assert status == 400 and obj["error"]["type"] == "invalid_request_error"


def _parse_prometheus(text: str) -> dict[str, dict]:
    """A strict reader of the text format: families with TYPE/HELP and their samples."""
    import math
    import re

    families: dict[str, dict] = {}
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
                        r'(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*)?\})? (\S+)$')
    current = None
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            families.setdefault(name, {"samples": []})["help"] = line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped")
            families.setdefault(name, {"samples": []})["type"] = kind
            current = name
        else:
            m = sample.match(line)
            assert m, f"not a sample line: {line!r}"
            value = float(m.group(5))
            assert not math.isnan(value)
            assert current is not None and m.group(1).startswith(current), line
            families[current]["samples"].append((m.group(1), m.group(3) or "", value))
    for name, fam in families.items():
        assert "type" in fam and "help" in fam, name
        if fam["type"] == "histogram":
            for s in fam["samples"]:
                assert s[0] in (name + "_bucket", name + "_sum", name + "_count"), s
    return families


def test_metrics_parse_as_prometheus_text(tiny, stack) -> None:
    base = stack.proxies["hybrid"]
    completion_ids(base, tiny.name, tiny.prompts[0])
    completion_ids(base, tiny.name, tiny.prompts[4], streamed=True)
    status, text = get(base + "/metrics")
    assert status == 200
    fams = _parse_prometheus(text)
    for name in ("pdkv_time_to_first_token_seconds", "pdkv_inter_token_latency_seconds",
                 "pdkv_e2e_request_latency_seconds", "pdkv_kv_transfer_span_seconds",
                 "pdkv_kv_transfer_tail_seconds", "pdkv_kv_transfer_wire_seconds"):
        assert fams[name]["type"] == "histogram"
    count = {s[0]: s[2] for s in fams["pdkv_time_to_first_token_seconds"]["samples"]}
    assert count["pdkv_time_to_first_token_seconds_count"] >= 2
    routed = {s[1]: s[2] for s in fams["pdkv_routed_requests_total"]["samples"]}
    assert routed['route="local"'] >= 1 and routed['route="disagg"'] >= 1
    assert any(s[2] > 0 for s in fams["pdkv_kv_transfer_bytes_total"]["samples"])
    for name in ("pdkv_kv_recomputes_total", "pdkv_worker_failures_total", "pdkv_worker_queue_depth",
                 "pdkv_requests_in_flight", "pdkv_worker_up"):
        assert name in fams
    up = {s[1]: s[2] for s in fams["pdkv_worker_up"]["samples"]}
    assert len(up) == 2 and all(v == 1 for v in up.values())
    # the workers' own metrics too
    for url in (stack.p, stack.d):
        status, text = get(url + "/metrics")
        assert status == 200 and "pdkv_engine_waiting" in _parse_prometheus(text)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_kv_transfer_failure_recomputes_on_decode(tiny, stack) -> None:
    # The decode worker hands out an agent address nobody listens on: the prefill
    # worker cannot push the KV, and the decode worker recomputes the prompt.
    bad_d = stack.worker(tiny, "decode", agent_advertise=f"127.0.0.1:{_closed_port()}")
    base = stack.proxy("disagg", prefill=[stack.p], decode=[bad_d])
    results = concurrently(lambda p: completion_ids(base, tiny.name, p), tiny.prompts[2:])
    assert [ids for ids, _ in results] == tiny.refs[2:]
    for _ids, st in results:
        assert st["recomputed"] is True and st["recompute_reason"] == "kv_failed"
        assert "PeerConnectionError" in st["kv_error"] or "Connect" in st["kv_error"], st["kv_error"]
    fams = _parse_prometheus(get(base + "/metrics")[1])
    assert {s[1]: s[2] for s in fams["pdkv_kv_recomputes_total"]["samples"]}['reason="kv_failed"'] == 3
    eng = stack.workers[bad_d].engine
    assert eng.num_free_blocks == eng.pool.num_blocks  # nothing leaked or quarantined


def test_lost_kv_times_out_and_recomputes_into_the_same_blocks_at_once(tiny, stack) -> None:
    # The prefill worker "loses" the KV (skips the write, reports success): the decode
    # worker gives up after the KV timeout, bumps the reserved blocks' generations (a
    # late write would now fail) and recomputes, reusing the blocks at once.
    drop_p = stack.worker(tiny, "prefill", debug_drop_kv=True)
    d2 = stack.worker(tiny, "decode", kv_margin_s=0.2)
    base = stack.proxy("disagg", prefill=[drop_p], decode=[d2], kv_timeout_s=0.5)
    ids, st = completion_ids(base, tiny.name, tiny.prompts[4])
    assert ids == tiny.refs[4]
    assert st["recomputed"] is True and st["recompute_reason"] == "kv_timeout"
    worker = stack.workers[d2]
    assert worker.stats()["invalidated_reservations"] == 1
    deadline = time.monotonic() + 5
    while worker.engine.num_free_blocks != worker.engine.pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.engine.num_free_blocks == worker.engine.pool.num_blocks
    fams = _parse_prometheus(get(d2 + "/metrics")[1])
    assert fams["pdkv_kv_invalidated_total"]["samples"][0][2] == 1


def _pd_decode(url: str, body: dict) -> list[dict]:
    """The NDJSON lines of a /pd/decode request, in order (the stream is read to its end)."""
    import urllib.request

    from servers import signed

    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/pd/decode", data=data,
                                 headers={"Content-Type": "application/json",
                                          **signed("POST", url + "/pd/decode", data)})
    with urllib.request.urlopen(req, timeout=60) as r:
        return [json.loads(line) for line in r.read().decode().splitlines() if line.strip()]


def test_a_late_kv_write_cannot_land_in_reused_blocks(tiny, stack) -> None:
    """The race the generations close: a decode worker gives up on a request's KV and
    reuses its blocks at once (no quarantine); the prefill side's write arrives after
    that, and fails with StaleBlock at the decode worker's agent before any byte lands."""
    import torch

    import pdkv
    from pdkv.serving.kv_pool import PagedKVPool
    from pdkv.serving.protocol import GenerateRequest, GenParams, Reservation
    from servers import SECRET

    d2 = stack.worker(tiny, "decode", kv_margin_s=0.1)
    worker = stack.workers[d2]
    prompt = tiny.prompts[4]
    body = GenerateRequest("late-1", tuple(prompt), GenParams(max_tokens=MAX_NEW, temperature=0.0, seed=1),
                           kv_timeout_s=0.2).to_json()
    lines = _pd_decode(d2, body)  # nobody delivers the KV: the decode worker recomputes
    res = Reservation.from_json(lines[0]["reserved"])
    assert len(res.generations) == len(res.blocks)
    assert lines[-1]["done"]["recomputed"] is True and lines[-1]["done"]["recompute_reason"] == "kv_timeout"
    assert [ln["t"] for ln in lines if "t" in ln] == tiny.refs[4]
    assert worker.engine.num_free_blocks == worker.engine.pool.num_blocks  # reused at once
    with pdkv.Agent("late-prefill", secret=SECRET, transports=["tcp"]) as a:
        mine = PagedKVPool.shared(a, worker.engine.pool.geometry)
        peer = a.connect(res.agent)
        n = len(res.blocks)
        assert a.read(peer, pdkv.Blocks("kv", list(range(n))),
                      pdkv.Blocks("kv", list(res.blocks))).wait(10)  # unchecked: a snapshot
        before = mine.storage.clone()
        mine.storage.fill_(7.0)
        late = a.write(peer, pdkv.Blocks("kv", list(range(n))),
                       pdkv.Blocks("kv", list(res.blocks), generations=list(res.generations)), notify=b"late-1")
        with pytest.raises(pdkv.StaleBlock):
            late.wait(10)
        assert a.read(peer, pdkv.Blocks("kv", list(range(n))), pdkv.Blocks("kv", list(res.blocks))).wait(10)
        # The decode worker's blocks hold what they held before the late write (blocks
        # 0..n-1 of `mine` were just read back from them; `before` is the snapshot).
        assert torch.equal(mine.storage[:, :, :n], before[:, :, :n])
        assert not torch.equal(mine.storage[:, :, :n], torch.full_like(before[:, :, :n], 7.0))
    assert worker.stats()["awaiting_kv"] == 0


def test_dead_workers_are_skipped_or_answered_clearly(tiny, stack) -> None:
    # A prefill worker that went away: the other one serves.
    gone = stack.worker(tiny, "prefill")
    base = stack.proxy("disagg", prefill=[gone, stack.p], decode=[stack.d])
    stack.stop(gone)
    for p, ref in zip(tiny.prompts[2:], tiny.refs[2:]):
        ids, st = completion_ids(base, tiny.name, p)
        assert ids == ref and st["recomputed"] is False and st["prefill_worker"] == stack.p
    fams = _parse_prometheus(get(base + "/metrics")[1])
    failures = {s[1]: s[2] for s in fams["pdkv_worker_failures_total"]["samples"]}
    assert failures == {f'role="prefill",worker="{gone}"': 1}  # then it stays out of rotation
    # A decode worker that went away: retried on the live one before any token was sent.
    gone = stack.worker(tiny, "decode")
    base = stack.proxy("disagg", prefill=[stack.p], decode=[gone, stack.d])
    stack.stop(gone)
    retries = []
    for p, ref in zip(tiny.prompts, tiny.refs):
        ids, st = completion_ids(base, tiny.name, p)
        assert ids == ref and st["decode_worker"] == stack.d
        retries.append(st["retries"])
    assert sum(retries) == 1
    # No prefill worker alive at all: the decode worker computes everything.
    gone = stack.worker(tiny, "prefill")
    base = stack.proxy("disagg", prefill=[gone], decode=[stack.d])
    stack.stop(gone)
    for _ in range(2):
        ids, st = completion_ids(base, tiny.name, tiny.prompts[4])
        assert ids == tiny.refs[4] and st["recomputed"] is True and st["recompute_reason"] == "kv_failed"
    # No decode worker alive: a clear 503, at once.
    gone = stack.worker(tiny, "decode")
    base = stack.proxy("disagg", prefill=[stack.p], decode=[gone])
    stack.stop(gone)
    for _ in range(2):
        status, obj = post(base + "/v1/completions", {"model": tiny.name, "prompt": [9, 9], "max_tokens": 2})
        assert status == 503 and obj["error"]["code"] == "no_worker_available", obj
        assert "decode worker" in obj["error"]["message"]
    status, health = get(base + "/health")
    assert status == 503 and '"up": false' in health


def test_requests_spread_over_workers_by_load(tiny, stack) -> None:
    p2 = stack.worker(tiny, "prefill")
    d2 = stack.worker(tiny, "decode")
    base = stack.proxy("disagg", prefill=[stack.p, p2], decode=[stack.d, d2])
    prompts = tiny.prompts * 2
    results = concurrently(lambda p: completion_ids(base, tiny.name, p), prompts)
    assert [ids for ids, _ in results] == tiny.refs * 2
    assert {st["decode_worker"] for _, st in results} == {stack.d, d2}
    assert {st["prefill_worker"] for _, st in results} == {stack.p, p2}
    health = json.loads(get(base + "/health")[1])
    assert all(w["in_flight"] == 0 and w["up"] for w in health["workers"])
