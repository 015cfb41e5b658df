"""`pdkv bench transfer --hetero` end to end at small payloads: the JSON fields, the
bit-exact verification (and that it can fail), and argument errors. Numbers are not
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

import pdkv
from pdkv.lab.transfer import hetero
from pdkv.errors import InvalidArgument

TRANSPORTS = [t for t in ("tcp", "shm") if t in pdkv.available_transports()]


def run_hetero(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, UCX_NET_DEVICES="lo", PDKV_LOG="error")
    return subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--iters", "2",
                           "--hetero-request-tokens", "256", "--json", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def rows_of(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("spec,model,feeds", [
    ("tp2:tp4", "llama-3-8b", [0]),
    ("tp4:tp2,nhd:hnd", "llama-3-8b", [0, 1]),
    ("bs16:bs32", "llama-3-70b-tp8", [0]),
    ("hnd:nhd,bs32:bs16,tp8:tp4", "llama-3-70b-tp8", [0, 1]),
    ("tp4:tp8", "llama-3-70b-tp8", [0]),
])
def test_hetero_json(transport, spec, model, feeds, mode):
    (r,) = rows_of(run_hetero("--transport", transport, "--model", model, "--hetero", spec, "--payload", "2M",
                              "--hetero-mode", mode))
    assert r["transport"] == transport and r["hetero"] == spec and r["model"] == model and r["mode"] == mode
    assert r["verified"] is True
    assert [p["prefill_rank"] for p in r["transfers"]] == feeds
    assert r["gbps"] > 0 and r["homogeneous_gbps"] > 0
    assert r["ratios"] == {"homogeneous": pytest.approx(r["gbps"] / r["homogeneous_gbps"])}
    # CPU seconds per GB, initiator + target, of both transfers, and the ratio.
    assert r["cpu_s_per_gb"] > 0 and r["homogeneous_cpu_s_per_gb"] > 0
    assert r["ratios_cpu"] == {"homogeneous": pytest.approx(r["cpu_s_per_gb"] / r["homogeneous_cpu_s_per_gb"])}
    split = r["cpu_s_per_gb_by_process"]
    assert sum(split["hetero"].values()) == pytest.approx(r["cpu_s_per_gb"])
    assert set(split["homogeneous"]) == {"initiator", "target"}
    assert set(r["extents"]) == set(r["prepare_ms"]) == {"hetero", "homogeneous"}
    assert r["prepare_request"]["tokens"] == 256 and r["prepare_request"]["hetero_ms"] > 0
    assert r["prepare_request"]["transport"] == ("shm" if transport == "shm" else "tcp")  # planned as the run's
    dec = r["decode"]
    assert r["payload_bytes"] == r["tokens"] // dec["block_tokens"] * dec["block_half_bytes"] * {
        "llama-3-8b": 64, "llama-3-70b-tp8": 160}[model]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_hetero_verification_can_fail(mode):
    """A deliberately wrong reference must fail the check: the comparison is real."""
    (r,) = rows_of(run_hetero("--hetero", "tp4:tp2", "--payload", "1M", "--corrupt-reference", "--hetero-mode", mode))
    assert r["verified"] is False


@pytest.mark.parametrize("args,message", [
    (["--hetero", "tp3:tp4"], "8 kv heads do not split evenly over prefill_tp=3"),
    (["--hetero", "tp2:tp4,tp4:tp2"], "names tp twice"),
    (["--hetero", "fp8:bf16"], "not understood"),
    (["--hetero", "bs0:bs16"], "sizes must be positive"),
    (["--hetero", "tp2:tp4", "--model", "gpt-5"], "unknown model preset"),
    (["--hetero", "tp2:tp4", "--memory", "cuda"], "host memory"),
    (["--hetero", "tp2:tp4", "--hetero-mode", "both"], "invalid choice: 'both'"),
])
def test_hetero_rejects_bad_arguments(args, message):
    out = run_hetero(*args, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


def test_spec_parsing_keeps_preset_defaults():
    s = hetero.parse_spec("nhd:hnd", "llama-3-70b-tp8")
    assert (s.prefill_tp, s.decode_tp, s.src_block_tokens, s.dst_block_tokens, s.src_order, s.dst_order) == \
        (8, 8, 16, 16, "NHD", "HND")
    s = hetero.parse_spec(" TP2:TP4 , bs16:bs32", "llama-3-8b")
    assert (s.prefill_tp, s.decode_tp, s.src_block_tokens, s.dst_block_tokens, s.text) == \
        (2, 4, 16, 32, "TP2:TP4,bs16:bs32")
    with pytest.raises(InvalidArgument, match="at least one item"):
        hetero.parse_spec(" , ", "llama-3-8b")
    plan = hetero.Plan(hetero.parse_spec("tp4:tp2", "llama-3-70b-tp8"), "llama-3-70b-tp8")
    assert plan.dst_geometry(1).kv_heads == 4 and plan.src_geometry(1, 1).kv_heads == 2


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_hetero_against_a_served_target(mode):
    """--serve --hetero on one side, --target on the other (as across hosts); a target
    started for another spec is refused with both geometries named."""
    env = dict(os.environ, PDKV_LOG="error")
    errors = tempfile.TemporaryFile(mode="w+")
    serve = subprocess.Popen([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--serve", "--hetero", "tp4:tp2",
                              "--hetero-mode", mode, "--listen", "127.0.0.1:0", "--blocks", "8"],
                             stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    try:
        line = serve.stdout.readline()
        if not line.startswith("{"):  # the target did not start: show why
            serve.wait(30)
            errors.seek(0)
            pytest.fail(f"the --serve target printed {line!r} (exit {serve.returncode}); stderr:\n{errors.read()[-3000:]}")
        address = json.loads(line)["address"]
        (r,) = rows_of(run_hetero("--target", address, "--hetero", "tp4:tp2", "--hetero-mode", mode,
                                  "--payload", "2M"))
        assert r["verified"] is True and r["mode"] == mode
        # A target on "another host": its CPU cannot be read, so no total, only the initiator's share.
        assert r["cpu_s_per_gb"] is None and r["ratios_cpu"] == {"homogeneous": None}
        assert r["cpu_s_per_gb_by_process"]["hetero"]["initiator"] > 0
        out = run_hetero("--target", address, "--hetero", "tp2:tp4", "--payload", "2M")
        assert out.returncode != 0 and "the target pool is 32 layers x 2 parts, 8 blocks of 16 tokens, 4 kv heads" \
            in out.stderr, out.stderr[-2000:]
    finally:
        serve.terminate()
        serve.wait(30)
        serve.stdout.close()
        errors.close()
