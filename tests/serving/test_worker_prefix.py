"""The prefix cache in workers: on by default, ``--prefix-cache on|off`` and
``--cache-salt``, ``/pd/info``'s ``prefix_cache`` and ``cache_salt``, the ``done``
line's ``cached_tokens``/``computed_tokens``, the prefix metrics, a disaggregated
request whose prompt is cached on the prefill worker (still streamed layer by layer,
output unchanged), and the evict hook bumping the pool's generations."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.errors import InvalidArgument  # noqa: E402
from pdkv.serving.cli import build_parser  # noqa: E402
from pdkv.serving.engine import EngineConfig  # noqa: E402
from pdkv.serving.protocol import GenerateRequest, GenParams, WorkerInfo  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from pdkv.serving.worker import WorkerConfig  # noqa: E402
from servers import SECRET, Stack, completion_ids, get, sget, signed, tiny  # noqa: E402,F401 - tiny: a fixture

import urllib.request  # noqa: E402


@pytest.fixture(scope="module")
def stack(tiny):
    s = Stack()
    try:
        s.p = s.worker(tiny, "prefill")
        s.d = s.worker(tiny, "decode", mode="chunked", max_batch_tokens=16)
        s.col = s.worker(tiny, "colocated")
        s.off = s.worker(tiny, "colocated", prefix_cache=False)
        s.disagg = s.proxy("disagg", prefill=[s.p], decode=[s.d])
        yield s
    finally:
        s.close()


def metric(url: str, name: str, labels: str = "") -> float:
    _, text = get(url + "/metrics")
    assert f"# TYPE {name.removesuffix('_total')}" in text, f"{name} not in {url}/metrics"
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    assert labels, f"{name} has no value in {url}/metrics"
    return 0.0  # a labelled series not counted yet


def generate_lines(url: str, rid: str, prompt: list[int], max_tokens: int = 4) -> list[dict]:
    body = json.dumps(GenerateRequest(rid, tuple(prompt), GenParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0),
                                      30.0).to_json()).encode()
    req = urllib.request.Request(url + "/pd/generate", data=body, headers={
        "Content-Type": "application/json", **signed("POST", url + "/pd/generate", body)})
    with urllib.request.urlopen(req, timeout=60) as r:
        return [json.loads(x) for x in r.read().decode().splitlines() if x.strip()]


def test_info_reports_the_cache(stack) -> None:
    for url, on in ((stack.p, True), (stack.d, True), (stack.col, True), (stack.off, False)):
        status, text = sget(url + "/pd/info")
        assert status == 200
        info = WorkerInfo.from_json(json.loads(text))
        eng = stack.workers[url].engine
        assert info.prefix_cache is on and eng.prefix_stats()["enabled"] == int(on)
        assert info.cache_salt == eng.cache_salt and len(info.cache_salt) == 16
    # Same model, block size and dtype: the same derived salt everywhere (KV can be shared).
    assert len({stack.workers[u].engine.cache_salt for u in (stack.p, stack.d, stack.col, stack.off)}) == 1


def test_done_line_counts_cached_and_computed_tokens(tiny, stack) -> None:
    prompt = tiny.prompts[4]  # 37 tokens: 9 full blocks of 4
    first = generate_lines(stack.col, "g1", prompt)
    second = generate_lines(stack.col, "g2", prompt)
    assert [x["t"] for x in first if "t" in x] == [x["t"] for x in second if "t" in x] == tiny.refs[4][:4]
    d1, d2 = first[-1]["done"], second[-1]["done"]
    assert d1["cached_tokens"] == 0 and d1["computed_tokens"] == 37
    assert d2["cached_tokens"] == 36 and d2["computed_tokens"] == 1
    off = generate_lines(stack.off, "g3", prompt)
    off = generate_lines(stack.off, "g4", prompt)
    assert off[-1]["done"]["cached_tokens"] == 0 and off[-1]["done"]["computed_tokens"] == 37


def test_disagg_prompt_cached_on_prefill_still_streams_and_matches(tiny, stack) -> None:
    p = stack.p
    prompt = tiny.prompts[3]  # 23 tokens
    hits0 = metric(p, "pdkv_prefix_hit_tokens_total", '{source="local"}')
    comp0 = metric(p, "pdkv_prefill_computed_tokens_total")
    streamed0 = metric(p, "pdkv_kv_streamed_total", '{path="streamed"}')
    for _ in range(2):
        ids, st = completion_ids(stack.disagg, tiny.name, prompt)
        assert ids == tiny.refs[3] and st["recomputed"] is False and st["kv_bytes"] > 0
    assert metric(p, "pdkv_prefix_hit_tokens_total", '{source="local"}') - hits0 == 20
    assert metric(p, "pdkv_prefill_computed_tokens_total") - comp0 == 23 + 3
    assert metric(p, "pdkv_kv_streamed_total", '{path="streamed"}') - streamed0 == 2  # no fallback write
    assert metric(p, "pdkv_prompt_tokens_total") >= 46
    assert metric(p, "pdkv_prefix_cache_blocks") >= 5
    assert metric(p, "pdkv_prefix_hit_tokens_total", '{source="pulled"}') == 0
    assert metric(stack.d, "pdkv_prefix_evictions_total") >= 0


def test_evict_hook_bumps_generations_of_exposed_blocks(tiny, stack) -> None:
    w = stack.workers[stack.p]
    eng = w.engine
    prompt = tiny.prompts[4]
    h = eng.add_request("hook-1", prompt, SamplingParams(max_tokens=1))
    assert h.wait(30)
    ids = eng.lease("hook-lease", eng.block_hashes(prompt))
    assert len(ids) == 9
    gens = w.agent.generations("kv", ids)
    eng.unlease("hook-lease")
    eng.clear_prefix_cache()  # drops the cached blocks: the exposed ones are bumped first
    assert all(b > a for a, b in zip(gens, w.agent.generations("kv", ids)))


def test_worker_config_and_cli_flags() -> None:
    eng = EngineConfig(num_blocks=8)
    cfg = WorkerConfig(role="colocated", engine=eng, model_name="m")
    assert cfg.prefix_cache and cfg.engine.prefix_cache and not eng.prefix_cache
    cfg = WorkerConfig(role="colocated", engine=eng, model_name="m", prefix_cache=False, cache_salt="00ff" * 4)
    assert not cfg.engine.prefix_cache and cfg.engine.cache_salt == "00ff" * 4
    with pytest.raises(InvalidArgument, match="cache_salt"):
        WorkerConfig(role="colocated", engine=eng, model_name="m", cache_salt="salty")
    with pytest.raises(InvalidArgument, match="prefix_cache"):
        WorkerConfig(role="colocated", engine=eng, model_name="m", prefix_cache="off")
    ap = build_parser()
    for role in ("prefill", "decode", "colocated"):
        a = ap.parse_args([role])
        assert a.prefix_cache == "on" and a.cache_salt == ""
        a = ap.parse_args([role, "--prefix-cache", "off", "--cache-salt", "0123456789abcdef"])
        assert a.prefix_cache == "off" and a.cache_salt == "0123456789abcdef"
    with pytest.raises(SystemExit):
        ap.parse_args(["decode", "--prefix-cache", "maybe"])


@pytest.mark.parametrize("field, value", [("prefix_cache", "yes"), ("prefix_cache", 1), ("cache_salt", "xyz"),
                                          ("cache_salt", 7), ("cache_salt", "0123456789ABCDEF")])
def test_worker_info_rejects_bad_cache_fields(field, value) -> None:
    good = {"role": "decode", "model": "m", "vocab_size": 8, "max_model_len": 64, "prefix_cache": True,
            "cache_salt": "0123456789abcdef"}
    assert WorkerInfo.from_json(good).cache_salt == "0123456789abcdef"
    old = {k: v for k, v in good.items() if k not in ("prefix_cache", "cache_salt")}
    assert WorkerInfo.from_json(old).prefix_cache is False  # a worker without the fields
    with pytest.raises(InvalidArgument, match=field):
        WorkerInfo.from_json({**good, field: value})


def test_colocated_openai_stats_report_cached_tokens(tiny, stack) -> None:
    prompt = tiny.prompts[3][::-1]  # 23 tokens no other test sends
    ids1, st1 = completion_ids(stack.col, tiny.name, prompt)
    ids2, st2 = completion_ids(stack.col, tiny.name, prompt, streamed=True)
    assert ids1 == ids2
    assert (st1["extra"]["cached_tokens"], st1["extra"]["computed_tokens"]) == (0, 23)
    assert (st2["extra"]["cached_tokens"], st2["extra"]["computed_tokens"]) == (20, 3)
