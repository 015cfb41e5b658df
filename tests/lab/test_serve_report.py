"""Report files, the markdown table, the recommendation, and the ``--url`` CLI end to end."""

from __future__ import annotations

import asyncio
import json

import pytest

from fake_openai import FakeOpenAI, FakeOpenAIThread
from pdkv.lab.serve.cli import main, run_sweep
from pdkv.lab.serve.trace import Fixed, Periodic, TraceSpec
from pdkv.lab.serve.metrics import SLO, BenchResults, RequestRecord, RunResult
from pdkv.lab.serve.report import LAG_WARN_S, markdown_table, recommend, sanity_notes, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def _record(index: int, *, ttft: float, itl: float, tokens: int = 4, error: str | None = None) -> RequestRecord:
    send = float(index)
    r = RequestRecord(index=index, scheduled_s=send, prompt_len=16, max_tokens=tokens, send_s=send)
    if error is None:
        for k in range(tokens):
            r.add_chunk(send + ttft + k * itl)
        r.output_tokens = tokens
        r.usage_per_chunk = True  # one token per chunk, as per-chunk usage reported
        r.finish_reason = "length"
        r.end_s = r.chunk_times_s[-1]
    else:
        r.error, r.end_s = error, send + 0.01
    return r


def _run(mode, rate, n, *, bad=(), pd=None, slow_itl=0.5):
    """``n`` requests with TTFT 0.1 s, ITL 20 ms, except indices in ``bad`` (ITL ``slow_itl``)."""
    recs = [_record(i, ttft=0.1, itl=slow_itl if i in bad else 0.02) for i in range(n)]
    return RunResult(mode, rate, recs, pd_ratio=pd)


SLO_ = SLO(ttft_s=1.0, itl_s=0.1)


def _results(b_bad_at_2):
    runs = [
        _run("disagg", 1.0, 20, pd="1:1"),
        _run("disagg", 2.0, 20, pd="1:1"),
        _run("chunked", 1.0, 20),
        _run("chunked", 2.0, 20, bad=b_bad_at_2),
    ]
    return BenchResults(runs, SLO_, {"command": "pdkv bench serve --test", "trace": {"preset": "mixed", "seed": 0}})


def test_recommend_beyond_noise():
    rec = recommend(_results(b_bad_at_2=range(10)))
    assert rec.best.candidate == "disagg 1:1" and rec.best.mode == "disagg" and rec.best.pd_ratio == "1:1"
    assert (rec.best.good, rec.best.total) == (40, 40)
    assert [c.candidate for c in rec.ranking] == ["disagg 1:1", "chunked"]
    cmp = rec.comparisons["chunked"]
    assert cmp["method"] == "paired" and (cmp["best_only"], cmp["other_only"]) == (10, 0)
    assert not cmp["within_noise"] and rec.within_noise == []  # 10 > 2 * sqrt(10)
    assert rec.rates == [1.0, 2.0]
    assert rec.best.per_rate[2.0]["good"] == 20 and rec.ranking[1].per_rate[2.0]["good"] == 10
    assert "40 of 40 requests (100.0%)" in rec.text and "beyond noise" in rec.text
    assert "met the SLO for 10 that chunked missed, and missed 0" in rec.text
    json.dumps(rec.to_dict(), allow_nan=False)


def test_recommend_within_noise():
    rec = recommend(_results(b_bad_at_2={3, 7}))
    assert rec.best.candidate == "disagg 1:1"
    assert rec.within_noise == ["chunked"]  # 2 <= 2 * sqrt(2)
    assert "within noise" in rec.text and "not clearly better than chunked" in rec.text


def test_recommend_uses_the_slo_it_is_given():
    res = _results(b_bad_at_2=range(10))
    loose = recommend(res, SLO(ttft_s=1.0, itl_s=1.0))
    assert all(c.fraction == 1.0 for c in loose.ranking) and loose.within_noise == ["chunked"]
    nothing = recommend(res, SLO(ttft_s=0.05, itl_s=1.0))
    assert nothing.best.good == 0 and "No candidate met the SLO" in nothing.text


def test_recommend_only_compares_common_rates_and_handles_edge_cases():
    res = _results(b_bad_at_2=range(10))
    res.runs.append(_run("hybrid", 3.0, 5))
    rec = recommend(res)
    assert rec.rates == [] and "no common rate" in rec.text
    single = recommend(BenchResults([_run("url", 1.0, 3)], SLO_))
    assert single.best.candidate == "url" and "Only one candidate" in single.text
    assert recommend(BenchResults([], SLO_)).best is None


def test_markdown_table():
    md = markdown_table(_results(b_bad_at_2=range(10)))
    lines = md.strip().splitlines()
    assert lines[0].startswith("| Mode | P:D | Rate (req/s) |") and "Goodput |" in lines[0]
    assert len(lines) == 2 + 4
    assert lines[2].startswith("| disagg | 1:1 | 1 | 20 | 0 |")
    assert lines[5].startswith("| chunked | - | 2 | 20 | 0 |") and "50.0%" in lines[5]
    assert "| 20 | 20 | 20 |" in lines[2]  # ITL p50/p90/p99 in ms


def test_sanity_notes_flag_errors_and_client_lag(tmp_path):
    clean = _results(b_bad_at_2=())
    assert sanity_notes(clean) == []
    late = _run("colocated", 1.0, 10)
    for r in late.records[5:]:
        r.scheduled_s = r.send_s - 2 * LAG_WARN_S
    failed = RunResult("disagg", 1.0, [_record(0, ttft=0.1, itl=0.02), _record(1, ttft=0, itl=0, error="HTTP 503: busy")])
    notes = sanity_notes(BenchResults([late, failed], SLO_))
    assert len(notes) == 2
    assert notes[0].startswith("colocated @ 1 req/s: the client sent requests late (lag p99 100 ms")
    assert notes[1] == "disagg @ 1 req/s: 1 of 2 requests failed (HTTP 503 x1)."
    md = write_report(BenchResults([late, failed], SLO_), tmp_path, plots=False)["markdown"].read_text()
    assert "## Checks" in md and "HTTP 503 x1" in md


def test_write_report_without_plots(tmp_path):
    res = _results(b_bad_at_2=range(10))
    paths = write_report(res, tmp_path / "out", plots=False, slo=SLO(1.0, 0.2))
    assert set(paths) == {"json", "markdown"}
    back = BenchResults.load(paths["json"])
    assert back.slo == SLO(1.0, 0.2) and len(back.runs) == 4
    md = paths["markdown"].read_text()
    assert "pdkv bench serve --test" in md and "## Recommendation" in md and "| Mode |" in md


def test_write_report_with_plots(tmp_path):
    pytest.importorskip("matplotlib")
    res = _results(b_bad_at_2=range(10))
    res.runs.append(RunResult("hybrid", 1.0, [_record(0, ttft=0.1, itl=0.0, error="HTTP 500: x")]))
    paths = write_report(res, tmp_path)
    for key in ("itl_cdf", "rate_sweep"):
        assert paths[key].read_bytes()[:8] == PNG
    assert "![ITL CDF](itl_cdf.png)" in paths["markdown"].read_text()


def test_two_modes_through_run_sweep_and_recommend():
    spec = TraceSpec("t", "test", Periodic(20.0), Fixed(8), Fixed(4))
    traces = [(r, spec.with_rate(r).generate(seed=1, duration_s=0.3)) for r in (20.0, 40.0)]

    async def go():
        async with FakeOpenAI(ttft_s=0.01, itl_s=0.002) as fast, FakeOpenAI(ttft_s=0.01, itl_s=0.06) as slow:
            runs = await run_sweep(fast.url, traces, mode="disagg", pd_ratio="1:1", model="m", cooldown_s=0,
                                   progress=False)
            runs += await run_sweep(slow.url, traces, mode="colocated", model="m", cooldown_s=0, progress=False)
            return runs

    runs = asyncio.run(go())
    assert [(r.candidate, r.rate, len(r.records)) for r in runs] == [
        ("disagg 1:1", 20.0, 6), ("disagg 1:1", 40.0, 12), ("colocated", 20.0, 6), ("colocated", 40.0, 12)
    ]
    rec = recommend(BenchResults(runs, SLO(ttft_s=1.0, itl_s=0.03)))
    assert rec.best.candidate == "disagg 1:1" and (rec.best.good, rec.best.total) == (18, 18)
    assert rec.ranking[1].good == 0 and rec.within_noise == []
    assert rec.comparisons["colocated"]["best_only"] == 18


def test_cli_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "serve-x"
    with FakeOpenAIThread(ttft_s=0.01, itl_s=0.001) as srv:
        rc = main([
            "--url", srv.url, "--preset", "chat-short", "--rates", "4,8", "--duration", "0.75",
            "--output-len", "uniform:2:6", "--out", str(out), "--cooldown", "0", "--warmup", "1",
            "--itl-slo", "0.05", "--no-progress",
        ])
        warm_and_measured = len(srv.bodies)
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| url | - | 4 |" in stdout and "Recommended: url" in stdout
    res = BenchResults.load(out / "results.json")
    assert [r.rate for r in res.runs] == [4.0, 8.0] and res.slo == SLO(2.0, 0.05)
    n = sum(len(r.records) for r in res.runs)
    assert warm_and_measured == n + 1
    assert all(rec.ok for r in res.runs for rec in r.records)
    assert res.meta["model"] == "fake-model" and res.meta["trace"]["preset"] == "chat-short*"
    for name in ("report.md", "itl_cdf.png", "rate_sweep.png", "traces/rate-4.jsonl", "traces/rate-8.jsonl"):
        assert (out / name).is_file(), name
    assert len((out / "traces/rate-8.jsonl").read_text().splitlines()) == len(res.runs[1].records)


def test_cli_replay_and_failures(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0.1 * i, "prompt_len": 4, "output_len": 2} for i in range(4)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FakeOpenAIThread(ttft_s=0.005, itl_s=0.001) as srv:
        assert main(["--url", srv.url, "--trace", str(trace), "--warmup", "0", "--no-progress"]) == 0
        assert main(["--url", srv.url, "--trace", str(trace), "--rates", "20", "--warmup", "0", "--no-progress"]) == 0
        assert len(srv.bodies) == 8
    stdout = capsys.readouterr().out
    assert "| url | - | 10 | 4 |" in stdout and "| url | - | 20 | 4 |" in stdout
    assert main(["--list-presets"]) == 0 and "prefill-heavy" in capsys.readouterr().out
    assert main(["--preset", "mixed"]) == 2  # no --url
    assert main(["--url", "http://127.0.0.1:1", "--preset", "nope"]) == 2
    assert main(["--url", "http://127.0.0.1:1", "--prompt-len", "uniform:9"]) == 2
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:1", "--rates", "0,-1"])
    assert main(["--url", "http://127.0.0.1:1", "--duration", "1", "--warmup", "0", "--no-progress"]) == 1
    assert "cannot list models" in capsys.readouterr().err


def test_report_says_whether_itl_is_per_token(tmp_path):
    run = _run("colocated", 1.0, 4)
    for r in run.records:
        r.usage_per_chunk = False
    per_chunk = BenchResults([run], SLO_, {"command": "x"})
    notes = sanity_notes(per_chunk)
    assert any("ITL is per chunk, not per token: 4 of 4 requests" in n for n in notes)
    write_report(per_chunk, tmp_path / "a", plots=False)
    assert "ITL is per chunk: the server did not report per-chunk usage" in (tmp_path / "a" / "report.md").read_text()
    per_token = BenchResults([_run("colocated", 1.0, 4)], SLO_, {"command": "x"})
    assert not any("per chunk" in n for n in sanity_notes(per_token))
    write_report(per_token, tmp_path / "b", plots=False)
    md = (tmp_path / "b" / "report.md").read_text()
    assert "ITL is per token" in md
    assert json.loads((tmp_path / "b" / "results.json").read_text())["runs"][0]["summary"]["itl_per_token"] is True
