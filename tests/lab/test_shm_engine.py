"""`python -m pdkv.lab.transfer.shm_engine`: runs end to end, verifies what it moved, and
reports the connector's pull against pdkv bench transfer's measurement (a smoke test
of the benchmark's plumbing, not a speed test)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ENV = {**os.environ, "PDKV_LOG": "error"}


def test_shm_engine_vllm_json():
    p = subprocess.run([sys.executable, "-m", "pdkv.lab.transfer.shm_engine", "--vllm", "--json", "--pool-mib", "8",
                        "--rounds", "1", "--reps", "3"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert set(out["pools"]) == {"alloc", "engine", "engine-cma"}
    for name in ("vllm", "vllm-cma"):
        r = out["vllm_pull"][name]
        assert r["bytes"] == 1 << 20
        us = r["us"]
        for key in ("bench transfer: prepared post, default ShmOptions, waited",
                    "prepared post, default ShmOptions, polled",
                    "connector pull as deployed: default ShmOptions + notify_on_send, polled",
                    "prepared post, copy in the posting thread"):
            assert us[key] > 0, key
        want = us["connector pull as deployed: default ShmOptions + notify_on_send, polled"] / \
            us["bench transfer: prepared post, default ShmOptions, waited"]
        assert r["connector_vs_bench_transfer"] == pytest.approx(want, rel=0.02, abs=0.01)  # from rounded us
