"""`pdkv bench serve --compare-stream`: layer-wise streaming vs one write in one run.

The comparison's arithmetic on hand-made records, the client collecting token ids,
and a tiny end-to-end run of both modes (timings are never asserted: only that both
modes ran, every request succeeded and the outputs agree token for token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdkv.lab.serve.metrics import SLO, BenchResults, RequestRecord, RunResult
from pdkv.lab.serve.stream import MONOLITHIC, STREAMED, compare, markdown


def _rec(index: int, ttft: float, t2t: float, ids: list[int] | None) -> RequestRecord:
    times = [ttft, t2t] + [t2t + 0.01 * k for k in range(1, len(ids or [0, 0]) - 1)]
    return RequestRecord(index, 0.0, prompt_len=8, max_tokens=len(times), send_s=0.0, chunk_times_s=times,
                         chunk_tokens=[1] * len(times), end_s=times[-1], output_tokens=len(times),
                         output_token_ids=ids)


def _results(monolithic_ids: list[int]) -> BenchResults:
    streamed = [_rec(0, 0.10, 0.12, [5, 6, 7]), _rec(1, 0.20, 0.22, [8, 9, 10])]
    mono = [_rec(0, 0.10, 0.30, [5, 6, 7]), _rec(1, 0.20, 0.42, monolithic_ids)]
    return BenchResults([RunResult(STREAMED, 1.0, streamed, "1:1"), RunResult(MONOLITHIC, 1.0, mono, "1:1")],
                        SLO(ttft_s=1.0, itl_s=1.0), {"deployment": {"link": None}})


def test_t2t_is_the_second_token_or_a_first_chunk_of_two():
    assert _rec(0, 0.1, 0.25, [1, 2]).t2t_s == pytest.approx(0.25)
    two_in_one = RequestRecord(0, 0.0, send_s=1.0, chunk_times_s=[1.5, 1.7], chunk_tokens=[2, 1], end_s=1.7)
    assert two_in_one.t2t_s == pytest.approx(0.5)
    one = RequestRecord(0, 0.0, send_s=0.0, chunk_times_s=[0.5], chunk_tokens=[1], end_s=0.5)
    assert one.t2t_s is None
    back = RequestRecord.from_dict(_rec(3, 0.1, 0.2, [4, 5]).to_dict())
    assert back.output_token_ids == [4, 5] and back.t2t_s == pytest.approx(0.2)


def test_comparison_ratios_and_equal_outputs():
    c = compare(_results([8, 9, 10]))
    assert c is not None and c["all_ok"] and c["outputs_equal"]
    (r,) = c["rates"]
    assert r["outputs"] == {"compared": 2, "differ": [], "without_token_ids": 0, "equal": True}
    assert r["ratio"]["ttft_p50"] == pytest.approx(1.0)
    assert r["ratio"]["t2t_p50"] == pytest.approx(0.17 / 0.36)
    assert r["t2t_saved_s"]["p50"] == pytest.approx((0.18 + 0.20) / 2)
    text = markdown(c)
    assert "| 1 | disagg | 2/2 |" in text and "| yes (2 requests) |" in text


def test_comparison_names_requests_whose_outputs_differ():
    c = compare(_results([8, 9, 11]))
    assert c is not None and not c["outputs_equal"]
    assert c["rates"][0]["outputs"]["differ"] == [1]
    assert "NO (1 differ" in markdown(c)


def test_comparison_needs_both_modes():
    res = _results([8, 9, 10])
    res.runs = [r for r in res.runs if r.mode == STREAMED]
    assert compare(res) is None


def test_client_collects_token_ids():
    from pdkv.lab.serve.client import _StreamState

    rec = RequestRecord(0, 0.0)
    st = _StreamState(rec)
    st.handle(json.dumps({"choices": [{"text": "", "token_ids": [7], "finish_reason": None}]}), 1.0)
    st.handle(json.dumps({"choices": [{"text": "b", "token_ids": [8, 9], "finish_reason": "length"}]}), 2.0)
    st.handle("[DONE]", 2.1)
    assert rec.output_token_ids == [7, 8, 9]
    assert rec.chunk_times_s == [1.0, 2.0]  # a chunk of token ids without text still carries output


@pytest.mark.slow
def test_compare_stream_end_to_end(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("aiohttp")
    out = tmp_path / "report"
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "serve", "--compare-stream", "--serve-model", "tiny-4m",
         "--prompt-len", "80", "--output-len", "6", "--rates", "4", "--num-requests", "4", "--warmup", "1",
         "--no-progress", "--no-plots", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert {r["mode"] for r in data["runs"]} == {STREAMED, MONOLITHIC}
    c = json.loads((out / "stream_comparison.json").read_text())
    assert c == data["meta"]["stream_comparison"]
    (r,) = c["rates"]
    for mode in (STREAMED, MONOLITHIC):
        assert r[mode]["requests"] == 4 and r[mode]["ok"] == 4, mode
        assert r[mode]["t2t_s"]["count"] == 4 and r[mode]["output_tokens"] == 4 * 6
    assert r["outputs"] == {"compared": 4, "differ": [], "without_token_ids": 0, "equal": True}
    assert c["all_ok"] and c["outputs_equal"]
    assert "Layer-wise streaming vs one write" in (out / "report.md").read_text()


def test_stream_report_says_down_to_which_link_the_target_holds():
    from pdkv.lab.serve.stream_report import min_link_bps, per_layer_s, where_target_stops

    r = {"preset": "m", "prompt_len": 1024, "link_name": "100mbit", "layers": 10, "kv_bytes": 100_000_000,
         "streamed": {"prefill_s": 9.0}, "monolithic": {"transfer_only_s": 8.0}, "target_met": True}
    # The whole transfer may take prefill / 0.9 = 10 s: 1e8 bytes in 10 s = 80 Mbit/s.
    assert min_link_bps(r) == pytest.approx(80e6)
    assert per_layer_s(r) == pytest.approx((0.8, 0.9))
    text = where_target_stops([r])
    assert "80 Mbit/s" in text and "compute-bound" in text and "met" in text


def test_compare_stream_refuses_a_url():
    from pdkv.lab.serve.modes import main

    with pytest.raises(SystemExit) as e:
        main(["--compare-stream", "--url", "http://127.0.0.1:1"])
    assert e.value.code == 2
