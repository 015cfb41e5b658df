"""`pdkv bench serve --compare-compress`: KV compression vs plain in one run.

The comparison's arithmetic on hand-made records (ratios compressed / plain, lossless
outputs must equal plain's, fp8's may differ), the modes and prefill flags it starts,
its refusals, and a tiny end-to-end run (timings are never asserted: only that every
mode ran, every request succeeded and lossless answered token for token like plain;
``-m slow``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdkv.lab.serve import compress as sc
from pdkv.lab.serve.metrics import SLO, BenchResults, RequestRecord, RunResult

LOSSLESS, FP8 = sc.mode_name("lossless"), sc.mode_name("fp8")


def _rec(index: int, ttft: float, t2t: float, ids: list[int]) -> RequestRecord:
    times = [ttft, t2t] + [t2t + 0.01 * k for k in range(1, len(ids) - 1)]
    return RequestRecord(index, 0.0, prompt_len=8, max_tokens=len(times), send_s=0.0, chunk_times_s=times,
                         chunk_tokens=[1] * len(times), end_s=times[-1], output_tokens=len(times),
                         output_token_ids=ids)


def _results(lossless_ids: list[int]) -> BenchResults:
    plain = [_rec(0, 0.10, 0.50, [5, 6, 7]), _rec(1, 0.20, 0.80, [8, 9, 10])]
    lossless = [_rec(0, 0.10, 0.40, [5, 6, 7]), _rec(1, 0.20, 0.60, lossless_ids)]
    fp8 = [_rec(0, 0.10, 0.30, [5, 6, 7]), _rec(1, 0.20, 0.40, [8, 9, 12])]
    return BenchResults([RunResult(sc.PLAIN, 1.0, plain, "1:1"), RunResult(LOSSLESS, 1.0, lossless, "1:1"),
                         RunResult(FP8, 1.0, fp8, "1:1")], SLO(ttft_s=1.0, itl_s=1.0), {"deployment": {"link": None}})


def test_each_compressed_mode_is_compared_with_plain():
    c = sc.compare(_results([8, 9, 10]))
    assert c is not None and c["all_ok"] and c["lossless_outputs_equal"] is True
    assert [(p["variant"], p["baseline"]) for p in c["pairs"]] == [(LOSSLESS, sc.PLAIN), (FP8, sc.PLAIN)]
    lossless, fp8 = c["pairs"]
    (r,) = lossless["rates"]
    assert r["ratio"]["ttft_p50"] == pytest.approx(1.0)
    assert r["ratio"]["t2t_p50"] == pytest.approx(0.50 / 0.65)
    assert r["ratio"]["kv_wait_p50"] == pytest.approx(0.35 / 0.50)
    assert r["t2t_saved_s"]["p50"] == pytest.approx((0.10 + 0.20) / 2)
    assert r["outputs"]["equal"]
    assert fp8["rates"][0]["outputs"]["differ"] == [1]  # lossy: counted, not an error
    text = sc.markdown(c)
    assert f"### {LOSSLESS} vs {sc.PLAIN}" in text and f"### {FP8} vs {sc.PLAIN}" in text
    assert "| yes (2 requests) |" in text and "NO (1 differ" in text and "that is a bug" not in text


def test_wire_bytes_come_from_the_prefill_workers_metrics():
    pytest.importorskip("prometheus_client")
    from pdkv.serving.metrics import Registry

    r = Registry()
    kv = r.counter("pdkv_kv_transfer_bytes_total", "KV bytes.", ("transport",))
    wire = r.counter("pdkv_kv_wire_bytes_total", "Wire bytes.", ("transport", "codec"))
    kv.inc(("tcp",), 3000.0)
    wire.inc(("tcp", "zstd"), 1500.0)
    wire.inc(("tcp", "none"), 500.0)
    got = sc.parse_kv_wire(r.render())
    assert got == {"kv_bytes": 3000.0, "wire_bytes": {"zstd": 1500.0, "none": 500.0}}
    assert sc.wire_summary(got) == {"ratio": 1.5, "codecs": {"none": 0.25, "zstd": 0.75}}
    assert sc.wire_summary(None) is None and sc.wire_summary({"kv_bytes": 0, "wire_bytes": {}}) is None
    res = _results([8, 9, 10])
    for run in res.runs:
        run.config["kv_wire"] = got if run.mode == LOSSLESS else None
    c = sc.compare(res)
    assert c["pairs"][0]["wire"] == {LOSSLESS: sc.wire_summary(got), sc.PLAIN: None}
    assert f"{LOSSLESS} 1.50x (none 25%, zstd 75%)" in sc.markdown(c)


def test_lossless_outputs_that_differ_are_flagged():
    c = sc.compare(_results([8, 9, 11]))
    assert c is not None and c["lossless_outputs_equal"] is False
    assert "**Lossless outputs differ from plain**" in sc.markdown(c)


def test_comparison_needs_plain_and_a_compressed_mode():
    res = _results([8, 9, 10])
    res.runs = [r for r in res.runs if r.mode != sc.PLAIN]
    assert sc.compare(res) is None


def test_modes_and_the_prefill_flags_they_start():
    assert sc.parse_modes("fp8, lossless,fp8") == ["fp8", "lossless"]
    assert sc.modes_for(["lossless", "auto"]) == [sc.PLAIN, LOSSLESS, "disagg-auto"]
    assert sc.prefill_args(sc.PLAIN) == ["--transports", "tcp"]
    assert sc.prefill_args(FP8) == ["--transports", "tcp", "--compress", "fp8"]
    assert sc.prefill_args("disagg") is None and sc.prefill_args("disagg-gzip") is None
    with pytest.raises(ValueError, match="gzip"):
        sc.parse_modes("lossless,gzip")


def test_a_compressed_mode_deploys_disagg_with_the_compress_flags(tmp_path):
    import argparse

    from pdkv.lab.serve.modes import deployment_for

    args = argparse.Namespace(pd="1:1", worker_arg=[], replicas=None, max_batch_tokens=128, hybrid_threshold=None,
                              pin=False)
    dep, pd = deployment_for(FP8, tmp_path, args, None)
    assert pd == "1:1" and dep.mode == "disagg"
    assert dep.prefill_args == ["--transports", "tcp", "--compress", "fp8"]


@pytest.mark.parametrize("argv, what", [
    (["--compare-compress", "lossless", "--url", "http://127.0.0.1:1"], "url"),
    (["--compare-compress", "lossless", "--compare-stream"], "separate runs"),
])
def test_compare_compress_refusals(argv, what, capsys):
    from pdkv.lab.serve.modes import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err


def test_compare_compress_names_an_unknown_mode(capsys):
    from pdkv.lab.serve.modes import main

    assert main(["--compare-compress", "gzip"]) == 2
    assert "gzip" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_compress_end_to_end(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("aiohttp")
    out = tmp_path / "report"
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "serve", "--compare-compress", "lossless,fp8",
         "--serve-model", "tiny-4m", "--prompt-len", "80", "--output-len", "6", "--rates", "4",
         "--num-requests", "4", "--warmup", "1", "--no-progress", "--no-plots", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert {r["mode"] for r in data["runs"]} == {sc.PLAIN, LOSSLESS, FP8}
    c = json.loads((out / "compress_comparison.json").read_text())
    assert c == data["meta"]["compress_comparison"]
    assert c["all_ok"] and c["lossless_outputs_equal"] is True
    for pair in c["pairs"]:
        (r,) = pair["rates"]
        for mode in (pair["variant"], sc.PLAIN):
            assert r[mode]["requests"] == 4 and r[mode]["ok"] == 4, mode
            assert r[mode]["output_tokens"] == 4 * 6
    assert "KV compression vs plain" in (out / "report.md").read_text()
