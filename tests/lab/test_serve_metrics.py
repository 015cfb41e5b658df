"""Metrics against hand-made timelines: TTFT, ITL, TPOT, E2E, throughput and goodput."""

from __future__ import annotations

import doctest
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.lab.serve import metrics as serve_metrics, trace as serve_trace, trace_dist, trace_gen
from pdkv.lab.serve.metrics import (
    SCHEMA,
    SLO,
    BenchResults,
    RequestRecord,
    RunResult,
    Stats,
    error_kind,
    meets_slo,
    summarize,
)

FAST = settings(max_examples=50, deadline=None, derandomize=True, database=None)


def rec(index, send, chunks, end, *, tokens=None, out=None, error=None, scheduled=None):
    """A record sent at ``send`` whose output chunks arrived at ``chunks``."""
    r = RequestRecord(index=index, scheduled_s=send if scheduled is None else scheduled, prompt_len=10, max_tokens=8)
    r.send_s = send
    for i, t in enumerate(chunks):
        r.add_chunk(t, tokens[i] if tokens else 1)
    r.end_s = end
    r.error = error
    r.output_tokens = out if out is not None else sum(r.chunk_tokens)
    return r


# Times are multiples of 1/8 s so that the arithmetic below is exact in binary.
A = rec(0, 1.0, [1.5, 1.625, 1.75, 2.0], 2.0, scheduled=0.875)  # TTFT 0.5, ITL [1/8, 1/8, 1/4]
B = rec(1, 1.25, [], 1.5, error="HTTP 500: boom")
C = rec(2, 2.0, [2.25], 2.5)  # one token: TTFT 0.25, no ITL


def test_single_request_quantities():
    assert A.ok and A.ttft_s == 0.5
    assert A.itls_s == [0.125, 0.125, 0.25]
    assert A.e2e_s == 1.0
    assert A.tpot_s == pytest.approx(0.5 / 3)
    assert A.lag_s == 0.125
    assert C.ok and C.itls_s == [] and C.tpot_s is None and C.ttft_s == 0.25
    assert not B.ok and B.ttft_s is None and B.e2e_s == 0.25


def test_multi_token_chunks_use_reported_count_for_tpot():
    r = rec(0, 0.0, [0.5, 1.0, 1.5], 1.5, tokens=[1, 3, 3], out=7)
    assert r.tpot_s == pytest.approx(1.0 / 6)  # (last - first) / (7 - 1)


def test_itl_is_per_token_when_chunks_carry_several():
    # A chunk of k tokens after a gap g gives k samples g/k; extra first-chunk tokens give 0.
    r = rec(0, 0.0, [0.5, 1.0, 1.5], 1.5, tokens=[2, 4, 1])
    assert r.itls_s == [0.0, 0.125, 0.125, 0.125, 0.125, 0.5]
    assert len(r.itls_s) == r.output_tokens - 1
    assert sum(r.itls_s) / len(r.itls_s) == pytest.approx(r.tpot_s)  # mean ITL == TPOT
    # p90 of its own per-token ITLs is 0.3125 (the old per-chunk gaps [0.5, 0.5] would give 0.5).
    assert meets_slo(r, SLO(ttft_s=1.0, itl_s=0.32)) and not meets_slo(r, SLO(ttft_s=1.0, itl_s=0.3))


@FAST
@given(k=st.lists(st.integers(1, 6), min_size=1, max_size=20), gap=st.floats(0.001, 1.0))
def test_per_token_itl_count_equals_output_tokens_minus_one(k, gap):
    r = rec(0, 0.0, [0.1 + i * gap for i in range(len(k))], 0.1 + len(k) * gap, tokens=k)
    r.usage_per_chunk = True
    assert len(r.itls_s) == sum(k) - 1 == r.output_tokens - 1
    assert sum(r.itls_s) == pytest.approx(r.chunk_times_s[-1] - r.chunk_times_s[0], abs=1e-9)
    s = summarize([r], SLO(1.0, 1.0))
    assert s.itl.count == r.output_tokens - 1 and s.itl_per_token
    back = RequestRecord.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.usage_per_chunk and back.itls_s == pytest.approx(r.itls_s, abs=1e-5)


def test_itl_per_token_flag_needs_every_request():
    per_token = rec(0, 0.0, [0.5, 1.0], 1.0, tokens=[2, 2])
    per_token.usage_per_chunk = True
    per_chunk = rec(1, 0.0, [0.5, 1.0], 1.0)
    assert summarize([per_token], SLO(1, 1)).itl_per_token
    assert not summarize([per_token, per_chunk], SLO(1, 1)).itl_per_token
    assert not summarize([B], SLO(1, 1)).itl_per_token  # nothing measured
    assert summarize([per_token], SLO(1, 1)).to_dict()["itl_per_token"] is True
    old = per_chunk.to_dict()
    del old["usage_per_chunk"]  # results written before the field existed: per chunk
    assert not RequestRecord.from_dict(old).usage_per_chunk


def test_meets_slo_exact_boundaries():
    # p90 of A's gaps [1/8, 1/8, 1/4] with linear interpolation: 1/8 + 0.8 * 1/8 = 0.225.
    assert meets_slo(A, SLO(ttft_s=0.5, itl_s=0.225))  # boundaries are inclusive
    assert not meets_slo(A, SLO(ttft_s=0.5, itl_s=0.2))
    assert not meets_slo(A, SLO(ttft_s=0.49, itl_s=1.0))
    assert meets_slo(A, SLO(ttft_s=0.5, itl_s=0.125, itl_percentile=50))
    assert not meets_slo(A, SLO(ttft_s=0.5, itl_s=0.24, itl_percentile=100))  # max gap 0.25
    assert meets_slo(C, SLO(ttft_s=0.25, itl_s=1e-9))  # no gaps: ITL part holds
    assert not meets_slo(B, SLO(ttft_s=100, itl_s=100))  # failures are never good


def test_summary_of_hand_made_run():
    slo = SLO(ttft_s=0.5, itl_s=0.25)
    s = summarize([A, B, C], slo)
    assert (s.num_requests, s.num_ok, s.num_errors) == (3, 2, 1)
    assert s.errors == {"HTTP 500": 1}
    assert s.duration_s == 1.5  # first send 1.0 -> last event 2.5
    assert s.ttft.count == 2 and s.ttft.mean == 0.375 and s.ttft.max == 0.5
    assert s.ttft.p50 == 0.375
    assert s.ttft.p90 == pytest.approx(0.475, rel=1e-12)  # 0.25 + 0.9 * 0.25
    assert s.itl.count == 3 and s.itl.p50 == 0.125 and s.itl.max == 0.25
    assert s.itl.p90 == pytest.approx(0.225, rel=1e-12)
    assert s.itl.p99 == pytest.approx(0.2475, rel=1e-12)  # 0.125 + 0.98 * 0.125
    assert s.e2e.p50 == 0.75 and s.e2e.max == 1.0
    assert s.output_tokens == 5
    assert s.output_tok_s == pytest.approx(5 / 1.5)
    assert s.req_s == pytest.approx(2 / 1.5)
    assert s.num_good == 2 and s.goodput_fraction == pytest.approx(2 / 3)
    assert s.goodput_rate == pytest.approx(2 / 1.5)
    assert s.lag.max == 0.125
    tight = summarize([A, B, C], SLO(ttft_s=0.4, itl_s=0.25))
    assert tight.num_good == 1 and tight.goodput_fraction == pytest.approx(1 / 3)
    json.dumps(s.to_dict(), allow_nan=False)


def test_empty_and_all_failed_runs_are_json_safe():
    s = summarize([], SLO(1, 1))
    assert s.num_requests == 0 and s.duration_s == 0 and s.goodput_fraction is None and s.ttft == Stats.of([])
    json.dumps(s.to_dict(), allow_nan=False)
    never = RequestRecord(index=0, scheduled_s=0.0, error="ConnectionError: refused")
    s = summarize([never, B], SLO(1, 1))
    assert s.num_ok == 0 and s.errors == {"ConnectionError": 1, "HTTP 500": 1}
    assert s.ttft.p50 is None and s.goodput_fraction == 0.0
    json.dumps(s.to_dict(), allow_nan=False)


def test_incomplete_record_counts_as_failure():
    r = rec(0, 0.0, [0.5], None)  # never ended, no error text
    assert not r.ok
    assert summarize([r], SLO(1, 1)).errors == {"Incomplete": 1}


def test_stats_and_error_kind():
    s = Stats.of([1.0, 2.0, 3.0, 4.0])
    assert (s.p50, s.max, s.mean) == (2.5, 4.0, 2.5)
    assert s.percentile("p50") == 2.5
    with pytest.raises(ValueError):
        s.percentile("p75")
    assert Stats.from_dict(s.to_dict()) == s
    assert error_kind("HTTP 503: overloaded: retry") == "HTTP 503"
    assert error_kind("Timeout") == "Timeout"


def test_slo_validation_and_description():
    with pytest.raises(ValueError):
        SLO(0, 1)
    with pytest.raises(ValueError):
        SLO(1, 1, itl_percentile=101)
    assert SLO(2.0, 0.1).describe() == "TTFT <= 2 s and p90 ITL <= 100 ms"
    assert SLO.from_dict(SLO(1, 0.05, 99).to_dict()) == SLO(1, 0.05, 99)


def test_results_round_trip(tmp_path):
    runs = [RunResult("disagg", 0.5, [A, B], pd_ratio="1:1", config={"cores": 2}), RunResult("chunked", 0.5, [C])]
    res = BenchResults(runs, SLO(0.5, 0.25), {"command": "x"})
    path = tmp_path / "r.json"
    res.save(path)
    d = json.loads(path.read_text())
    assert d["schema"] == SCHEMA and d["runs"][0]["summary"]["num_good"] == 1
    back = BenchResults.load(path)
    assert back.slo == res.slo and back.meta == res.meta
    assert [r.records for r in back.runs] == [r.records for r in runs]
    assert back.runs[0].candidate == "disagg 1:1" and back.runs[1].candidate == "chunked"
    with pytest.raises(ValueError, match="schema"):
        BenchResults.from_dict({**d, "schema": "other/9"})


timelines = st.lists(st.floats(0.0, 5.0), min_size=0, max_size=30).map(lambda xs: sorted(xs))


@FAST
@given(send=st.floats(0, 10), rel=timelines, ttft=st.floats(0.01, 3), itl=st.floats(0.001, 1), pct=st.floats(0, 100))
def test_properties_of_random_timelines(send, rel, ttft, itl, pct):
    chunks = [send + 0.001 + t for t in rel]
    r = rec(0, send, chunks, (chunks[-1] if chunks else send) + 0.01)
    gaps = r.itls_s
    assert len(gaps) == max(len(chunks) - 1, 0)
    assert all(g >= 0 for g in gaps)
    if chunks:
        assert sum(gaps) == pytest.approx(chunks[-1] - chunks[0], abs=1e-9)
    slo = SLO(ttft, itl, pct)
    # A looser SLO never turns a good request bad.
    if meets_slo(r, slo):
        assert meets_slo(r, SLO(ttft * 2, itl * 2, pct))
        assert meets_slo(r, SLO(ttft, itl, max(pct - 10, 0)))
    expected = bool(chunks) and r.ttft_s <= ttft and (not gaps or np.percentile(gaps, pct) <= itl)
    assert meets_slo(r, slo) == expected
    back = RequestRecord.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.chunk_times_s == pytest.approx(r.chunk_times_s, abs=5e-7)  # stored to the microsecond
    assert (back.send_s, back.end_s) == pytest.approx((r.send_s, r.end_s), abs=5e-7)
    assert back.chunk_tokens == r.chunk_tokens and back.output_tokens == r.output_tokens


@pytest.mark.parametrize("mod", [serve_metrics, serve_trace, trace_dist, trace_gen], ids=lambda m: m.__name__)
def test_docstring_examples(mod):
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
