"""KV-aware routing end to end: a real proxy (``routing="kv"``) over a prefill worker
and two decode workers with a tiny model: the workers' signed ``/pd/kv_events``, session
affinity, prefix routing (when the engine has a prefix cache), outputs equal to
``model.generate``, and a dead decode worker dropped from the index and never routed
to."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import dataclasses  # noqa: E402

from pdkv.serving.aio import ServerThread  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.models import load_model  # noqa: E402
from pdkv.serving.worker import Worker, WorkerConfig  # noqa: E402
from servers import (SECRET, Stack, completion_ids, get, post, reference, sget,  # noqa: E402
                     tiny)  # noqa: F401 - tiny: a fixture

HAS_PREFIX_CACHE = hasattr(Engine, "cache_snapshot") and \
    "prefix_cache" in {f.name for f in dataclasses.fields(EngineConfig)}


def _worker(s: Stack, tiny, role: str) -> str:
    """Stack.worker with the engine's prefix cache on (where the engine has one)."""
    eng = EngineConfig(num_blocks=96, block_tokens=4, mode="colocated", max_batch_tokens=64, max_num_seqs=8,
                       num_threads=1, **({"prefix_cache": True} if HAS_PREFIX_CACHE else {}))
    w = Worker(tiny.model, WorkerConfig(role=role, engine=eng, model_name=tiny.name, secret=SECRET),
               model_dir=str(tiny.model_dir))
    t = ServerThread(w)
    url = t.start()
    s.threads.append(t)
    s.workers[url] = w
    return url


def _index_blocks(proxy: str) -> dict[str, int]:
    status, text = get(proxy + "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        if line.startswith("pdkv_kv_index_blocks{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = int(float(line.rsplit(" ", 1)[1]))
    return out


def _up(proxy: str) -> dict[str, bool]:
    _status, text = get(proxy + "/health")
    return {w["url"]: w["up"] for w in json.loads(text)["workers"]}


def _wait(cond, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tiny):
    s = Stack()
    try:
        s.p = _worker(s, tiny, "prefill")
        s.d0 = _worker(s, tiny, "decode")
        s.d1 = _worker(s, tiny, "decode")
        s.px = s.proxy("disagg", prefill=[s.p], decode=[s.d0, s.d1], routing="kv", kv_events_interval_s=0.05)
        yield s
    finally:
        s.close()


def test_kv_events_are_signed_and_validated(fleet):
    url = fleet.d0 + "/pd/kv_events"
    status, body = get(url)
    assert status == 401, body                           # no signature: refused like every /pd/ call
    status, body = sget(url)
    assert status == 200, body
    a = json.loads(body)
    assert a["block_tokens"] == 4 and isinstance(a["epoch"], str) and a["epoch"] and "snapshot" in a
    status, body = sget(url + "?since=-3")
    assert status == 400 and "since" in json.loads(body)["error"]["message"]
    status, body = sget(f"{url}?epoch={a['epoch']}&since={a['seq']}")
    assert status == 200 and json.loads(body)["events"] == []


def test_the_index_knows_every_worker(fleet):
    _wait(lambda: set(_index_blocks(fleet.px)) == {fleet.p, fleet.d0, fleet.d1})
    _status, text = get(fleet.px + "/health")
    assert json.loads(text)["kv_index"]["workers"] == 3


def test_a_session_stays_on_its_workers_and_outputs_equal_generate(tiny, fleet):
    for who, extra, headers in (("alice", {"user": "alice"}, {}), ("bob", {}, {"X-Session-Id": "bob"})):
        seen = set()
        for prompt, ref in zip(tiny.prompts, tiny.refs):
            body = {"model": tiny.name, "prompt": prompt, "max_tokens": len(ref), "temperature": 0,
                    "return_token_ids": True, "pdkv_stats": True, "ignore_eos": False, **extra}
            status, obj = post(fleet.px + "/v1/completions", body, headers=headers)
            assert status == 200, obj
            assert obj["choices"][0]["token_ids"] == ref, who
            seen.add(obj["pdkv"]["decode_worker"])
            assert obj["pdkv"]["session"] == who
        if not HAS_PREFIX_CACHE:  # with a cache, a prefix another worker holds may win over the session
            assert len(seen) == 1, (who, seen)
    status, obj = post(fleet.px + "/v1/completions", {"model": tiny.name, "prompt": [5], "user": "x" * 300})
    assert status == 400 and obj["error"]["param"] == "user"
    status, obj = post(fleet.px + "/v1/completions", {"model": tiny.name, "prompt": [5]},
                       headers={"X-Session-Id": "z" * 300})
    assert status == 400 and obj["error"]["param"] == "X-Session-Id"


@pytest.mark.skipif(not HAS_PREFIX_CACHE, reason="the engine has no prefix cache (Engine.cache_snapshot)")
def test_a_request_goes_to_the_decode_worker_holding_its_prefix(tiny, fleet):
    prompt = [(7 + 13 * i) % 90 + 7 for i in range(33)]
    before = _index_blocks(fleet.px)  # earlier tests' blocks: the wait below is for this prompt's
    first, st = completion_ids(fleet.px, tiny.name, prompt, max_tokens=6, user="prefix-owner")
    holder = st["decode_worker"]
    _wait(lambda: _index_blocks(fleet.px).get(holder, 0) >= before.get(holder, 0) + len(prompt) // 4)
    longer = prompt + first + [11, 12, 13, 14, 15]
    ref = reference(load_model(tiny.model_dir, dtype="float32", attn_implementation="sdpa"), [longer], 6)[0]
    for _ in range(3):                                    # no session: the prefix alone decides
        ids, st = completion_ids(fleet.px, tiny.name, longer, max_tokens=6)
        assert st["decode_worker"] == holder and ids == ref
    _, text = get(fleet.px + "/metrics")
    assert 'pdkv_kv_decode_picks_total{how="kv_prefix"}' in text
    assert 'route="kv_' not in text  # pdkv_routed_requests_total counts each request once: disagg or local
    # A restarted proxy starts with an empty index and converges from the workers' snapshots.
    fresh = fleet.proxy("disagg", prefill=[fleet.p], decode=[fleet.d0, fleet.d1], routing="kv",
                        kv_events_interval_s=0.05)
    _wait(lambda: _index_blocks(fresh).get(holder, 0) >= len(longer) // 4)
    for _ in range(2):
        ids, st = completion_ids(fresh, tiny.name, longer, max_tokens=6)
        assert st["decode_worker"] == holder and ids == ref


def test_a_dead_decode_worker_leaves_the_index_and_gets_no_request(tiny):
    s = Stack()
    try:
        p = _worker(s, tiny, "prefill")
        d0 = _worker(s, tiny, "decode")
        d1 = _worker(s, tiny, "decode")
        px = s.proxy("disagg", prefill=[p], decode=[d0, d1], routing="kv", kv_events_interval_s=0.05,
                     liveness_s=0.2, probe_timeout_s=0.5, down_cooldown_s=60.0)
        _, st = completion_ids(px, tiny.name, tiny.prompts[3], user="carol")
        gone = st["decode_worker"]
        other = d1 if gone == d0 else d0
        _wait(lambda: gone in _index_blocks(px))
        s.stop(gone)
        _wait(lambda: gone not in _index_blocks(px))     # a failed poll drops its entries
        _wait(lambda: not _up(px)[gone])                 # and a missed probe takes it out of rotation
        for prompt, ref in zip(tiny.prompts, tiny.refs):
            ids, st = completion_ids(px, tiny.name, prompt, user="carol")
            assert ids == ref and st["decode_worker"] == other and st["retries"] == 0
    finally:
        s.close()


def _has_pull() -> bool:
    try:
        import pdkv.serving.kv_pull  # noqa: F401
    except ImportError:
        return False
    return HAS_PREFIX_CACHE


def _metric(url: str, name: str) -> float:
    _status, text = get(url + "/metrics")
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))


@pytest.mark.skipif(not _has_pull(), reason="the workers cannot lease or pull KV (pdkv.serving.kv_pull)")
def test_a_third_workers_prefix_is_leased_and_pulled_when_the_holder_is_busy(tiny):
    from pdkv.serving.kv_pull import PullConfig

    s = Stack()
    try:
        eng = dict(num_blocks=96, block_tokens=4, mode="colocated", max_batch_tokens=64, max_num_seqs=8,
                   num_threads=1, prefix_cache=True)
        urls = []
        for role, kw in (("prefill", {"kv_pull": PullConfig(policy="always", timeout_s=5.0)}), ("decode", {}),
                         ("decode", {})):
            w = Worker(tiny.model, WorkerConfig(role=role, engine=EngineConfig(**eng), model_name=tiny.name,
                                                secret=SECRET, **kw), model_dir=str(tiny.model_dir))
            t = ServerThread(w)
            urls.append(t.start())
            s.threads.append(t)
        p, d0, d1 = urls
        px = s.proxy("disagg", prefill=[p], decode=[d0, d1], routing="kv", kv_events_interval_s=0.05,
                     kv_load_tokens=1000)
        proxy = s.threads[-1].server
        prompt = [(5 + 17 * i) % 90 + 7 for i in range(33)]
        body = {"ignore_eos": True}
        first, st = completion_ids(px, tiny.name, prompt, max_tokens=10, **body)
        holder = st["decode_worker"]
        other = d1 if holder == d0 else d0
        # The holder keeps prompt + answer (42 tokens of KV: 10 blocks); the prefill worker the prompt's 8.
        _wait(lambda: _index_blocks(px).get(holder, 0) >= 10 and _index_blocks(px).get(p, 0) >= 8)
        next(w for w in proxy.backend.decode.workers if w.url == holder).in_flight += 5   # busy: decode elsewhere
        longer = prompt + first + [21, 22, 23, 24, 25]
        ref = reference(load_model(tiny.model_dir, dtype="float32", attn_implementation="sdpa"), [longer], 6,)[0]
        try:
            ids, st = completion_ids(px, tiny.name, longer, max_tokens=6, ignore_eos=True)
        finally:
            next(w for w in proxy.backend.decode.workers if w.url == holder).in_flight -= 5
        assert ids == ref
        assert st["decode_worker"] == other and st["extra"]["kv_lease_worker"] == holder
        assert _metric(px, 'pdkv_kv_leases_total{result="ok"}') == 1
        assert _metric(p, "pdkv_kv_pulled_tokens_total") >= 8    # at least the blocks the prefill lacked
    finally:
        s.close()
