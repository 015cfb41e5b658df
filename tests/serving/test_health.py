"""A wrong secret between prefill and decode is not silent: /health and /metrics of the
proxy and the prefill worker report peer-auth failures per worker pair, the proxy's
start-up check names the pair, and every recompute carries its cause. Also: the
``--model`` argument as given is a model name, and a colocated worker's body limit
follows ``max_body_bytes``."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from servers import SECRET, Stack, completion_ids, get, post, tiny  # noqa: E402, F401 (tiny: a fixture)

from pdkv.serving.aio import ServerThread  # noqa: E402
from pdkv.serving.cli import PeerAuthError, _ReadyProxy  # noqa: E402
from pdkv.serving.engine import EngineConfig  # noqa: E402
from pdkv.serving.proxy import Proxy, ProxyConfig  # noqa: E402
from pdkv.serving.worker import Worker, WorkerConfig  # noqa: E402


@pytest.fixture(scope="module")
def stack(tiny):
    s = Stack()
    try:
        s.p = s.worker(tiny, "prefill")
        # Its agent proves another secret; its /pd/* routes accept the proxy's signature too
        # (rotation's accepted secrets), so the proxy can use it and see the agents disagree.
        s.bad_p = _worker(s, tiny, "prefill", secret="not-the-shared-secret", accepted_secrets=(SECRET,))
        s.d = s.worker(tiny, "decode", mode="chunked", max_batch_tokens=16)
        # Its own decode worker: an agent briefly refuses a host after failed
        # authentications, which would blur the good pair's results.
        s.bad_d = s.worker(tiny, "decode", mode="chunked", max_batch_tokens=16)
        yield s
    finally:
        s.close()


def _worker(s: Stack, tiny, role: str, **kw) -> str:
    """A worker with its own settings (``Stack.worker`` fixes the secret)."""
    eng = EngineConfig(num_blocks=96, block_tokens=4, mode="colocated", max_batch_tokens=64, max_num_seqs=8,
                       num_threads=1)
    w = Worker(tiny.model, WorkerConfig(role=role, engine=eng, model_name=tiny.name, **kw),
               model_dir=str(tiny.model_dir))
    t = ServerThread(w)
    url = t.start()
    s.threads.append(t)
    s.workers[url] = w
    return url


def _samples(text: str, name: str) -> dict[frozenset, float]:
    """``{frozenset of (label, value)}: value`` of one metric's series."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            pairs = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels)
            out[frozenset(pairs)] = float(value)
    return out


def test_wrong_secret_is_reported_in_health_metrics_and_each_recompute(tiny, stack) -> None:
    base = stack.proxy("disagg", prefill=[stack.bad_p], decode=[stack.bad_d])
    for p in tiny.prompts[2:4]:
        ids, st = completion_ids(base, tiny.name, p)
        assert ids == tiny.refs[tiny.prompts.index(p)]
        assert st["recomputed"] is True and st["recompute_reason"] == "kv_failed"
        assert st["kv_error"].startswith("AuthFailed"), st["kv_error"]
    status, body = get(base + "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "degraded"
    [link] = health["peer_links"]
    assert (link["prefill"], link["decode"], link["ok"]) == (stack.bad_p, stack.bad_d, False)
    assert link["auth_failures"] == 2 and link["transport_errors"] == 0
    assert "AuthFailed" in link["last_error"]
    metrics = get(base + "/metrics")[1]
    auth = _samples(metrics, "pdkv_peer_auth_failures_total")
    assert auth == {frozenset({("prefill", stack.bad_p), ("decode", stack.bad_d)}): 2.0}
    # The prefill worker itself says so too, per decode agent.
    status, body = get(stack.bad_p + "/health")
    ph = json.loads(body)
    assert status == 200 and ph["status"] == "degraded"
    [(addr, plink)] = ph["peers"].items()
    assert plink["auth_failures"] >= 2 and not plink["ok"]
    assert _samples(get(stack.bad_p + "/metrics")[1], "pdkv_peer_auth_failures_total") \
        == {frozenset({("peer", addr)}): plink["auth_failures"]}


def test_good_link_is_healthy(tiny, stack) -> None:
    base = stack.proxy("disagg", prefill=[stack.p], decode=[stack.d])
    ids, st = completion_ids(base, tiny.name, tiny.prompts[3])
    assert ids == tiny.refs[3]
    assert st["recomputed"] is False and st["kv_error"] == "", st
    health = json.loads(get(base + "/health")[1])
    assert health["status"] == "ok"
    assert [(x["prefill"], x["ok"], x["auth_failures"]) for x in health["peer_links"]] == [(stack.p, True, 0)]


def test_recompute_without_a_prefill_worker_carries_its_cause(tiny, stack) -> None:
    gone = stack.worker(tiny, "prefill")
    base = stack.proxy("disagg", prefill=[gone], decode=[stack.d])
    stack.stop(gone)
    ids, st = completion_ids(base, tiny.name, tiny.prompts[3])
    assert ids == tiny.refs[3] and st["recomputed"] is True
    assert st["kv_error"], "a recompute must say why"
    assert gone in st["kv_error"] or "no prefill worker" in st["kv_error"], st["kv_error"]


def _start_ready(prefill: str, decode: str) -> None:
    proxy = Proxy(ProxyConfig("disagg", prefill=[prefill], decode=[decode], secret=SECRET))
    ready = _ReadyProxy(proxy, timeout=30)

    async def go() -> None:
        try:
            await ready.start("127.0.0.1", 0)
        finally:
            await ready.close()

    asyncio.run(go())


def test_startup_fails_fast_when_prefill_and_decode_cannot_authenticate(stack) -> None:
    t0 = time.monotonic()
    with pytest.raises(PeerAuthError) as ei:
        _start_ready(stack.bad_p, stack.bad_d)
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert stack.bad_p in msg and stack.bad_d in msg and "AuthFailed" in msg and "PDKV_SECRET" in msg
    _start_ready(stack.p, stack.d)  # the same check passes with the shared secret


def test_model_argument_as_given_is_accepted(tiny) -> None:
    s = Stack()
    try:
        given = str(tiny.model_dir) + "/"
        col = s.worker(tiny, "colocated", model_aliases=(given,), max_body_bytes=2048)
        base = s.proxy("colocated", decode=[col])
        for url in (col, base):
            for name in (tiny.name, given):
                ids, _ = completion_ids(url, name, tiny.prompts[2])
                assert ids == tiny.refs[2]
            status, obj = post(url + "/v1/completions", {"model": "other", "prompt": [1], "max_tokens": 1})
            assert status == 404 and obj["error"]["code"] == "model_not_found"
        # The colocated worker's body limit follows max_body_bytes (was 64 MiB fixed).
        status, obj = post(col + "/v1/completions", {"model": tiny.name, "prompt": "x" * 4096, "max_tokens": 1})
        assert status == 413 and obj["error"]["code"] == "request_too_large"
    finally:
        s.close()
