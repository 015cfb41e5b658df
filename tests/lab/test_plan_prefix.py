"""`pdkv plan` with prefix reuse: the hit rate scales computed prompt tokens and KV moved
(hand-computed against tests/lab/test_plan.py's capacity), read from a number or from a
`pdkv bench serve` results file. No model, no timing.
"""

from __future__ import annotations

import json

import pytest

from pdkv.errors import InvalidArgument
from pdkv.lab.plan import cli as plan_cli
from pdkv.lab.plan import measure as plan_measure
from pdkv.lab.plan import model as plan
from pdkv.lab.plan.model import Slo, Workload
from pdkv.lab.serve.metrics import SLO, BenchResults, RequestRecord, RunResult
from pdkv.lab.serve.trace_dist import Fixed
from pdkv.lab.serve.trace_sessions import SessionSpec, generate_sessions
from pdkv.serving.capacity import Capacity

CAP = Capacity(prefill_fixed_s=0.0, prefill_s_per_token=0.001, step_fixed_s=0.010, step_per_seq_s=0.001,
               max_decode_batch=64)
LOAD = Workload(10.0, (100,) * 50, (21,) * 50)


def test_hit_rate_scales_the_prefill_pool_like_shorter_prompts():
    # Half the prompt cached: S = 0.05 s, the same pool as 50-token prompts without a cache.
    # n=1: rho = 0.5, Wq = 10 * 0.0025 / (2 * 0.5) = 0.025, wait p90 = 0.05 ln 5, TTFT p90 = 0.05 + 0.05 ln 5.
    half = LOAD.with_prefix_hit_rate(0.5)
    got = plan.prefill_pool(CAP, half, 1, 1.0)
    assert got.utilisation == pytest.approx(0.5)
    assert got.latency_p90_s == pytest.approx(0.05 + 0.05 * __import__("math").log(5))
    assert got == plan.prefill_pool(CAP, Workload(10.0, (50,) * 50, (21,) * 50), 1, 1.0)
    # Without the cache one prefill worker cannot keep up (rho = 1); with it, one suffices.
    slo = Slo(1.0, 0.05)
    assert plan.recommend(CAP, LOAD, slo)["split"] == "2:1"
    rec = plan.recommend(CAP, half, slo)
    assert rec["split"] == "1:1"
    assert rec["prefix_hit_rate"] == 0.5 and rec["prompt_tokens_per_request"] == 100
    assert rec["computed_prompt_tokens_per_request"] == 50 and rec["kv_tokens_moved_per_request"] == 50
    assert rec["prefill_tok_s_per_worker"] == pytest.approx(2000)  # 100 tokens sent per 0.05 s
    # Decode does not change: the decode pool sees the same requests.
    assert plan.decode_pool(CAP, half, 1, 0.05) == plan.decode_pool(CAP, LOAD, 1, 0.05)


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), 2])
def test_workload_rejects_bad_hit_rates(bad):
    with pytest.raises(InvalidArgument, match="prefix hit rate"):
        Workload(1.0, (10,), (2,), bad)


def test_session_trace_workload_counts_turns_as_requests():
    spec = SessionSpec("t", "", session_rate=0.5, shared_len=10, first_len=Fixed(5), turn_len=Fixed(3),
                       output_len=Fixed(2), turns=Fixed(4), think_s=0.0)
    trace = generate_sessions(spec, seed=0, num_sessions=3)
    load = Workload.of_trace(trace, 0.5, prefix_hit_rate=0.25)
    assert load.rate == pytest.approx(0.5 * 4)  # 0.5 sessions/s x 4 turns
    assert load.prompt_lens[:4] == (15, 20, 25, 30) and set(load.output_lens) == {2}
    assert load.prefix_hit_rate == 0.25


def _results(tmp_path, runs):
    res = BenchResults(runs, SLO(1, 1))
    res.save(tmp_path / "results.json")
    return tmp_path


def _run(mode, hit, sent):
    r = RunResult(mode, 1.0, [RequestRecord(0, 0.0)], "1:1")
    r.prefix = None if hit is None else {"prefix_hit_rate": hit, "prompt_tokens": sent}
    return r


def test_hit_rate_from_a_results_file(tmp_path):
    d = _results(tmp_path, [_run("disagg", 0.2, 1000), _run("disagg-kv", 0.9, 1000), _run("disagg-kv", 0.6, 3000),
                            _run("colocated", None, 0)])
    rate, source = plan_measure.prefix_hit_rate_from_results(d)
    assert rate == pytest.approx((900 + 1800) / 4000) and source.startswith("disagg-kv") and "2 runs" in source
    assert plan_cli.parse_prefix_hit_rate(str(d / "results.json"))[0] == pytest.approx(rate)
    assert plan_cli.parse_prefix_hit_rate("0.3") == (0.3, "given")
    for bad in ("1", "-0.5", "inf", str(tmp_path / "missing")):
        with pytest.raises(InvalidArgument, match="--prefix-hit-rate"):
            plan_cli.parse_prefix_hit_rate(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    _results(empty, [_run("disagg", None, 0)])
    with pytest.raises(InvalidArgument, match="no run with a measured prefix_hit_rate"):
        plan_measure.prefix_hit_rate_from_results(empty)


def test_plan_command_reports_the_hit_rate(tmp_path, capsys):
    cap = tmp_path / "plan.json"
    cap.write_text(json.dumps({"capacity": CAP.to_dict()}))
    argv = ["--capacity", str(cap), "--prompt-len", "100", "--output-len", "21", "--rates", "10",
            "--num-requests", "50", "--ttft-slo", "1", "--itl-slo", "0.05", "--out", str(tmp_path / "o")]
    assert plan_cli.main(argv) == 0
    base = json.loads((tmp_path / "o" / "plan.json").read_text())["recommendation"]
    assert base["split"] == "2:1" and base["prefix_hit_rate"] == 0.0
    assert "prefix hit rate" not in capsys.readouterr().out
    assert plan_cli.main([*argv, "--prefix-hit-rate", "0.5"]) == 0
    rec = json.loads((tmp_path / "o" / "plan.json").read_text())["recommendation"]
    assert rec["split"] == "1:1" and rec["computed_prompt_tokens_per_request"] == 50
    assert "prefix hit rate 50.0% (given): prefill computes 50 of 100 prompt tokens" in capsys.readouterr().out


def test_kv_bytes_per_token_from_a_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2,
                                                      "hidden_size": 512, "num_hidden_layers": 4,
                                                      "torch_dtype": "bfloat16"}))
    assert plan_cli.kv_bytes_per_token(tmp_path) == 2 * 4 * 2 * 64 * 2
    assert plan_cli.kv_bytes_per_token(None) is None
    assert plan_cli.kv_bytes_per_token(tmp_path / "nope") is None


def test_from_results_counts_only_the_computed_prompt_tokens(tmp_path):
    def recs(ttft_per_token):
        out = []
        for i, n in enumerate((100, 200, 300, 400, 500, 600, 700, 800)):
            t = n * ttft_per_token
            out.append(RequestRecord(i, 0.0, prompt_len=n, send_s=0.0, chunk_times_s=[t, t + 0.01, t + 0.02],
                                     chunk_tokens=[1, 1, 1], end_s=t + 0.02, output_tokens=3))
        return out

    plain = RunResult("disagg", 1.0, recs(0.001), "1:1")
    cached = RunResult("disagg", 1.0, recs(0.0005), "1:1")  # same engine, half of every prompt cached
    cached.prefix = {"prefix_hit_rate": 0.5, "prompt_tokens": 3600}
    a = plan_measure.from_results(_results(tmp_path, [plain]))
    (tmp_path / "b").mkdir()
    b = plan_measure.from_results(_results(tmp_path / "b", [cached]))
    assert a.prefill_s_per_token == pytest.approx(0.001) and b.prefill_s_per_token == pytest.approx(0.001)
