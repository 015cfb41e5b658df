"""An ``{"error": ...}`` line in a decode worker's stream (issue 12): the worker's fault
(internal error, shutting down, out of KV blocks, transport) migrates the stream to
another decode worker exactly like a dead one -- greedy, token for token the
uninterrupted answer -- while the request's fault (invalid input, context too long)
goes to the client as OpenAI's error with its status. The workers are made to fail
with their fault-injection flag (``debug_error_after``/``debug_error_code``). Also: a
failed liveness probe counts ``pdkv_worker_failures_total`` once."""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from servers import MAX_NEW, Stack, completion_ids, get, post, stream, tiny  # noqa: E402, F401 (tiny: a fixture)

from pdkv.errors import InvalidArgument  # noqa: E402
from pdkv.serving.engine import EngineConfig  # noqa: E402
from pdkv.serving.protocol import STREAM_ERROR_STATUS, StreamError  # noqa: E402
from pdkv.serving.worker import WorkerConfig  # noqa: E402

FAIL_AFTER = 3
WORKER_FAULTS = ["internal_error", "shutting_down", "kv_pool_full", "transport_error"]
REQUEST_FAULTS = ["invalid_request", "context_length_exceeded"]


@pytest.fixture(scope="module")
def stack(tiny):
    s = Stack()
    try:
        s.good = s.worker(tiny, "colocated")
        yield s
    finally:
        s.close()


def _metric(base: str, name: str) -> dict[str, float]:
    out = {}
    for line in get(base + "/metrics")[1].splitlines():
        m = re.match(rf"^{name}(\{{.*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def test_stream_error_lines_say_whose_fault_it_is() -> None:
    for code in WORKER_FAULTS:
        err = StreamError.of(code, "x")
        assert not err.request_fault and err.status >= 500
        assert StreamError.from_line(json.loads(err.to_line())) == err
    for code in REQUEST_FAULTS:
        err = StreamError.of(code, "x")
        assert err.request_fault and err.status == 400
        line = json.loads(err.to_line())
        assert line["error"]["type"] == "invalid_request_error"
        assert StreamError.from_line(line) == err
    # An older or foreign worker's line (no status, unknown code, not even an object)
    # is the worker's fault.
    assert StreamError.from_line({"error": {"message": "m", "code": "abort"}}) == StreamError("m", "abort", 500)
    assert not StreamError.from_line({"error": "boom"}).request_fault
    assert StreamError.from_line({"error": {"message": "m", "code": "x", "status": 413}}).status == 413
    with pytest.raises(InvalidArgument, match="unknown stream error code"):
        StreamError.of("nope", "x")
    eng = EngineConfig(num_blocks=8, block_tokens=4)
    with pytest.raises(InvalidArgument, match="debug_error_code"):
        WorkerConfig(role="decode", engine=eng, model_name="m", debug_error_code="nope")
    with pytest.raises(InvalidArgument, match="debug_error_after"):
        WorkerConfig(role="decode", engine=eng, model_name="m", debug_error_after=-1)
    assert set(STREAM_ERROR_STATUS) == set(WORKER_FAULTS) | set(REQUEST_FAULTS)


@pytest.mark.parametrize("code", WORKER_FAULTS)
def test_worker_fault_mid_stream_migrates_token_for_token(tiny, stack, code) -> None:
    faulty = stack.worker(tiny, "colocated", debug_error_after=FAIL_AFTER, debug_error_code=code)
    base = stack.proxy("colocated", decode=[faulty, stack.good])
    prompt, ref = tiny.prompts[3], tiny.refs[3]
    migrated = []
    # Round-robin over two idle workers: one of two requests starts on the faulty one.
    for streamed in (True, False):
        ids, st = completion_ids(base, tiny.name, prompt, streamed=streamed)
        assert ids == ref and len(ids) == MAX_NEW  # no duplicate, no missing token
        assert st["decode_worker"] == stack.good
        if "migrated_after_tokens" in st["extra"]:
            migrated.append(st["extra"]["migrated_after_tokens"])
    assert migrated and set(migrated) == {FAIL_AFTER}
    assert _metric(base, "pdkv_request_migrations_total") == {"": len(migrated)}
    failures = _metric(base, "pdkv_worker_failures_total")
    up = {w["url"]: w["up"] for w in json.loads(get(base + "/health")[1])["workers"]}
    if code == "kv_pool_full":  # busy, not broken: it stays in rotation
        assert up[faulty] and not failures
    else:
        assert not up[faulty] and len(migrated) == 1
        assert failures == {f'{{role="decode",worker="{faulty}"}}': 1.0}
    stack.stop(faulty)


def test_worker_fault_migrates_a_disaggregated_stream(tiny, stack) -> None:
    p = stack.worker(tiny, "prefill")
    faulty = stack.worker(tiny, "decode", debug_error_after=FAIL_AFTER)
    d = stack.worker(tiny, "decode")
    base = stack.proxy("disagg", prefill=[p], decode=[faulty, d])
    migrated = []
    for prompt, ref in zip(tiny.prompts[2:4], tiny.refs[2:4]):
        ids, st = completion_ids(base, tiny.name, prompt, streamed=True)
        assert ids == ref
        if "migrated_after_tokens" in st["extra"]:
            # The first token came from the prefill worker, then FAIL_AFTER from decode.
            migrated.append(st["extra"]["migrated_after_tokens"])
    assert migrated == [FAIL_AFTER + 1]
    for url in (p, faulty, d):
        eng = stack.workers[url].engine
        deadline = time.monotonic() + 5
        while eng.num_free_blocks != eng.pool.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.num_free_blocks == eng.pool.num_blocks, url  # nothing leaked


@pytest.mark.parametrize("code", REQUEST_FAULTS)
def test_request_fault_mid_stream_is_the_clients_error(tiny, stack, code) -> None:
    faulty = stack.worker(tiny, "colocated", debug_error_after=FAIL_AFTER, debug_error_code=code)
    base = stack.proxy("colocated", decode=[faulty, stack.good])
    body = {"model": tiny.name, "prompt": tiny.prompts[3], "max_tokens": MAX_NEW, "temperature": 0}
    errors = []
    # Never retried, and both workers stay in rotation: round-robin alternates, so each
    # pair of requests meets the faulty worker once -- streamed, then not.
    for streamed in (True, True, False, False):
        if streamed:
            events = stream(base + "/v1/completions", body)
            assert events[-1] == "[DONE]"
            err = [e["error"] for e in events[:-1] if "error" in e]
            if err:  # the SSE error event ends the stream
                assert "error" in events[-2]
                errors.append(("stream", err[0]))
            continue
        status, obj = post(base + "/v1/completions", body)
        if status == 200:
            continue
        assert status == 400, obj
        errors.append(("whole", obj["error"]))
    assert [kind for kind, _ in errors] == ["stream", "whole"], errors
    for _, err in errors:
        assert err["code"] == code and err["type"] == "invalid_request_error"
        assert faulty in err["message"]
    assert not _metric(base, "pdkv_request_migrations_total").get("")
    assert not _metric(base, "pdkv_worker_failures_total")
    assert all(w["up"] for w in json.loads(get(base + "/health")[1])["workers"])
    stack.stop(faulty)


def test_a_worker_fault_with_no_worker_left_is_a_clear_error(tiny, stack) -> None:
    faulty = stack.worker(tiny, "colocated", debug_error_after=FAIL_AFTER)
    base = stack.proxy("colocated", decode=[faulty])
    status, obj = post(base + "/v1/completions", {"model": tiny.name, "prompt": tiny.prompts[3],
                                                  "max_tokens": MAX_NEW, "temperature": 0})
    assert status == 502 and obj["error"]["code"] == "worker_failed", obj
    assert "internal_error" in obj["error"]["message"]
    stack.stop(faulty)


def test_a_failed_liveness_probe_counts_one_failure(tiny, stack) -> None:
    """A worker whose event loop is blocked (frozen, not dead): the request waiting on it
    probes it, the probe fails, the request moves on -- one failure, not two."""
    frozen = stack.worker(tiny, "colocated")
    base = stack.proxy("colocated", decode=[frozen], liveness_s=0.3, probe_timeout_s=0.3, retries=0)
    [thread] = [t for t in stack.threads if t.url == frozen]
    thread.loop.call_soon_threadsafe(time.sleep, 3.0)  # the whole worker stops answering
    status, obj = post(base + "/v1/completions", {"model": tiny.name, "prompt": tiny.prompts[1],
                                                  "max_tokens": 2, "temperature": 0})
    assert status == 503 and obj["error"]["code"] == "no_worker_available", obj
    assert "liveness" in obj["error"]["message"]
    assert _metric(base, "pdkv_worker_failures_total") == {f'{{role="decode",worker="{frozen}"}}': 1.0}
    time.sleep(0.7)  # the background probes keep failing meanwhile: still one failure
    assert _metric(base, "pdkv_worker_failures_total") == {f'{{role="decode",worker="{frozen}"}}': 1.0}
    stack.stop(frozen)
