"""Request validation, prompts, stop strings, incremental text, the worker protocol and
the metrics format, without servers."""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest

from pdkv.errors import AlreadyExists, InvalidArgument
from pdkv.serving import metrics
from pdkv.serving.openai_api import (APIError, Endpoint, IncrementalDetokenizer, ModelInfo, StopMatcher,
                                     parse_request, resolve_prompt)
from pdkv.serving.protocol import (GenerateRequest, GenParams, KVFailed, KVReady, KVResult, PrefillRequest,
                                   Reservation, WorkerInfo)

INFO = ModelInfo("m", vocab_size=100, max_model_len=64, max_prompt_tokens=48, max_total_tokens=60)


def _err(body, endpoint=Endpoint.COMPLETIONS, info=INFO, codec=None) -> APIError:
    with pytest.raises(APIError) as e:
        resolve_prompt(parse_request(body, endpoint), info, codec)
    return e.value


def test_defaults_and_extensions() -> None:
    r = parse_request({"model": "m", "prompt": [1, 2, 3]}, Endpoint.COMPLETIONS)
    assert r.temperature == 1.0 and r.top_p == 1.0 and r.max_tokens is None and not r.stream
    ids, params = resolve_prompt(r, INFO, None)
    assert ids == [1, 2, 3] and params.max_tokens == 16 and params.seed is not None
    r = parse_request({"model": "m", "prompt": [[4, 5]], "max_tokens": 3, "temperature": 0, "seed": 7,
                       "stop_token_ids": [9], "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                       "return_token_ids": True, "pdkv_stats": True, "user": "ignored"}, Endpoint.COMPLETIONS)
    ids, params = resolve_prompt(r, INFO, None)
    assert ids == [4, 5]
    assert params == GenParams(max_tokens=3, temperature=0.0, top_p=1.0, seed=7, stop_token_ids=(9,),
                               ignore_eos=True)
    assert r.include_usage and r.continuous_usage and r.return_token_ids and r.pdkv_stats
    # chat: the rest of the context by default, capped by the decode pool
    chat = parse_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                          "max_completion_tokens": 5}, Endpoint.CHAT)
    assert chat.messages == ({"role": "user", "content": "hi"},) and chat.max_tokens == 5


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1]}, "model"),
    ({"model": "m", "prompt": [1], "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": [1], "temperature": 2.5}, "temperature"),
    ({"model": "m", "prompt": [1], "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": [1], "seed": "x"}, "seed"),
    ({"model": "m", "prompt": [1], "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "prompt": [1], "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"model": "m", "prompt": [1], "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"model": "m", "prompt": [1], "echo": True}, "echo"),
    ({"model": "m", "prompt": [1], "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": [1], "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": None}, "prompt"),
    ({"model": "m", "prompt": "text"}, "prompt"),          # no tokenizer here
    ({"model": "m", "prompt": [100]}, "prompt"),           # outside the vocabulary
    ({"model": "m", "prompt": [1] * 49}, "prompt"),        # longer than the prompt capacity
    ({"model": "m", "prompt": [1] * 40, "max_tokens": 30}, "max_tokens"),  # beyond the context
    ({"model": "m", "prompt": [1], "stop_token_ids": [100]}, "stop_token_ids"),
])
def test_bad_completions(body, param) -> None:
    e = _err(body)
    assert e.status == 400 and e.param == param
    assert e.to_json()["error"]["type"] == "invalid_request_error"


def test_context_errors_name_the_limits() -> None:
    e = _err({"model": "m", "prompt": [1] * 40, "max_tokens": 30})
    assert e.code == "context_length_exceeded" and "70 tokens (40 in the prompt, 30 in the completion)" in e.message
    assert _err({"model": "x", "prompt": [1]}).status == 404


def test_bad_chat() -> None:
    for body in ({"model": "m", "messages": "hi"},
                 {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                 {"model": "m", "messages": [{"role": "user", "content": "x"}],
                  "response_format": {"type": "json_object"}}):
        assert _err(body, Endpoint.CHAT).status == 400
    # without a chat template
    e = _err({"model": "m", "messages": [{"role": "user", "content": "x"}]}, Endpoint.CHAT)
    assert "chat template" in e.message
    with pytest.raises(APIError, match="JSON object"):
        parse_request([1, 2], Endpoint.COMPLETIONS)


def test_stop_matcher_holds_back_possible_starts() -> None:
    m = StopMatcher(["END", "xy"])
    assert m.feed("abc") == ("a", False)   # "bc" could start "END"
    assert m.feed("dE") == ("bc", False)
    assert m.feed("N") == ("d", False)
    assert m.feed("D and more") == ("", True)
    m = StopMatcher(["END"])
    out = [m.feed(p) for p in ("ab", "cE", "NDzz")]
    assert "".join(t for t, _ in out) == "abc" and out[-1][1] is True
    m = StopMatcher(["END"])
    assert m.feed("hello EN") == ("hello ", False) and m.flush() == "EN"
    assert StopMatcher([]).feed("anything") == ("anything", False)


class _ByteCodec:
    """A tokenizer whose tokens are single bytes (what the tiny test models use)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_keeps_multibyte_characters_whole() -> None:
    text = "añ€😀 ok"
    ids = list(text.encode())
    det = IncrementalDetokenizer(_ByteCodec(), [65, 66])
    pieces = [det.add(t) for t in ids]
    assert "".join(pieces) + det.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[ids.index(0xF0) + 3] == "😀" and pieces[ids.index(0xF0)] == ""
    det = IncrementalDetokenizer(_ByteCodec(), [])
    assert det.add(0xE2) == "" and det.flush() == "\ufffd"  # an incomplete character at the end


def test_protocol_round_trips_and_validation() -> None:
    gp = GenParams(max_tokens=4, temperature=0.5, top_p=0.9, seed=3, stop_token_ids=(1, 2), ignore_eos=True)
    g = GenerateRequest("r1", (1, 2, 3), gp, 5.0)
    assert GenerateRequest.from_json(g.to_json()) == g
    res = Reservation((4, 5), "127.0.0.1:9", "decode-1", 16)
    p = PrefillRequest("r1", (1, 2, 3), gp, res, 5.0)
    assert PrefillRequest.from_json(p.to_json()) == p
    kv = KVReady("r1", 7, 99, kv=False)
    assert KVReady.decode(kv.encode()) == kv
    assert KVFailed.from_json(KVFailed("r", 3, "boom", False).to_json()) == KVFailed("r", 3, "boom", False)
    assert KVResult.from_json(KVResult(True, True, 10, 0.5, "shm").to_json()).transport == "shm"
    timed = KVResult(True, True, 10, 0.5, "shm", tail_seconds=0.01, wire_seconds=0.02)
    assert KVResult.from_json(timed.to_json()) == timed
    assert KVResult.from_json({"ok": True, "seconds": 0.5}).tail_seconds == 0.0  # an older worker's line
    for bad in ({}, {"rid": "", "prompt": [1], "params": gp.to_json()}, {"rid": "x", "prompt": [1, True],
                "params": gp.to_json()}, {"rid": "x", "prompt": [1], "params": {**gp.to_json(), "max_tokens": "2"}}):
        with pytest.raises(InvalidArgument):
            GenerateRequest.from_json(bad)
    with pytest.raises(InvalidArgument, match="not JSON"):
        KVReady.decode(b"\xff")
    a = WorkerInfo("decode", "m", "", 10, 64, (2,), {"num_layers": 2, "kv_heads": 2, "head_dim": 8,
                                                    "dtype": "float32", "block_tokens": 16, "num_blocks": 4})
    b = WorkerInfo.from_json({**a.to_json(), "kv": {**a.kv, "block_tokens": 4}})
    assert a.capacity_tokens == 64 and a.kv_compatible(b)
    assert not a.kv_compatible(WorkerInfo.from_json({**a.to_json(), "kv": {**a.kv, "dtype": "bfloat16"}}))


def test_metrics_format() -> None:
    res = doctest.testmod(metrics)
    assert res.attempted > 0 and res.failed == 0
    reg = metrics.Registry()
    h = reg.histogram("x_seconds", 'Help with "quotes"\nand lines.', ("who",), buckets=(1, 2))
    h.observe(1.0, ("a\"b",))
    h.observe(5.0, ("a\"b",))
    h.observe(float("nan"), ("a\"b",))
    text = reg.render()
    assert 'x_seconds_bucket{le="1.0",who="a\\"b"} 1.0' in text  # prometheus_client's exposition
    assert 'x_seconds_bucket{le="+Inf",who="a\\"b"} 2.0' in text
    assert "# HELP x_seconds Help with \"quotes\"\\nand lines." in text
    assert h.count(("a\"b",)) == 2 and h.sum(("a\"b",)) == 6.0
    c = reg.counter("c_total", "c")
    with pytest.raises(InvalidArgument):
        c.inc(amount=-1)
    with pytest.raises(InvalidArgument):
        h.observe(1.0)  # missing label
    with pytest.raises(AlreadyExists):
        reg.counter("c_total", "again")
    with pytest.raises(InvalidArgument):
        reg.gauge("bad name", "x")
    with pytest.raises(InvalidArgument):
        reg.histogram("h", "x", buckets=(2, 1))


def test_configs_refuse_bad_values() -> None:
    from pdkv.serving.cli import parse_cpus
    from pdkv.serving.proxy import ProxyConfig

    assert parse_cpus("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError):
        parse_cpus("3-1")
    with pytest.raises(InvalidArgument, match="prefill"):
        ProxyConfig("disagg", decode=["http://a:1"])
    with pytest.raises(InvalidArgument, match="colocated"):
        ProxyConfig("colocated", prefill=["http://a:1"], decode=["http://b:1"])
    with pytest.raises(InvalidArgument, match="http"):
        ProxyConfig("colocated", decode=["a:1"])
    with pytest.raises(InvalidArgument, match="mode"):
        ProxyConfig("fast", decode=["http://a:1"])
    cfg = ProxyConfig("hybrid", prefill="http://a:1/, http://b:2", decode=("http://c:3",))
    assert cfg.prefill == ("http://a:1", "http://b:2") and cfg.hybrid_threshold >= 0


def test_front_end_modules_do_not_import_torch() -> None:
    code = ("import sys, pdkv.serving.proxy, pdkv.serving.frontend, pdkv.serving.launch, pdkv.serving.demo, "
            "pdkv.serving.cli; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
