"""`pdkv bench serve --workload multi-turn` against a real disagg deployment of a tiny
model (~20 s on 2 cores; numbers not asserted). With workers that have the prefix cache
(``--prefix-cache``), the cache-on run must reuse KV and answer exactly as the
cache-off run did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")


def _workers_have_prefix_cache() -> bool:
    from pathlib import Path

    from pdkv.serving import cli as serving_cli

    return "--prefix-cache" in Path(serving_cli.__file__).read_text(encoding="utf-8")


@pytest.mark.slow
def test_multi_turn_sessions_end_to_end(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"))
    cache = _workers_have_prefix_cache()
    argv = [sys.executable, "-m", "pdkv.cli", "bench", "serve", "--serve-model", "tiny-4m", "--workload",
            "multi-turn", "--sessions", "2", "--turns", "3", "--think-time", "0.2", "--shared-len", "48",
            "--rates", "4", "--modes", "disagg", "--warmup", "1", "--no-progress", "--no-plots", "--out", str(out)]
    if cache:
        argv += ["--prefix-cache", "both"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == (["disagg-nocache", "disagg"] if cache else ["disagg"])
    for run in runs:
        recs = {(r["session"], r["turn"]): r for r in run["records"]}
        assert len(recs) == 6 and all(r["error"] is None and r["output_token_ids"] for r in recs.values())
        for (s, t), r in recs.items():
            assert len(r["output_token_ids"]) == r["max_tokens"] == r["output_tokens"]
            if t:
                prev = recs[(s, t - 1)]
                assert r["prompt_len"] > prev["prompt_len"] + prev["output_tokens"]  # history + answer + new
                assert r["scheduled_s"] >= prev["end_s"]
        summary = run["summary"]
        assert 0.5 < summary["prefix_hit_rate_max"] < 1  # every later turn repeats its history
        assert summary["kv_bytes"] and summary["kv_bytes_pushed"]
    assert (out / "traces" / "rate-4.json").exists() and "## Prefix reuse" in (out / "report.md").read_text()
    if cache:
        off, on = (r["summary"] for r in runs)
        assert on["outputs_equal"] is True and on["outputs_baseline"] == "disagg-nocache"
        assert on["prefill_tokens"] < off["prefill_tokens"] and on["prefix_hit_rate"] > 0.3
