"""`pdkv plan` end to end on the generated tiny model (measured in-process, bounded:
short prompts, small batches), and capacity derived from a `pdkv bench serve` results
file. Values are checked for consistency, never for speed."""

from __future__ import annotations

import json
import math

import pytest

from pdkv.lab.plan import cli as plan_cli
from pdkv.serving.capacity import Capacity
from pdkv.errors import InvalidArgument

TRACE_ARGS = ["--preset", "chat-short", "--prompt-len", "uniform:8:40", "--output-len", "uniform:4:12",
              "--rates", "3", "--num-requests", "40", "--ttft-slo", "2", "--itl-slo", "0.2"]


def test_plan_measures_the_tiny_model_and_recommends_a_consistent_split(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert plan_cli.main([*TRACE_ARGS, "--max-decode-batch", "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "plan.json").read_text())
    cap = Capacity.from_dict(res["capacity"])
    assert cap.source.startswith("measured: tiny-4m")
    # Prefill points at the trace's prompt lengths (within uniform:8:40), decode at 1..16.
    lens = [p[0] for p in cap.points["prefill"]]
    assert lens == sorted(lens) and 8 <= lens[0] and lens[-1] <= 40
    assert [p[0] for p in cap.points["decode"]] == [1, 2, 4, 8, 16]
    assert all(t > 0 for _, t in cap.points["prefill"] + cap.points["decode"])
    assert cap.prefill_s(40) > 0 and cap.step_s(1) > 0
    rec = res["recommendation"]
    p, d = (int(x) for x in rec["split"].split(":"))
    assert rec["recommended"]["meets_slo"]
    assert f"recommended split {rec['split']}" in printed
    # Utilisation scales as 1/n across the neighbours, and a smaller pool meets the SLO
    # only if the recommendation was not minimal: it never is.
    util = {s["split"]: s for s in [rec["recommended"], *rec["neighbours"]]}
    if f"{p + 1}:{d}" in util:
        assert util[f"{p + 1}:{d}"]["prefill"]["utilisation"] == pytest.approx(
            rec["recommended"]["prefill"]["utilisation"] * p / (p + 1))
    for smaller in (f"{p - 1}:{d}", f"{p}:{d - 1}"):
        if smaller in util:
            assert not util[smaller]["meets_slo"]
    assert rec["ideal_prefill_workers"] <= p and rec["ideal_decode_workers"] <= d
    assert 0 <= rec["integer_loss"] < 1
    budget = res["budget"]
    assert budget["workers"] == p + d
    assert budget["best_max_rate"] <= budget["fractional_max_rate"] * (1 + 1e-9)
    # The recommended split sustains at least the trace's rate.
    best_row = next(r for r in budget["splits"] if r["split"] == rec["split"]) if p + d >= 2 else None
    if best_row is not None:
        assert best_row["max_rate"] >= 3.0 * (1 - 1e-6)
    # Reading the capacity back gives the same recommendation without measuring.
    assert plan_cli.main([*TRACE_ARGS, "--capacity", str(out / "plan.json"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "plan.json").read_text())
    assert again["recommendation"] == rec


def _record(i: int, prompt_len: int, ttft: float, itl: float, tokens: int, start: float) -> dict:
    times = [start + ttft + k * itl for k in range(tokens)]
    return {"index": i, "scheduled_s": start, "prompt_len": prompt_len, "max_tokens": tokens, "send_s": start,
            "chunk_times_s": times, "chunk_tokens": [1] * tokens, "end_s": times[-1], "output_tokens": tokens,
            "finish_reason": "length", "http_status": 200, "usage_per_chunk": True}


def test_capacity_from_bench_serve_results(tmp_path):
    """Synthetic disagg runs: TTFT = 1 ms per prompt token (no queueing), and ITLs of
    20 ms with one decode worker at two loads: the prefill fit recovers 1 ms/token; the
    decode fit goes through the two (batch, ITL) points."""
    from pdkv.lab.plan.measure import from_results
    from pdkv.lab.serve.metrics import SLO, BenchResults, RunResult, RequestRecord

    runs = []
    for rate, itl, gap in ((1.0, 0.020, 1.0), (4.0, 0.030, 0.25)):
        recs = [RequestRecord.from_dict(_record(i, 50 + 10 * i, 0.001 * (50 + 10 * i), itl, 11, i * gap))
                for i in range(8)]
        runs.append(RunResult("disagg", rate, recs, pd_ratio="1:1"))
    runs.append(RunResult("colocated", 1.0, runs[0].records))  # ignored
    path = tmp_path / "results.json"
    BenchResults(runs, SLO(2.0, 0.1)).save(path)
    cap = from_results(tmp_path)
    assert cap.prefill_s_per_token == pytest.approx(0.001)
    assert cap.prefill_fixed_s == pytest.approx(0.0, abs=1e-9)
    (b1, s1), (b2, s2) = cap.points["decode"]
    assert (s1, s2) == (pytest.approx(0.020), pytest.approx(0.030))
    assert b2 > b1 > 0
    assert cap.step_s(b1) == pytest.approx(0.020) and cap.step_s(b2) == pytest.approx(0.030)
    assert math.isfinite(cap.decode_tok_s(0.1))
    BenchResults([runs[2]], SLO(2.0, 0.1)).save(path)
    with pytest.raises(InvalidArgument, match="no disaggregated run"):
        from_results(tmp_path)
    path.write_text("{}")
    with pytest.raises(InvalidArgument, match="--from-results"):
        from_results(tmp_path)


@pytest.mark.slow
def test_plan_sweep_runs_the_deployment_and_compares(tmp_path):
    """`--sweep 1:1,1:2` launches each split (worker processes on 127.0.0.1) on the
    same small trace: every request answered, both splits reported next to their
    predictions (with a given capacity, so nothing is measured in-process)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("aiohttp")
    import os
    import subprocess
    import sys

    cap = Capacity(0.01, 0.0001, 0.001, 0.003, max_decode_batch=16, source="given")
    (tmp_path / "cap.json").write_text(json.dumps({"capacity": cap.to_dict()}))
    out = tmp_path / "out"
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-m", "pdkv.cli", "plan", *TRACE_ARGS, "--num-requests", "6",
                          "--capacity", str(tmp_path / "cap.json"), "--sweep", "1:1,1:2", "--no-progress",
                          "--warmup", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    sweep = json.loads((out / "plan.json").read_text())["sweep"]
    assert [r["split"] for r in sweep["splits"]] == ["1:1", "1:2"]
    for r in sweep["splits"]:
        assert r["measured"]["num_requests"] == 6 and r["measured"]["num_errors"] == 0, r
        assert r["measured"]["ttft_p90_s"] > 0
        assert r["predicted"]["split"] == r["split"]
    assert sweep["best_measured"] in (None, "1:1", "1:2")
    assert "best split measured" in res.stdout
