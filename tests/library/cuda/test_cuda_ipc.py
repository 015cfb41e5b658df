"""GPU pools on one node: cuda_ipc between two processes (skipped without a GPU).

Run on a GPU machine: `pytest tests/library/cuda -v` (or bench/gpu_check.sh).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cuda

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # torch may be a CPU build even where a GPU exists
    pytest.skip("torch has no CUDA", allow_module_level=True)

import pdkv  # noqa: E402

TARGET = textwrap.dedent("""
    import sys, torch, pdkv
    L, B, T, H, D = 4, 64, 16, 8, 128
    pool = torch.zeros(L, 2, B, T, H, D, dtype=torch.bfloat16, device="cuda")
    a = pdkv.Agent("gpu-target", secret="s")
    a.register(pool)
    a.add_layout("kv", pdkv.KVLayout.from_tensors([pool[l, 0] for l in range(L)], [pool[l, 1] for l in range(L)]))
    print(a.address, flush=True)
    for line in sys.stdin:
        ids = [int(x) for x in line.split()]
        torch.cuda.synchronize()
        print(float(pool[:, :, ids].float().sum()), flush=True)
""")


@pytest.fixture
def target():
    p = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    addr = p.stdout.readline().strip()
    yield p, addr
    p.stdin.close()
    p.wait(30)


def test_cuda_ipc_write_read_bit_exact(target):
    proc, addr = target
    L, B, T, H, D = 4, 64, 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(L, 2, B, T, H, D, dtype=torch.bfloat16, device="cuda", generator=g)
    with pdkv.Agent("gpu-init", secret="s") as a:
        assert "cuda_ipc" in pdkv.available_transports()
        a.register(pool)
        a.add_layout("kv", pdkv.KVLayout.from_tensors([pool[l, 0] for l in range(L)], [pool[l, 1] for l in range(L)]))
        peer = a.connect(addr)
        assert a.peer_transport(peer) == "cuda_ipc"
        lids, rids = [3, 7, 8, 9, 20], [40, 2, 3, 4, 63]
        assert a.write(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), notify=b"gpu").wait(30)
        proc.stdin.write(" ".join(map(str, rids)) + "\n")
        proc.stdin.flush()
        remote_sum = float(proc.stdout.readline())
        assert remote_sum == pytest.approx(float(pool[:, :, lids].float().sum()), rel=0, abs=1e-3)
        # Read them back into other local blocks: bit exact.
        assert a.read(peer, pdkv.Blocks("kv", [50, 51, 52, 53, 54]), pdkv.Blocks("kv", rids)).wait(30)
        torch.cuda.synchronize()
        assert torch.equal(pool[:, :, [50, 51, 52, 53, 54]], pool[:, :, lids])


def test_device_memory_over_tcp_on_the_real_driver():
    """Pinned staging with the real driver: the fake-driver checks, run on the GPU."""
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_staging_child.py")
    env = {k: v for k, v in os.environ.items() if k != "PDKV_CUDA_DRIVER"}
    r = subprocess.run([sys.executable, child], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "prepared reposted" in r.stdout
