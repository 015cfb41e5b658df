"""Session workloads (multi-turn, agentic), the closed-loop session client and the
prefix-reuse figures of ``pdkv bench serve`` (no model: a fake OpenAI server on 127.0.0.1).

Time bounds are loose (a loaded 2-core machine): they check that a turn waits for the
previous answer plus the think time, never how fast anything is.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from fake_openai import FakeOpenAI
from pdkv.lab.serve import cli as serve_cli
from pdkv.lab.serve import modes as serve_modes
from pdkv.lab.serve import prefix
from pdkv.lab.serve.client_sessions import run_sessions
from pdkv.lab.serve.metrics import SLO, BenchResults, RequestRecord, RunResult
from pdkv.lab.serve.trace_dist import Fixed
from pdkv.lab.serve.trace_sessions import (
    SESSION_PRESETS,
    Session,
    SessionSpec,
    SessionTrace,
    Turn,
    generate_sessions,
    get_session_preset,
    load_session_trace,
)


def _spec(**kw) -> SessionSpec:
    base = dict(name="t", description="", session_rate=2.0, shared_len=32, first_len=Fixed(8), turn_len=Fixed(5),
                output_len=Fixed(4), turns=Fixed(3), think_s=0.3, max_context=2000)
    base.update(kw)
    return SessionSpec(**base)


# ------------------------------------------------------------------------------ traces


@pytest.mark.parametrize("name", list(SESSION_PRESETS))
def test_presets_are_deterministic_and_consistent(name):
    spec = get_session_preset(name)
    a = spec.generate(seed=3, num_sessions=6)
    b = spec.generate(seed=3, num_sessions=6)
    assert a.sessions == b.sessions and a.shared_prompt() == b.shared_prompt()
    assert a.sessions != spec.generate(seed=4, num_sessions=6).sessions
    # The first k sessions do not depend on how many are generated.
    assert spec.generate(seed=3, num_sessions=3).sessions == a.sessions[:3]
    starts = [s.start_s for s in a.sessions]
    assert starts[0] == 0.0 and starts == sorted(starts)
    index = 0
    for s in a.sessions:
        assert s.first_index == index
        index += len(s.turns)
        context = spec.shared_len
        for k, t in enumerate(s.turns):
            assert t.prompt_len == context + t.new_len  # history + the new tokens
            assert t.prompt_len + t.output_len <= spec.max_context
            assert (t.think_s == 0.0) == (k == 0) or spec.think_s == 0
            context = t.prompt_len + t.output_len
    assert a.num_requests == index


def test_shared_prefix_is_shared_and_sessions_differ():
    t = generate_sessions(_spec(), seed=1, num_sessions=3)
    firsts = [t.first_prompt(s) for s in t.sessions]
    shared = t.shared_prompt()
    assert len(shared) == 32 and all(p[:32] == shared for p in firsts)
    assert len({tuple(p[32:]) for p in firsts}) == 3  # each session's own first message
    assert t.new_tokens(t.sessions[0], 1) != t.new_tokens(t.sessions[1], 1)
    assert all(100 <= x < 1000 for x in firsts[0])
    assert all(100 <= x < 200 for x in t.first_prompt(t.sessions[0], vocab_size=200))


def test_max_context_ends_sessions_early_and_rejects_what_cannot_start():
    t = generate_sessions(_spec(turns=Fixed(50), max_context=80), seed=0, num_sessions=2)
    for s in t.sessions:
        assert 1 <= len(s.turns) < 50
        assert s.turns[-1].prompt_len + s.turns[-1].output_len <= 80
    with pytest.raises(ValueError, match="max_context"):
        generate_sessions(_spec(shared_len=100, max_context=50), seed=0, num_sessions=1)


def test_rate_scaling_and_save_load(tmp_path):
    spec = _spec()
    t1 = spec.generate(seed=2, num_sessions=5)
    t2 = spec.with_rate(4.0).generate(seed=2, num_sessions=5)
    for a, b in zip(t1.sessions, t2.sessions):
        assert b.start_s == pytest.approx(a.start_s / 2, abs=1e-5) and a.turns == b.turns
    assert [s.start_s for s in t1.scaled_to_rate(4.0).sessions] == pytest.approx([s.start_s for s in t2.sessions],
                                                                                  abs=1e-5)
    t1.save(tmp_path / "s.json")
    back = load_session_trace(tmp_path / "s.json")
    assert back.sessions == t1.sessions and back.shared_prompt() == t1.shared_prompt()
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "sessions", "shared_len": 1, "sessions": [{"x": 1}]}))
    with pytest.raises(ValueError, match="malformed"):
        load_session_trace(tmp_path / "bad.json")
    (tmp_path / "req.json").write_text("[]")
    with pytest.raises(ValueError, match="not a session trace"):
        load_session_trace(tmp_path / "req.json")


@pytest.mark.parametrize("kw, match", [
    (dict(session_rate=0.0), "rate"), (dict(shared_len=-1), "shared_len"), (dict(think_s=-1.0), "think"),
    (dict(max_context=1), "max_context"),
])
def test_bad_specs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(**kw)
    with pytest.raises(ValueError):
        generate_sessions(_spec(), seed=0)  # no limit


# ------------------------------------------------------------------- perfect-cache bound


def _rec(i, prompt, out=(), send=None):
    return RequestRecord(i, 0.0, prompt_len=len(prompt), send_s=float(i) if send is None else send,
                         prompt_token_ids=list(prompt), output_token_ids=list(out))


def test_hit_rate_max_on_a_hand_made_trace():
    bt = 4
    shared = list(range(100, 108))                        # 2 blocks shared by both sessions
    a0 = shared + [1, 2, 3]                               # 11 tokens, nothing cached yet
    b0 = shared + [9, 9, 9, 9, 9]                         # 13: hits the 2 shared blocks (8)
    a1 = a0 + [50, 51, 52, 53, 54] + [7, 7]               # a0 + answer + new: blocks 0-3 are a0+answer[:-1]
    recs = [_rec(0, a0, [50, 51, 52, 53, 54]), _rec(1, b0, [60]), _rec(2, a1, [70])]
    # a1 = 18 tokens: blocks [100..103], [104..107], [1,2,3,50], [51,52,53,54]; the answer's last token (54) was
    # never computed, so block 3 is not cached: 3 blocks = 12 tokens hit.
    got = prefix.hit_rate_max(recs, bt)
    assert got == {"rate": (0 + 8 + 12) / (11 + 13 + 18), "hit_tokens": 20, "prompt_tokens": 42}
    # Send order, not index order: b0 first makes it the cold one (a0 then hits the 8 shared tokens too).
    recs[1].send_s = -1.0
    assert prefix.hit_rate_max(recs, bt)["hit_tokens"] == 8 + 12
    # At least one prompt token is computed: an exact repeat of a block-aligned prompt hits all but one token.
    same = list(range(200, 208))
    assert prefix.hit_rate_max([_rec(0, same, [1]), _rec(1, same, [1])], bt)["hit_tokens"] == 7
    # Never-sent requests are skipped; no prompts at all -> rate None.
    assert prefix.hit_rate_max([RequestRecord(0, 0.0)], bt)["rate"] is None
    with pytest.raises(ValueError):
        prefix.hit_rate_max(recs, 0)


# ------------------------------------------------------------------- worker counters

_BEFORE = """# HELP pdkv_prompt_tokens_total x
# TYPE pdkv_prompt_tokens_total counter
pdkv_prompt_tokens_total 100
pdkv_prefill_computed_tokens_total 90
pdkv_prefix_hit_tokens_total{source="local"} 10
pdkv_kv_transfer_bytes_total{transport="tcp"} 1000
pdkv_kv_transfer_bytes_total{transport="shm"} 500
pdkv_requests_total{endpoint="completions",status="200"} 3
"""
_AFTER = """pdkv_prompt_tokens_total 300
pdkv_prefill_computed_tokens_total 140
pdkv_prefix_hit_tokens_total{source="local"} 130
pdkv_prefix_hit_tokens_total{source="pulled"} 30
pdkv_kv_transfer_bytes_total{transport="tcp"} 3000
pdkv_kv_transfer_bytes_total{transport="shm"} 700
pdkv_kv_pull_bytes_total 400
"""


def test_counters_deltas_and_summary_from_metrics_texts():
    b, a = prefix.parse_counters(_BEFORE), prefix.parse_counters(_AFTER)
    assert b["pdkv_kv_transfer_bytes_total"] == 1500 and "pdkv_requests_total" not in b
    assert a["pdkv_prefix_hit_tokens_total:pulled"] == 30
    old = prefix.parse_counters("pdkv_kv_transfer_bytes_total{transport=\"tcp\"} 10\n")  # an older worker
    old2 = prefix.parse_counters("pdkv_kv_transfer_bytes_total{transport=\"tcp\"} 60\n")
    d = prefix.metric_deltas([b, old], [a, old2])
    assert d["pdkv_prefill_computed_tokens_total"] == 50
    assert d["pdkv_kv_transfer_bytes_total"] == 2200 + 50
    assert d["pdkv_kv_pull_bytes_total"] == 400  # appeared during the run: from 0
    recs = [_rec(0, list(range(100)), [1, 2]), _rec(1, list(range(100)), [3])]
    s = prefix.prefix_summary(recs, d, block_tokens=16)
    assert s["prompt_tokens"] == 200 and s["prefill_tokens"] == 50
    assert s["prefix_hit_rate"] == pytest.approx(1 - 50 / 200)
    assert s["kv_bytes"] == 2250 + 400 and s["kv_bytes_pushed"] == 2250 and s["kv_bytes_pulled"] == 400
    assert s["prefix_hit_tokens"] == {"local": 120, "pulled": 30}
    assert s["prefix_hit_rate_max"] == pytest.approx(96 / 200)  # 6 of the repeat's blocks (99 tokens max)
    assert s["outputs_equal"] is None and s["kv_bytes_per_turn"] == pytest.approx(2650 / 2)
    # Counters nobody exposes are None, never 0.
    s0 = prefix.prefix_summary(recs, prefix.metric_deltas([old], [old2]), block_tokens=16)
    assert s0["prefix_hit_rate"] is None and s0["prefill_tokens"] is None and s0["prefix_hit_tokens"] is None
    assert s0["kv_bytes"] == 50 and s0["kv_bytes_pulled"] is None
    s1 = prefix.prefix_summary(recs, None, block_tokens=16)
    assert s1["kv_bytes"] is None and s1["prefix_hit_rate_max"] is not None
    # A worker that could not be read at one end: its counters are unknown, not short.
    assert prefix.metric_deltas([b, None], [a, old2])["pdkv_prefill_computed_tokens_total"] is None
    with pytest.raises(ValueError):
        prefix.metric_deltas([b], [a, a])


def test_kv_bytes_against_the_new_tokens_kv():
    # Session 0: turn 0 of 20 tokens (all new), turn 1 of 30 (10 new); session 1: turn 0 of 25.
    recs = [RequestRecord(i, 0.0, prompt_len=n, send_s=0.0, session=s, turn=t)
            for i, (s, t, n) in enumerate([(0, 0, 20), (0, 1, 30), (1, 0, 25)])]
    got = prefix.prefix_summary(recs, {"pdkv_kv_transfer_bytes_total": 5500.0}, block_tokens=16, kv_token_bytes=100)
    assert got["new_prompt_tokens"] == 55 and got["kv_bytes_vs_new_tokens"] == pytest.approx(1.0)
    assert prefix.prefix_summary(recs, {}, block_tokens=16, kv_token_bytes=100)["kv_bytes_vs_new_tokens"] is None


# ------------------------------------------------------------------- outputs_equal


def _run(mode, cache, outs, rate=1.0):
    recs = [RequestRecord(i, 0.0, send_s=0.0, chunk_times_s=[0.1], chunk_tokens=[1], end_s=0.2, output_tokens=1,
                          output_token_ids=o) for i, o in enumerate(outs)]
    run = RunResult(serve_modes.run_label(mode, cache), rate, recs, config={"prefix_cache": cache})
    run.prefix = prefix.prefix_summary(recs, None, block_tokens=16)
    return run


def test_outputs_equal_against_the_cache_off_run():
    on = _run("disagg", "on", [[1, 2], [3]])
    off = _run("disagg", "off", [[1, 2], [3]])
    kv = _run("disagg-kv", "on", [[1, 2], [4]])
    col = _run("colocated", "on", [[1, 2], [3]])
    col_off = _run("colocated", "off", [[1, 2], [3, 3]])
    other_rate = _run("disagg", "on", [[1, 2], [3]], rate=2.0)
    res = BenchResults([off, on, kv, col_off, col, other_rate], SLO(1, 1))
    prefix.fill_outputs_equal(res)
    assert on.prefix["outputs_equal"] is True and on.prefix["outputs_baseline"] == "disagg-nocache"
    assert col.prefix["outputs_equal"] is False and col.prefix["outputs_baseline"] == "colocated-nocache"
    assert kv.prefix["outputs_equal"] is False and kv.prefix["outputs_baseline"] == "disagg-nocache"
    assert off.prefix["outputs_equal"] is None and other_rate.prefix["outputs_equal"] is None
    assert col.prefix["outputs_differ"] == [[1, 1]] and col.prefix["outputs_compared"] == 2
    assert kv.prefix["outputs_differ"] == [[1, 0]] and on.prefix["outputs_differ"] == []
    # Missing token ids: not comparable, never "equal".
    on2 = _run("disagg", "on", [None, [3]])
    prefix.fill_outputs_equal(BenchResults([off, on2], SLO(1, 1)))
    assert on2.prefix["outputs_equal"] is None
    # The figures survive results.json, and the summary carries them.
    d = BenchResults([off, on], SLO(1, 1)).to_dict()
    assert d["runs"][1]["summary"]["outputs_equal"] is True and "prefix_hit_rate" in d["runs"][1]["summary"]
    back = BenchResults.from_dict(json.loads(json.dumps(d)))
    assert back.runs[1].prefix["outputs_equal"] is True and back.runs[0].records[0].output_token_ids == [1, 2]
    md = prefix.markdown(res)
    assert "## Prefix reuse" in md and "**NO** (1 of 2)" in md and "disagg-kv" in md


# ------------------------------------------------------------------- the session client


def _tiny_trace(think_s=0.3, sessions=2, turns=3) -> SessionTrace:
    spec = _spec(turns=Fixed(turns), think_s=think_s, session_rate=50.0)
    return generate_sessions(spec, seed=5, num_sessions=sessions)


def test_session_client_builds_each_prompt_from_the_answer_and_waits_the_think_time():
    trace = _tiny_trace()

    async def go():
        async with FakeOpenAI(ttft_s=0.02, itl_s=0.005) as fake:
            recs = await run_sessions(fake.url, trace, model="fake-model")
            return fake, recs

    fake, recs = asyncio.run(go())
    assert [r.index for r in recs] == list(range(trace.num_requests)) and all(r.ok for r in recs)
    by_prompt = {tuple(b["prompt"]): (b, t) for b, t in zip(fake.bodies, fake.received_at)}
    for s in trace.sessions:
        prev_prompt = None
        for k, turn in enumerate(s.turns):
            rec = recs[s.first_index + k]
            body, _ = by_prompt[tuple(rec.prompt_token_ids)]
            assert body["return_token_ids"] is True and body["user"] == f"session-{s.index}"
            assert body["max_tokens"] == turn.output_len and len(body["prompt"]) == turn.prompt_len
            assert (rec.session, rec.turn) == (s.index, k)
            if k == 0:
                assert body["prompt"] == trace.first_prompt(s)
            else:
                answer = FakeOpenAI.answer(prev_prompt, s.turns[k - 1].output_len)
                assert recs[s.first_index + k - 1].output_token_ids == answer
                assert body["prompt"] == prev_prompt + answer + trace.new_tokens(s, k)
                prev = recs[s.first_index + k - 1]
                # Sent after the previous answer ended plus the think time (client clock).
                assert rec.scheduled_s == pytest.approx(prev.end_s + turn.think_s)
                assert rec.send_s >= prev.end_s + turn.think_s - 1e-6
            prev_prompt = body["prompt"]
    # The server saw each session's turns in order, think time apart.
    s0 = trace.sessions[0]
    times = [by_prompt[tuple(recs[s0.first_index + k].prompt_token_ids)][1] for k in range(len(s0.turns))]
    for k in range(1, len(times)):
        assert times[k] - times[k - 1] >= s0.turns[k].think_s
    best = prefix.hit_rate_max(recs, 4)
    assert 0.5 < best["rate"] < 1  # every later turn repeats its history; sessions share 32 tokens


def test_a_failed_turn_aborts_the_rest_of_its_session_only():
    trace = _tiny_trace(think_s=0.0, sessions=2, turns=3)
    bad = trace.sessions[0].turns[1].output_len
    assert all(t.output_len == bad for s in trace.sessions for t in s.turns)  # Fixed(4): pick by prompt instead

    async def go():
        async with FakeOpenAI(ttft_s=0.01, itl_s=0.001) as fake:
            orig = fake._stream

            async def stream(request, *, chat):
                body = await request.json()
                if len(body["prompt"]) == trace.sessions[0].turns[1].prompt_len and body["user"] == "session-0":
                    from aiohttp import web
                    return web.json_response({"error": {"message": "boom"}}, status=500)
                return await orig(request, chat=chat)

            fake._stream = stream
            return await run_sessions(fake.url, trace, model="fake-model")

    recs = asyncio.run(go())
    s0, s1 = trace.sessions
    assert recs[s0.first_index].ok and "HTTP 500" in recs[s0.first_index + 1].error
    late = recs[s0.first_index + 2]
    assert late.error.startswith("SessionAborted") and late.send_s is None
    assert all(recs[s1.first_index + k].ok for k in range(len(s1.turns)))


def test_a_server_without_token_ids_stops_the_session():
    trace = _tiny_trace(think_s=0.0, sessions=1, turns=2)

    async def go():
        async with FakeOpenAI(ttft_s=0.01, itl_s=0.001, behaviour="json") as fake:  # no token_ids in the body
            return await run_sessions(fake.url, trace, model="fake-model")

    recs = asyncio.run(go())
    assert recs[0].error.startswith("NoTokenIds") and recs[1].error.startswith("SessionAborted")


def test_session_client_refuses_text_prompts():
    with pytest.raises(ValueError, match="token-id prompts"):
        asyncio.run(run_sessions("http://127.0.0.1:9", _tiny_trace(), model="m", endpoint="chat"))


def test_run_sweep_attaches_prefix_figures_from_worker_metrics():
    trace = _tiny_trace(think_s=0.0, sessions=2, turns=2)

    async def go():
        async with FakeOpenAI(ttft_s=0.01, itl_s=0.001) as fake:
            def metrics():
                n = sum(len(b["prompt"]) for b in fake.bodies)
                return (f"pdkv_prompt_tokens_total {n}\npdkv_prefill_computed_tokens_total {n // 2}\n"
                        f"pdkv_kv_transfer_bytes_total{{transport=\"tcp\"}} {n * 10}\n")

            fake.metrics_text = metrics
            return await serve_cli.run_sweep(fake.url, [(1.0, trace)], mode="m", progress=False,
                                             metrics_urls=[fake.url], block_tokens=4, model="fake-model")

    (run,) = asyncio.run(go())
    sent = sum(r.prompt_len for r in run.records)
    p = run.prefix
    assert p["prompt_tokens"] == sent == p["worker_prompt_tokens"]
    assert p["prefill_tokens"] == sent // 2 and p["prefix_hit_rate"] == pytest.approx(1 - (sent // 2) / sent)
    assert p["kv_bytes"] == sent * 10 and p["kv_bytes_pulled"] is None
    assert p["new_prompt_tokens"] == sum(
        t.prompt_len - (s.turns[k - 1].prompt_len if k else 0) for s in trace.sessions for k, t in enumerate(s.turns))


# ------------------------------------------------------------------- command line


def _args(argv):
    parser = argparse.ArgumentParser()
    serve_modes.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_builds_session_traces_with_one_seed_per_rate():
    args = _args(["--workload", "multi-turn", "--sessions", "3", "--rates", "0.5,1", "--turns", "2",
                  "--think-time", "0.5", "--shared-len", "64", "--seed", "7"])
    traces, info = serve_cli.build_traces(args)
    assert [r for r, _ in traces] == [0.5, 1.0] and all(len(t.sessions) == 3 for _, t in traces)
    (_, t1), (_, t2) = traces
    assert t1.seed == 7 and t2.seed == 8 and t1.shared_prompt() != t2.shared_prompt()
    assert all(len(s.turns) == 2 and s.turns[1].think_s >= 0 for s in t1.sessions)
    assert t1.shared_len == 64 and info["workload"] == "multi-turn*" and info["seeds"] == {"0.5": 7, "1": 8}


def test_cli_replays_a_saved_session_trace(tmp_path):
    t = _tiny_trace()
    t.save(tmp_path / "rate-50.json")
    traces, info = serve_cli.build_traces(_args(["--trace", str(tmp_path / "rate-50.json")]))
    assert traces[0][0] == 50.0 and traces[0][1].sessions == t.sessions
    ((rate, half),), _ = serve_cli.build_traces(_args(["--trace", str(tmp_path / "rate-50.json"), "--rates", "25"]))
    assert rate == 25.0 and half.sessions[1].start_s == pytest.approx(2 * t.sessions[1].start_s, abs=1e-5)


@pytest.mark.parametrize("argv, match", [
    (["--workload", "agentic", "--endpoint", "chat"], "token-id prompts"),
    (["--workload", "agentic", "--prompt-format", "text"], "token-id prompts"),
    (["--workload", "agentic", "--arrival", "periodic"], "--arrival"),
    (["--workload", "agentic", "--num-requests", "4"], "--sessions"),
    (["--workload", "agentic", "--sessions", "0"], "--sessions"),
    (["--workload", "agentic", "--turns", "zero"], "bad length distribution"),
    (["--workload", "agentic", "--shared-len", "5000", "--sessions", "1"], "max_context"),
])
def test_cli_rejects_bad_session_options(argv, match):
    with pytest.raises(ValueError, match=match):
        serve_cli.build_traces(_args(argv))


def test_url_mode_checks_worker_metrics_urls(capsys):
    assert serve_cli.main(["--url", "http://127.0.0.1:9", "--worker-metrics", "127.0.0.1:8100"]) == 2
    assert "http://" in capsys.readouterr().err


def test_modes_cli_checks_prefix_options(capsys):
    assert serve_modes.main(["--modes", "disagg-kv", "--prefix-cache", "off", "--workload", "multi-turn"]) == 2
    assert "needs --prefix-cache on" in capsys.readouterr().err
    assert serve_modes.main(["--modes", "disagg,nope", "--prefix-cache", "on"]) == 2
    assert serve_modes.main(["--modes", "disagg", "--workload", "multi-turn", "--block-tokens", "0"]) == 2
    assert "--block-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_modes.main(["--prefix-cache", "maybe"])
    with pytest.raises(SystemExit):
        serve_modes.main(["--prefix-cache", "on", "--url", "http://127.0.0.1:9"])
    assert "--worker-metrics" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_modes.main(["--worker-metrics", "http://127.0.0.1:9"])
    assert "for --url runs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_modes.main(["--workload", "chat-forever"])
    assert serve_modes.cache_settings(_args(["--prefix-cache", "both"])) == ["off", "on"]
    assert serve_modes.cache_settings(_args([])) == [None]


def test_deployments_get_the_prefix_cache_and_routing_flags(tmp_path):
    args = _args(["--prefix-cache", "on", "--block-tokens", "32"])
    dep, pd = serve_modes.deployment_for("disagg-kv", tmp_path, args, None, cache="on")
    assert pd == "1:1" and dep.mode == "disagg" and dep.proxy_args == ["--routing", "kv"]
    assert list(dep.worker_args) == ["--prefix-cache", "on", "--block-tokens", "32"]
    dep, _ = serve_modes.deployment_for("colocated", tmp_path, _args([]), None, cache="off")
    assert list(dep.worker_args) == ["--prefix-cache", "off"]
    dep, _ = serve_modes.deployment_for("disagg", tmp_path, _args([]), None)
    assert list(dep.worker_args) == [] and list(dep.proxy_args) == []
    assert serve_modes.run_label("disagg", "off") == "disagg-nocache" and serve_modes.run_label("disagg", "on") == \
        "disagg"


def test_emit_results_writes_the_prefix_section_and_the_session_traces(tmp_path):
    trace = _tiny_trace(sessions=1, turns=2)
    on, off = _run("disagg", "on", [[1], [2]]), _run("disagg", "off", [[1], [2]])
    res = BenchResults([off, on], SLO(1, 1), {"command": "x", "trace": {"workload": "multi-turn"}})
    paths = serve_cli.emit_results(res, out=str(tmp_path), traces=[(1.0, trace)], plots=False)
    md = paths["markdown"].read_text()
    assert "## Prefix reuse" in md and "yes (vs disagg-nocache)" in md and "Rate (sessions/s)" in md
    assert load_session_trace(tmp_path / "traces" / "rate-1.json").sessions == trace.sessions
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["runs"][1]["summary"]["outputs_equal"] is True


def test_session_dataclasses_round_trip():
    s = Session(0, 0.0, (Turn(3, 2, 0.0, 10),), 0)
    assert s.to_dict()["turns"][0] == {"new_len": 3, "output_len": 2, "think_s": 0.0, "prompt_len": 10}


def test_each_mode_runs_cache_off_then_on_and_disagg_kv_only_on(monkeypatch, tmp_path):
    seen = []

    class FakeDep:
        url = "http://127.0.0.1:9"
        workers = []

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_deployment(mode, model_dir, args, log_dir, lab=None, cache=None):
        seen.append((mode, cache))
        return FakeDep(), "1:1"

    async def fake_measure(url, traces, mode, pd_ratio, args, model_name, prefill_urls=(), worker_urls=(),
                           cache=None):
        return [], "m"

    monkeypatch.setattr(serve_modes, "deployment_for", fake_deployment)
    monkeypatch.setattr(serve_modes, "_measure", fake_measure)
    args = _args(["--prefix-cache", "both"])
    serve_modes._run_each_mode(["disagg", "disagg-kv"], tmp_path, [], args, None)
    assert seen == [("disagg", "off"), ("disagg", "on"), ("disagg-kv", "on")]
