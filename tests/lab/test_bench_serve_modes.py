"""`pdkv bench serve` launching every serving mode on a tiny model (numbers not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")


@pytest.mark.slow
def test_every_mode_end_to_end(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "serve", "--serve-model", "tiny-4m", "--preset", "chat-short",
         "--rates", "2", "--duration", "3", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert {r["mode"] for r in runs} == {"colocated", "chunked", "disagg", "hybrid"}
    for r in runs:
        recs = r["records"]
        assert recs and all(rec.get("error") in (None, "") for rec in recs), r["mode"]
    for f in ("report.md", "itl_cdf.png", "rate_sweep.png"):
        assert (out / f).stat().st_size > 0
    assert "Recommended" in res.stdout or "not clearly better" in res.stdout
