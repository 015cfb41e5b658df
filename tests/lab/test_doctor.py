"""``pdkv doctor``: the JSON schema docs/doctor.md documents, the no-GPU line on this
machine, devices and the peer-access matrix on the fake CUDA driver (tests/fakecuda),
the two-process CUDA IPC check, RDMA facts from a sysfs tree, and ``--peer``/``--probe``
against a live agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pdkv
from pdkv.lab import doctor

TOP = {"schema", "pdkv_version", "gpu", "pinned_memory", "rdma", "shm", "transports", "peer", "tcp"}
GPU = {"available", "reason", "cuda_python", "driver_library", "driver_version", "devices", "peer_access", "cuda_ipc"}
DEVICE = {"index", "name", "total_bytes", "compute_capability", "pci_bus_id"}
PEER_CELL = {"can_access_peer", "access_supported", "native_atomics", "performance_rank"}


def _has_cuda_python() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:
        return False


needs_cuda_python = pytest.mark.skipif(not _has_cuda_python(), reason="needs cuda-python (the gpu extra)")


def run(args: list[str], driver: str | None = None, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "PDKV_CUDA_DRIVER"}
    if driver:
        e["PDKV_CUDA_DRIVER"] = driver
    e.update(env)
    return subprocess.run([sys.executable, "-m", "pdkv.cli", *args], env=e, capture_output=True, text=True,
                          timeout=120)


def doctor_json(args: list[str] = (), driver: str | None = None, **env) -> dict:
    r = run(["doctor", "--json", *args], driver, **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_json_schema_without_a_gpu():
    if os.environ.get("PDKV_CUDA_DRIVER") or "cuda_ipc" in pdkv.available_transports():
        pytest.skip("a CUDA driver is loaded here (a GPU machine): bench/gpu_check.sh checks it for real")
    rep = doctor_json()
    assert set(rep) == TOP and rep["schema"] == doctor.SCHEMA and rep["peer"] is None
    g = rep["gpu"]
    assert set(g) == GPU
    if not g["available"]:  # this machine (CI and development have no GPU)
        assert g["reason"] and g["devices"] == [] and g["peer_access"] == []
        assert g["cuda_ipc"] == {"works": None, "detail": "not checked"}
    assert set(rep["pinned_memory"]) == {"memlock_soft", "memlock_hard", "detail"}
    assert set(rep["rdma"]) == {"devices", "ucx_net_devices", "ucx_tls", "nixl", "detail"}
    assert set(rep["shm"]) >= {"path", "total_bytes", "free_bytes", "memfd", "seals", "detail"}
    tc = rep["tcp"]
    assert set(tc) == {"congestion_control", "allowed", "available", "detail"}
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        assert tc["congestion_control"] == f.read().strip()
    assert tc["congestion_control"] in tc["available"] and tc["detail"]
    t = rep["transports"]
    assert set(t) == {"available", "default_order", "notes"}
    assert t["available"] == pdkv.available_transports() and "tcp" in t["default_order"]
    assert set(t["default_order"]) <= set(t["available"]) and "cuda_ipc" in t["notes"]


def test_text_says_there_is_no_gpu_and_which_transports():
    if os.environ.get("PDKV_CUDA_DRIVER") or "cuda_ipc" in pdkv.available_transports():
        pytest.skip("a CUDA driver is loaded here (a GPU machine): bench/gpu_check.sh checks it for real")
    r = run(["doctor"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("gpu: no GPU here: "), r.stdout
    assert any(line.startswith("transports: agents use ") for line in lines), r.stdout
    assert len(lines) < 20
    # pdkv info --doctor is the same report.
    r2 = run(["info", "--doctor"])
    assert r2.returncode == 0 and r2.stdout.splitlines()[1] == lines[1]


def test_without_cuda_python_the_gpu_line_says_so():
    code = ("import sys; sys.modules['cuda'] = None\n"
            "from pdkv.lab import doctor; print(doctor.render(doctor.gather()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "gpu: no GPU here: cuda-python is not installed" in r.stdout, r.stdout


@needs_cuda_python
@pytest.mark.parametrize("p2p", [True, False])
def test_fake_driver_devices_peer_matrix_and_cuda_ipc(fakecuda_path, p2p):
    env = {"FAKECUDA_DEVICES": "2"} | ({} if p2p else {"FAKECUDA_NO_P2P": "1"})
    rep = doctor_json(driver=fakecuda_path, **env)
    g = rep["gpu"]
    assert g["available"] and g["reason"] is None and g["driver_version"] == "13.0"
    assert [d["index"] for d in g["devices"]] == [0, 1]
    for d in g["devices"]:
        assert set(d) == DEVICE and d["compute_capability"] == "9.0" and d["total_bytes"] == 16 << 30
    m = g["peer_access"]
    assert m[0][0] is None and m[1][1] is None
    for cell in (m[0][1], m[1][0]):
        assert set(cell) == PEER_CELL and cell["can_access_peer"] is p2p and cell["access_supported"] is p2p
    assert g["cuda_ipc"]["works"] is True, g["cuda_ipc"]
    t = rep["transports"]
    assert "cuda_ipc" in t["default_order"], t  # viable with a driver

    r = run(["doctor"], fakecuda_path, **env)
    assert r.returncode == 0, r.stderr
    assert "gpu: 2 device(s), CUDA driver 13.0" in r.stdout
    assert f"peer access: 0<->1 {'yes' if p2p else 'no'}" in r.stdout
    assert "cuda ipc between processes: works" in r.stdout


@needs_cuda_python
def test_cuda_ipc_check_reports_a_failing_child(fakecuda_path):
    # The child is killed by the timeout: the check says so instead of hanging.
    code = ("import pdkv.lab.doctor as d, subprocess, json\n"
            "real = subprocess.run\n"
            "def slow(cmd, **kw):\n"
            "    return real([cmd[0], '-c', 'import time; time.sleep(30)'], **kw)\n"
            "d.subprocess.run = slow\n"
            "print(json.dumps(d.cuda_ipc_check(timeout=1)))")
    e = dict(os.environ, PDKV_CUDA_DRIVER=fakecuda_path)
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["works"] is False and "did not answer in 1 s" in out["detail"]


def test_rdma_facts_from_a_sysfs_tree(tmp_path, monkeypatch):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    f = doctor.rdma_facts(str(tmp_path))
    assert f["devices"] == [{"name": "mlx5_0", "ports": [{"port": 1, "state": "4: ACTIVE", "link_layer": "InfiniBand",
                                                          "rate": "400 Gb/sec (4X NDR)"}]}]
    assert "UCX_NET_DEVICES=mlx5_0:1" in f["detail"]
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    assert doctor.rdma_facts(str(tmp_path))["ucx_net_devices"] == "mlx5_0:1"
    assert doctor.rdma_facts(str(tmp_path / "none"))["devices"] == []


def test_shm_and_pinned_facts():
    s = doctor.shm_facts()
    assert s["memfd"] and s["seals"] and s["total_bytes"] > 0
    p = doctor.pinned_facts()
    assert p["memlock_soft"] is None or p["memlock_soft"] >= 0


def test_peer_transport_and_probe():
    with pdkv.Agent("target", secret="doc", transports=["shm", "tcp"]) as t:
        region = t.alloc(1 << 20)
        region.array()[:] = 7
        rep = doctor_json(["--peer", t.address, "--probe", "--no-ipc-check"], PDKV_SECRET="doc")
        p = rep["peer"]
        assert p["name"] == "target" and p["same_host"] is True and p["transport"] == "shm", p
        assert "first of this agent's transports" in p["why"]
        assert "transport='tcp'" in p["device_memory"]  # shm cannot carry device memory
        assert p["probe"]["bytes"] == 1 << 20 and p["probe"]["read"]["gb_per_s"] > 0
        assert "write" not in p["probe"]
        assert (region.array() == 7).all()  # a read-only probe
        # tcp only: tcp carries it, and device memory through staging.
        rep = doctor_json(["--peer", t.address, "--no-ipc-check", "--secret", "doc"])
        assert rep["peer"]["transport"] == "shm" and rep["peer"]["probe"] is None
    with pdkv.Agent("target2", secret="doc", transports=["tcp"]) as t:
        r = run(["doctor", "--peer", t.address, "--probe", "--probe-write", "--no-ipc-check"], PDKV_SECRET="doc")
        assert r.returncode == 0, r.stderr
        assert "peer" in r.stdout and "probe: the peer exports no region to read" in r.stdout, r.stdout
        rep = doctor_json(["--peer", t.address, "--no-ipc-check"], PDKV_SECRET="doc")
        assert rep["peer"]["transport"] == "tcp" and rep["peer"]["device_memory"] == "tcp (pinned staging)"


def test_peer_errors_are_reported_not_raised():
    rep = doctor_json(["--peer", "127.0.0.1:1", "--no-ipc-check"], PDKV_SECRET="x")
    assert rep["peer"]["address"] == "127.0.0.1:1" and "PeerConnectionError" in rep["peer"]["error"]
    with pdkv.Agent("target", secret="right", transports=["tcp"]) as t:
        rep = doctor_json(["--peer", t.address, "--no-ipc-check"], PDKV_SECRET="wrong")
        assert "error" in rep["peer"], rep["peer"]
    r = run(["doctor", "--peer", "127.0.0.1:1"], PDKV_SECRET="")
    assert r.returncode == 2 and "needs the cluster secret" in r.stderr
    r = run(["doctor", "--probe"])
    assert r.returncode == 2 and "--probe needs --peer" in r.stderr


def test_tcp_facts_warn_of_bbr_and_name_an_allowed_alternative(tmp_path):
    """A host whose default is bbr gets the measured cost and the option that avoids it;
    another default gets no warning."""
    def proc(default, allowed):
        d = tmp_path / default / "-".join(allowed)
        d.mkdir(parents=True)
        (d / "tcp_congestion_control").write_text(default + "\n")
        (d / "tcp_allowed_congestion_control").write_text(" ".join(allowed) + "\n")
        (d / "tcp_available_congestion_control").write_text("reno cubic bbr\n")
        return str(d)

    f = doctor.tcp_facts(proc("bbr", ["reno", "bbr"]))
    assert f["congestion_control"] == "bbr" and "30% slower" in f["detail"]
    assert "congestion_control='reno'" in f["detail"]
    assert "congestion_control='cubic'" in doctor.tcp_facts(proc("bbr", ["cubic", "reno", "bbr"]))["detail"]
    assert "none of cubic or reno" in doctor.tcp_facts(proc("bbr", ["bbr"]))["detail"]
    f = doctor.tcp_facts(proc("cubic", ["reno", "cubic"]))
    assert "slower" not in f["detail"] and f["allowed"] == ["reno", "cubic"]
    assert doctor.tcp_facts(str(tmp_path / "missing"))["congestion_control"] is None
