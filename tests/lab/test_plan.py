"""`pdkv plan`'s arithmetic against hand-computed cases (no model, no timing).

The capacity of every case: prefill 1 ms per prompt token (no fixed cost); a decode
step 10 ms + 1 ms per request in the batch, at most 64 requests. The workload: 10
requests/s, every prompt 100 tokens, every output 21 tokens (20 from decode).

Prefill per request S = 0.1 s (deterministic, so E[S^2] = 0.01). With n workers:
rho = 10/n * 0.1, Wq = 10/n * 0.01 / (2 (1 - rho)), wait p90 = Wq/rho * ln(10 rho).
  n=1: rho = 1 -> cannot keep up.
  n=2: rho = 0.5, Wq = 0.05, wait p90 = 0.1 ln 5 = 0.160944, TTFT p90 = 0.260944.
  n=3: rho = 1/3, Wq = 0.025, wait p90 = 0.075 ln(10/3) = 0.090298, TTFT p90 = 0.190298.
Decode demand 10 * 20 = 200 tokens/s. With n workers, D = 200/n per worker and the
batch settles at B = D * 0.01 / (1 - D * 0.001); ITL = 0.01 + 0.001 max(B, 1).
  n=1: B = 2 / 0.8 = 2.5, ITL = 0.0125.
  n=2: B = 1 / 0.9 = 1.1111, ITL = 0.0111111.
Raw decode throughput: 64 / 0.074 = 864.86 tokens/s, so n=1 is at 200/864.86 = 23.1%.
"""

from __future__ import annotations

import json
import math

import pytest

from pdkv.errors import InvalidArgument
from pdkv.lab.plan import model as plan
from pdkv.lab.plan.measure import fit_line
from pdkv.lab.plan.model import Slo, Workload
from pdkv.lab.plan.sweep import parse_splits, pick_measured, pick_predicted
from pdkv.serving.capacity import Capacity

CAP = Capacity(prefill_fixed_s=0.0, prefill_s_per_token=0.001, step_fixed_s=0.010, step_per_seq_s=0.001,
               max_decode_batch=64)
LOAD = Workload(10.0, (100,) * 50, (21,) * 50)


def test_prefill_pool_matches_hand_computed_mg1():
    assert plan.prefill_pool(CAP, LOAD, 1, 1.0).utilisation == pytest.approx(1.0)
    assert not plan.prefill_pool(CAP, LOAD, 1, 1.0).meets_slo
    two = plan.prefill_pool(CAP, LOAD, 2, 1.0)
    assert two.utilisation == pytest.approx(0.5)
    assert two.latency_p90_s == pytest.approx(0.1 + 0.1 * math.log(5))
    three = plan.prefill_pool(CAP, LOAD, 3, 1.0)
    assert three.latency_p90_s == pytest.approx(0.1 + 0.075 * math.log(10 / 3))
    # The proxy/KV-hop overhead adds to TTFT.
    assert plan.prefill_pool(CAP, LOAD, 2, 1.0, 0.05).latency_p90_s == pytest.approx(two.latency_p90_s + 0.05)


def test_decode_pool_matches_littles_law():
    one = plan.decode_pool(CAP, LOAD, 1, 0.05)
    assert one.latency_p90_s == pytest.approx(0.0125)
    assert one.utilisation == pytest.approx(200 / (64 / 0.074))
    assert one.meets_slo
    assert plan.decode_pool(CAP, LOAD, 2, 0.05).latency_p90_s == pytest.approx(0.01 + 0.001 / 0.9)
    # 1000 tokens/s per worker: D * b = 1, the batch never settles.
    assert not plan.decode_pool(CAP, LOAD.with_rate(50.0), 1, 10.0).meets_slo


def test_throughput_bound_split_with_integer_rounding():
    rec = plan.recommend(CAP, LOAD, Slo(ttft_s=1.0, itl_s=0.05))
    assert rec["split"] == "2:1"
    assert rec["prefill_bound"] == "throughput" and rec["decode_bound"] == "throughput"
    # Fractional pools: prefill needs rho < 1 and TTFT p90 <= 1 s -> just over 1 worker
    # (rho -> 1 makes the wait blow up, so a bit more than 1.0); decode meets 50 ms
    # with a small fraction of one worker.
    assert 1.0 < rec["ideal_prefill_workers"] < 1.2
    assert rec["ideal_decode_workers"] < 0.3
    loss = 1 - (rec["ideal_prefill_workers"] + rec["ideal_decode_workers"]) / 3
    assert rec["integer_loss"] == pytest.approx(loss)
    assert 0.5 < rec["integer_loss"] < 0.65
    # The utilisation of the recommended split and of its neighbours.
    assert rec["recommended"]["prefill"]["utilisation"] == pytest.approx(0.5)
    assert rec["recommended"]["decode"]["utilisation"] == pytest.approx(200 / (64 / 0.074))
    by = {n["split"]: n for n in rec["neighbours"]}
    assert set(by) == {"1:1", "3:1", "2:2", "1:2"}
    assert by["1:1"]["prefill"]["utilisation"] == pytest.approx(1.0) and not by["1:1"]["meets_slo"]
    assert by["1:1"]["prefill"]["latency_p90_s"] is None  # unbounded queue
    assert by["3:1"]["prefill"]["utilisation"] == pytest.approx(1 / 3) and by["3:1"]["meets_slo"]
    assert by["2:2"]["decode"]["utilisation"] == pytest.approx(100 / (64 / 0.074))
    json.dumps(rec, allow_nan=False)  # strict JSON


def test_ttft_slo_bound_prefill_needs_more_workers_than_throughput():
    rec = plan.recommend(CAP, LOAD, Slo(ttft_s=0.2, itl_s=0.05))
    assert rec["split"] == "3:1"  # 2 keep up (TTFT p90 0.261 s), only 3 meet 0.2 s (0.190 s)
    assert rec["prefill_bound"] == "slo"
    assert rec["recommended"]["prefill"]["latency_p90_s"] == pytest.approx(0.1 + 0.075 * math.log(10 / 3))


def test_itl_slo_bound_decode_needs_more_workers_than_throughput():
    rec = plan.recommend(CAP, LOAD, Slo(ttft_s=1.0, itl_s=0.012))
    assert rec["split"] == "2:2"  # 1 decode worker keeps up (23%) but its ITL is 12.5 ms
    assert rec["decode_bound"] == "slo"
    # Exactly matched: ITL = 12 ms at B = 2 -> D = B / step = 2 / 0.012 tokens/s per worker.
    assert rec["ideal_decode_workers"] == pytest.approx(200 / (2 / 0.012), rel=1e-6)


def test_unmeetable_objective_says_which_pool():
    rec = plan.recommend(CAP, LOAD, Slo(ttft_s=0.05, itl_s=0.05))  # one prompt alone takes 0.1 s
    assert rec["split"] is None and "TTFT" in rec["why"]
    rec = plan.recommend(CAP, LOAD, Slo(ttft_s=1.0, itl_s=0.005))  # one request's step takes 11 ms
    assert rec["split"] is None and "ITL" in rec["why"]


def test_best_split_for_a_budget_and_its_integer_loss():
    slo = Slo(ttft_s=1.0, itl_s=0.05)
    b = plan.best_split(CAP, LOAD, slo, 3)
    rates = {r["split"]: r["max_rate"] for r in b["splits"]}
    assert set(rates) == {"1:2", "2:1"}
    assert b["best"] == "2:1"
    # 2 prefill workers are the bottleneck: rho < 1 needs rate < 20, the TTFT bound a bit less.
    assert 15 < rates["2:1"] < 20
    # 1 prefill worker: rho < 1 needs rate < 10.
    assert rates["1:2"] < 10
    assert b["fractional_max_rate"] >= b["best_max_rate"]
    assert b["integer_loss"] == pytest.approx(1 - b["best_max_rate"] / b["fractional_max_rate"])
    with pytest.raises(InvalidArgument):
        plan.best_split(CAP, LOAD, slo, 1)


def test_workload_and_capacity_reject_bad_input():
    with pytest.raises(InvalidArgument, match="rate"):
        Workload(0.0, (1,), (1,))
    with pytest.raises(InvalidArgument, match="same"):
        Workload(1.0, (1, 2), (1,))
    with pytest.raises(InvalidArgument, match="prefill_s_per_token"):
        Capacity(0.0, -1.0, 0.01, 0.001)
    with pytest.raises(InvalidArgument, match="max_decode_batch"):
        Capacity(0.0, 0.001, 0.01, 0.001, max_decode_batch=0)
    with pytest.raises(InvalidArgument, match="capacity record"):
        Capacity.from_dict({"prefill_fixed_s": 1})
    assert Capacity.from_dict(CAP.to_dict()) == CAP
    with pytest.raises(InvalidArgument):
        plan.predict(CAP, LOAD, Slo(1.0, 0.05), 0, 1)


def test_slo_batch_and_capacities():
    assert CAP.slo_batch(0.05) == 40
    assert CAP.decode_tok_s(0.05) == pytest.approx(40 / 0.05)
    assert CAP.slo_batch(0.0105) == 0 and CAP.decode_tok_s(0.0105) == 0.0
    assert CAP.slo_batch(10.0) == 64  # capped by the batch limit


def test_fit_line():
    assert fit_line([1, 2, 4], [3, 5, 9]) == pytest.approx((1.0, 2.0))
    assert fit_line([4], [2.0]) == (2.0, 0.0)  # one point: all fixed
    a, b = fit_line([1, 2, 3], [3, 2, 1])      # a decreasing fit is clamped to flat
    assert b == 0.0 and a == pytest.approx(2.0)
    a, b = fit_line([1, 2], [1, 5])            # a negative intercept: through the origin
    assert a == 0.0 and b == pytest.approx(11 / 5)


def _row(split, workers, frac, meets, util=(0.5, 0.5)):
    return {"split": split, "workers": workers, "measured": {"goodput_fraction": frac},
            "predicted": {"meets_slo": meets, "prefill": {"utilisation": util[0]},
                          "decode": {"utilisation": util[1]}}}


def test_sweep_picks():
    rows = [_row("1:1", 2, 0.5, False), _row("1:2", 3, 0.95, True, (0.9, 0.3)), _row("2:1", 3, 0.99, True, (0.45, 0.6))]
    assert pick_measured(rows) == "2:1"   # fewest workers meeting 90%, then the higher goodput
    assert pick_predicted(rows) == "2:1"  # fewest workers predicted to meet it, then the lower worst utilisation
    rows = [_row("1:1", 2, 0.5, False), _row("2:1", 3, 0.7, False)]
    assert pick_measured(rows) == "2:1" and pick_predicted(rows) is None
    assert pick_measured([_row("1:1", 2, 0.0, True)]) is None
    assert parse_splits("1:1, 1:2,2:1") == [(1, 1), (1, 2), (2, 1)]
    for bad in ("1", "0:1", "a:b", "1:1:1"):
        with pytest.raises(InvalidArgument):
            parse_splits(bad)


# ---------------------------------------------------------------------------- re-roling policy

def test_rerole_decide_moves_only_beyond_rounding():
    from pdkv.serving.rerole import decide

    # 4 workers, measured need 1 : 1 -> ideal 2 prefill.
    assert decide(1.0, 1.0, 2, 2, 0.25) is None
    assert decide(1.0, 1.0, 1, 3, 0.25) == "prefill"   # ideal 2 is 1.0 above 1
    assert decide(1.0, 1.0, 3, 1, 0.25) == "decode"    # ideal 2 is 1.0 below 3
    assert decide(1.0, 1.0, 3, 2, 0.25) is None        # ideal 2.5: 0.5 away, rounding only
    assert decide(3.0, 1.0, 1, 3, 0.25) == "prefill"   # ideal 3
    assert decide(1.0, 3.0, 3, 1, 0.25) == "decode"    # ideal 1
    assert decide(1.0, 0.0, 1, 1, 0.0) is None         # the decode pool keeps its last worker
    assert decide(0.0, 1.0, 1, 1, 0.0) is None         # and the prefill pool too
    assert decide(0.0, 0.0, 1, 3, 0.0) is None         # no load measured
    # 1.3 : 0.7 of 2 workers -> ideal 1.3 prefill: 0.3 off, nothing moves even without hysteresis.
    assert decide(1.3, 0.7, 1, 1, 0.0) is None


def test_rerole_demand_window_and_policy():
    from pdkv.serving.rerole import DemandWindow, RerolePolicy

    pol = RerolePolicy(prefill_fixed_s=0.01, prefill_s_per_token=0.001, decode_tok_s=100.0, window_s=10.0)
    win = DemandWindow(pol)
    for t in range(10):
        win.prefill(90, now=float(t))      # 0.1 s of prefill each second
        win.decode_tokens(50, now=float(t))  # 50 tokens/s: half a decode worker
    pre, dec, n = win.needs(now=9.5)
    assert (pre, dec, n) == (pytest.approx(0.1), pytest.approx(0.5), 10)
    pre, dec, n = win.needs(now=15.0)  # the first five seconds left the window
    assert (pre, dec, n) == (pytest.approx(0.05), pytest.approx(0.25), 5)
    for bad in (dict(decode_tok_s=0.0), dict(interval_s=-1.0), dict(min_requests=0),
                dict(prefill_s_per_token=math.nan)):
        with pytest.raises(InvalidArgument):
            RerolePolicy(**{**dict(prefill_fixed_s=0.0, prefill_s_per_token=0.001, decode_tok_s=1.0), **bad})


def test_rerole_policy_from_a_plan_file(tmp_path):
    from pdkv.serving.rerole import RerolePolicy

    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"capacity": CAP.to_dict(), "slo": {"ttft_s": 1.0, "itl_s": 0.05}}))
    pol = RerolePolicy.from_plan(f, interval_s=1.0)
    assert pol.prefill_s_per_token == 0.001 and pol.decode_tok_s == pytest.approx(800.0) and pol.interval_s == 1.0
    f.write_text(json.dumps({"capacity": CAP.to_dict(), "slo": {"ttft_s": 1.0, "itl_s": 0.001}}))
    with pytest.raises(InvalidArgument, match="ITL"):
        RerolePolicy.from_plan(f)
    f.write_text("{}")
    with pytest.raises(InvalidArgument, match="not a `pdkv plan` result"):
        RerolePolicy.from_plan(f)
