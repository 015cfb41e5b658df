"""`pdkv bench transfer` end to end at a small payload (numbers are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pdkv


def run_bench(*args: str, timeout: float = 240, env: dict | None = None) -> list[dict]:
    env = dict(os.environ, UCX_NET_DEVICES="lo", **(env or {}))
    out = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--payload", "4M,8M", "--iters", "2",
                          "--lat-iters", "30", "--prepare-blocks", "1000", "--json", *args],
                         capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("transport", [t for t in ("tcp", "shm", "nixl") if t in pdkv.available_transports()])
def test_bench_transfer_json(transport):
    rows = run_bench("--transport", transport)
    assert [r["payload_bytes"] for r in rows] == [4 << 20, 8 << 20]
    for r in rows:
        assert r["transport"] == transport and r["verified"] is True
        assert r["block_bytes"] == 32 << 10 and r["extents"] == r["payload_bytes"] // (32 << 10)
        assert set(r["ceilings"]) == {"socket_plain", "socket_tuned", "memcpy"}
        assert set(r["ratios"]) == set(r["ceilings"])
        assert r["gbps"] > 0 and r["lat_p50_us"] > 0 and r["lat_p99_us"] >= r["lat_p50_us"]
        check_cpu(r, set(r["ceilings"]))


def median(xs):
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def check_cpu(r: dict, ceilings: set[str], peers: tuple[str, ...] = ()) -> None:
    """CPU seconds per GB of pdkv and of every ceiling (and peer), with pdkv's ratio over each:
    in every alternating round, and as medians over the rounds."""
    assert r["cpu_s_per_gb"] > 0  # the initiator alone spends some
    assert set(r["ceilings_cpu_s_per_gb"]) == ceilings
    assert all(v >= 0 for v in r["ceilings_cpu_s_per_gb"].values())
    assert set(r["ratios_cpu"]) == ceilings | set(peers)
    rounds = r["per_round"]
    assert len(rounds) == r["rounds"]
    for rnd in rounds:
        cpu = rnd["cpu_s_per_gb"]
        for k in ceilings:
            assert rnd["ratios"][k] == pytest.approx(rnd["gbps"]["pdkv"] / rnd["gbps"][k])
            assert rnd["ratios_cpu"][k] == (pytest.approx(cpu["pdkv"] / cpu[k]) if cpu[k] > 0 else None)
    assert r["gbps"] == pytest.approx(median([x["gbps"]["pdkv"] for x in rounds]))
    assert r["cpu_s_per_gb"] == pytest.approx(median([x["cpu_s_per_gb"]["pdkv"] for x in rounds]))
    for k in ceilings:
        assert r["ceilings"][k] == pytest.approx(median([x["gbps"][k] for x in rounds]))
        assert r["ratios"][k] == pytest.approx(median([x["ratios"][k] for x in rounds]))
        lo, hi = r["spread"]["ratios"][k]
        assert lo <= r["ratios"][k] <= hi
        known = [x["ratios_cpu"][k] for x in rounds if x["ratios_cpu"][k] is not None]
        assert r["ratios_cpu"][k] == (pytest.approx(median(known)) if known else None)
    split = r["cpu_s_per_gb_by_process"]
    assert set(split) == ceilings | {"pdkv"}
    assert split["pdkv"]["initiator"] + split["pdkv"]["target"] == pytest.approx(r["cpu_s_per_gb"])


def test_bench_transfer_tls_beside_plain():
    """--tls: each payload plain, then over TLS, in one invocation, with the ratio."""
    rows = run_bench("--tls")
    assert [r["payload_bytes"] for r in rows] == [4 << 20, 8 << 20]
    for r in rows:
        assert r["tls"] is True and r["verified"] is True and r["gbps"] > 0
        assert r["plain"]["gbps"] > 0 and r["ratio_tls_over_plain"] == r["gbps"] / r["plain"]["gbps"]
        assert r["ratio_cpu_tls_over_plain"] == pytest.approx(r["cpu_s_per_gb"] / r["plain"]["cpu_s_per_gb"])
        assert r["lat_ratio_tls_over_plain"] > 0


def test_bench_transfer_device_memory_over_tcp(fakecuda_path):
    """--memory cuda on the fake driver: both pools in device memory, staged over tcp."""
    rows = run_bench("--transport", "tcp", "--memory", "cuda", env={"PDKV_CUDA_DRIVER": fakecuda_path})
    assert [r["payload_bytes"] for r in rows] == [4 << 20, 8 << 20]
    for r in rows:
        assert r["transport"] == "tcp" and r["memory"] == "cuda" and r["verified"] is True
        assert set(r["ceilings"]) == {"socket_plain", "socket_tuned"}  # no host memcpy ceiling
        assert r["gbps"] > 0
        check_cpu(r, {"socket_plain", "socket_tuned"})


def test_bench_transfer_compare_peers():
    from pdkv.lab.transfer import peers

    avail = peers.available_peers()
    if not avail:
        pytest.skip("neither NIXL nor Mooncake is installed")
    rows = run_bench("--transport", "tcp", "--compare", ",".join(avail), timeout=400)
    for r in rows:
        for name in avail:
            p = r["peers"][name]
            assert "error" not in p, p
            assert p["verified"] is True and p["gbps"] > 0 and p["payload_bytes"] == r["payload_bytes"]
            assert p["cpu_s_per_gb"] > 0 and set(p["cpu_s_per_gb_by_process"]) == {"initiator", "target"}
            assert p["ratio_cpu_pdkv_over_peer"] == pytest.approx(r["cpu_s_per_gb"] / p["cpu_s_per_gb"])
        check_cpu(r, set(r["ceilings"]), tuple(avail))


def test_bench_transfer_with_busy_co_runners_reports_them():
    rows = run_bench("--transport", "tcp", "--busy", "2", "--rounds", "1")
    assert rows and all(r["busy"]["processes"] == 2 and len(r["busy"]["cpus"]) == 2 for r in rows)
    assert all(r["verified"] is True and r["lat_p50_us"] > 0 for r in rows)
    quiet = run_bench("--transport", "tcp", "--rounds", "1")
    assert all(r["busy"] == {"processes": 0, "cpus": []} for r in quiet)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_bench_transfer_pins_initiator_and_target_to_different_cpus_and_sets_thread_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    rows = run_bench("--transport", "tcp", "--rounds", "1", "--busy", "1", "--busy-cpus", str(cpus[1]),
                     "--thread-cpus", str(cpus[0]))
    for r in rows:
        # until 2026-12-07 the target inherited the initiator's pin (both on cpus[0])
        assert r["process_cpus"] == {"initiator": [cpus[0]], "target": [cpus[1]]}
        assert r["pdkv_thread_cpus"] == [cpus[0]] and r["busy"] == {"processes": 1, "cpus": [cpus[1]]}
    rows = run_bench("--transport", "tcp", "--rounds", "1", "--no-pin")
    assert all(r["process_cpus"] == {"initiator": cpus, "target": cpus} and r["pdkv_thread_cpus"] == [] for r in rows)
    rows = run_bench("--transport", "tcp", "--rounds", "1", "--pin-cpus", f"{cpus[1]},{cpus[1]}")
    assert all(r["process_cpus"] == {"initiator": [cpus[1]], "target": [cpus[1]]} for r in rows)


@pytest.mark.parametrize("argv", [["--busy-cpus", "100000"], ["--thread-cpus", "x"], ["--pin-cpus", "0"]])
def test_bench_transfer_refuses_cpus_it_cannot_use(argv):
    out = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--payload", "1M", *argv],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and ("CPU list" in out.stderr or "two CPUs" in out.stderr)


def test_bench_transfer_with_spinning_threads_and_churn_reports_them():
    rows = run_bench("--transport", "tcp", "--busy-threads", "2", "--busy-churn", "fork:2", "--rounds", "1")
    assert rows and all(r["verified"] is True for r in rows)
    for r in rows:
        b = r["busy"]
        assert b["processes"] == 0 and b["threads"] == 2 and len(b["thread_cpus"]) == 2
        assert [(c["kind"], c["arg"]) for c in b["churn"]] == [("fork", "2")] and b["churn"][0]["starts"] >= 0
        rd = r["per_round"][0]
        assert len(rd["pdkv_transfer_ms"]) == r["iters"] and all(ms > 0 for ms in rd["pdkv_transfer_ms"])
        w = rd["wakeups_per_payload"]["pdkv"]
        assert w["total"] == pytest.approx(sum(w["by_thread"].values())) and w["total"] > 0
        assert all(k.split(":")[0] in ("initiator", "target") for k in w["by_thread"])


def test_bench_transfer_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--payload", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "cannot parse size" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--transport", "warp"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not available" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--memory", "cuda", "--compare",
                          "nixl"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "host memory" in out.stderr


def test_table_prints_unknown_cpu_as_dash(capsys):
    """A target on another host (--target): its CPU cannot be read, the table says '-'."""
    import argparse

    from pdkv.lab.transfer import bench

    r = {"transport": "tcp", "block_bytes": 32768, "payload_bytes": 64 << 20, "extents": 2048, "gbps": 3.0,
         "ceilings": {"socket_plain": 2.5, "socket_tuned": 3.1}, "ratios": {"socket_plain": 1.2, "socket_tuned": 0.97},
         "cpu_s_per_gb": None, "ceilings_cpu_s_per_gb": {"socket_plain": None, "socket_tuned": None},
         "ratios_cpu": {"socket_plain": None, "socket_tuned": None, "nixl": None}, "verified": True,
         "peers": {"nixl": {"gbps": 0.6, "cpu_s_per_gb": 1.5, "ratio_cpu_pdkv_over_peer": None, "block_bytes": 32768,
                            "lat_p50_us": 50.0, "lat_p99_us": 900.0, "verified": True}},
         "block_half_bytes": 32768, "lat_p50_us": 30.0, "lat_p99_us": 90.0, "raw_rtt_p50_us": 16.0,
         "raw_rtt_p99_us": 20.0, "lat_ratio_vs_raw_rtt": 1.9, "whole_block_bytes": 2 << 20,
         "block_lat_p50_us": 400.0, "block_lat_p99_us": 900.0, "raw_block_rtt_p50_us": 420.0}
    args = argparse.Namespace(memory="host", model="llama-3-8b", conns=1, threads=1, target="hostB:7500")
    bench.print_table(args, [r])
    out = capsys.readouterr().out
    cpu_row = next(line for line in out.splitlines() if line.strip().startswith("CPU/GB"))
    assert cpu_row.split()[1:] == ["-"] * 7
    assert "CPU 1.500 s/GB (pdkv -)" in out
