"""The peer-library comparison (`pdkv bench transfer --compare nixl,mooncake`) end to end.

Small workloads only: these check that each library moves the right bytes through the
same workload and that every child process is gone afterwards. Numbers are never
asserted (timings are benchmark results, not test outcomes).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from pdkv.lab.transfer import peer_nixl, peer_pair, peers
from pdkv.lab.transfer.peers import Workload, available_peers, run_mooncake, run_nixl
from pdkv.errors import InvalidArgument, NotSupported, PdkvError, TransferTimeout

SMALL = Workload(block_bytes=32768, num_blocks=64, iters=2, seed=7, lat_iters=20)

needs_nixl = pytest.mark.skipif(
    "nixl" not in available_peers(),
    reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)",
)
needs_mooncake = pytest.mark.skipif(
    "mooncake" not in available_peers(),
    reason="Mooncake is not installed (apt-get install -y libibverbs1 && "
    "pip install mooncake-transfer-engine-non-cuda)",
)


def _bench_children() -> list[int]:
    """Live processes running ``pdkv.lab.transfer.peers`` whose parent is this process."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if b"pdkv.lab.transfer.peers" in cmd and ppid == os.getpid() and state != "Z":
            found.append(int(pid))
    return found


def _check_result(r: dict, peer: str, w: Workload) -> None:
    assert r["peer"] == peer
    assert r["verified"] is True, r
    assert r["mismatched_blocks"] == 0
    assert r["payload_bytes"] == w.payload_bytes
    assert r["block_bytes"] == w.block_bytes
    for key in ("gbps", "lat_p50_us", "lat_p99_us"):
        assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
    assert r["lat_p50_us"] <= r["lat_p99_us"]
    assert isinstance(r["version"], str) and r["version"]
    assert isinstance(r["notes"], str) and r["notes"]
    assert "Child exit status" not in r["notes"], r["notes"]  # both exited cleanly
    assert _bench_children() == []


def test_workload_is_seeded_and_validated() -> None:
    w = SMALL
    perm = w.permutation()
    assert sorted(perm.tolist()) == list(range(w.num_blocks))
    assert not np.array_equal(perm, np.arange(w.num_blocks))
    np.testing.assert_array_equal(perm, dataclasses.replace(w).permutation())
    assert not np.array_equal(perm, dataclasses.replace(w, seed=8).permutation())
    src = w.source_pool()
    assert src.dtype == np.uint8 and src.shape == (w.payload_bytes,)
    np.testing.assert_array_equal(src, w.source_pool())
    assert w.payload_bytes == 64 * 32768
    with pytest.raises(InvalidArgument):
        Workload(block_bytes=0, num_blocks=1, iters=1, seed=0, lat_iters=0)
    with pytest.raises(InvalidArgument):
        Workload(block_bytes=1, num_blocks=1, iters=0, seed=0, lat_iters=0)


def test_importing_pdkv_imports_no_peer_library() -> None:
    code = (
        "import sys, pdkv, pdkv.lab.transfer.peers as p; p.available_peers(); "
        "bad = [m for m in ('nixl', 'mooncake', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_library_is_not_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "_nixl_installed", lambda: False)
    monkeypatch.setattr(peers, "_mooncake_installed", lambda: False)
    with pytest.raises(NotSupported, match="pip install --no-deps nixl-cu12"):
        run_nixl(SMALL)
    with pytest.raises(NotSupported, match="pip install mooncake-transfer-engine-non-cuda"):
        run_mooncake(SMALL)
    assert available_peers() == []


def test_ucx_error_mode_follows_transports() -> None:
    assert peer_nixl.ucx_error_mode({}) == "peer"
    assert peer_nixl.ucx_error_mode({"UCX_TLS": "tcp"}) == "peer"
    assert peer_nixl.ucx_error_mode({"UCX_TLS": "shm"}) == "none"
    assert peer_nixl.ucx_error_mode({"UCX_TLS": "posix,cma,self"}) == "none"
    assert peer_nixl.ucx_error_mode({"UCX_TLS": "shm,tcp"}) == "peer"
    assert peer_nixl.ucx_error_mode({"UCX_TLS": "^tcp"}) == "peer"


@pytest.mark.nixl
@needs_nixl
def test_nixl_over_ucx_tcp() -> None:
    r = run_nixl(SMALL)
    _check_result(r, "nixl", SMALL)
    assert r["env"]["UCX_TLS"] == "tcp" and r["env"]["UCX_NET_DEVICES"] == "lo"
    assert r["progress"] == "thread"  # poll()-based, not NIXL's spinning default


@pytest.mark.nixl
@needs_nixl
def test_nixl_over_ucx_shm() -> None:
    # UCX_TLS=shm only works with the UCX backend's error handling mode "none".
    r = run_nixl(SMALL, backend_env={"UCX_TLS": "shm"})
    _check_result(r, "nixl", SMALL)
    assert "error mode none" in r["notes"]


@needs_mooncake
def test_mooncake_over_tcp() -> None:
    r = run_mooncake(SMALL)
    _check_result(r, "mooncake", SMALL)


@pytest.mark.skipif(not available_peers(), reason="neither NIXL nor Mooncake is installed")
def test_deadline_kills_both_children() -> None:
    run = run_nixl if "nixl" in available_peers() else run_mooncake
    with pytest.raises(TransferTimeout):
        run(SMALL, timeout_s=0.2)  # less than a child needs to import the library
    assert _bench_children() == []


def test_failing_child_raises_and_leaves_nothing() -> None:
    # A child that dies at start-up fails the run with its log, and nothing stays.
    with pytest.raises(PdkvError, match="no-such-peer-target exited"):
        peer_pair.run_pair("no-such-peer", SMALL, dict(os.environ), 30.0)
    assert _bench_children() == []
