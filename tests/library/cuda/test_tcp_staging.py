"""Device memory over tcp, staged through pinned host buffers, on the fake CUDA driver.

The checks live in tcp_staging_child.py (a fresh process per run: the CUDA driver is
loaded once per process); the same script runs on a real GPU from bench/gpu_check.sh.
The fake's device memory is not host-accessible (PROT_NONE), so a send or receive
straight from device memory fails here as it would on a GPU, and its copies are
asynchronous with a delay, so acknowledging before a copy landed shows up as a
mismatch at notification time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import pdkv

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "tcp_staging_child.py")


def run_child(driver: str, **env) -> dict:
    e = dict(os.environ, PDKV_CUDA_DRIVER=driver, **env)
    r = subprocess.run([sys.executable, CHILD], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", ["kernel", "pieces"])
@pytest.mark.parametrize("conns", ["1", "2"])
def test_device_memory_over_tcp_every_direction_bit_exact(fakecuda_path, conns, path):
    import fakecuda_lib

    # pieces: PDKV_BENCH_DEVICE_PIECES=1, the old path (one cuMemcpyAsync per piece).
    forced = {"PDKV_BENCH_DEVICE_PIECES": "1"} if path == "pieces" else {}
    out = run_child(fakecuda_path, FAKECUDA_COPY_DELAY_US="100", STAGING_CONNS=conns, **forced)
    assert out["checks"] == [
        "write dev->dev", "write host->dev", "write dev->host", "read dev->dev", "read dev->host",
        "read host->dev", "read dev->host", "prepared reposted", "write dev->dev", "copy failures",
        "write dev->dev", "cancel", "write dev->dev", "peer closed",
    ]
    stats = dict(zip(fakecuda_lib.STATS, out["stats"]))
    # Everything moved through copies the driver performed: one strided-kernel launch
    # per staged batch (runs of the scattered blocks; cpp/src/cuda/strided_copy.h), or
    # forced back to one cuMemcpyAsync per piece. Both injected failures were hit.
    if path == "kernel" and stats["module_loads"] > 0:
        assert stats["strided_launches"] > 50, stats
        assert stats["async_copies"] == 0 and stats["batch_extents"] == 0, stats
    else:
        assert stats["async_copies"] > 500
        assert stats["kernel_launches"] == 0
    assert stats["failed_copies"] == 2
    # Closed agents leave no pinned buffer, stream or event behind, and pdkv never
    # called the driver on a thread without a context.
    assert stats["live_pinned"] == 0 and stats["live_streams"] == 0 and stats["live_events"] == 0, stats
    assert stats["no_context_errors"] == 0, stats


def test_device_regions_need_a_cuda_driver_for_tcp():
    # This process has no CUDA driver: tcp cannot stage, and says so.
    if "cuda_ipc" in pdkv.available_transports() or os.environ.get("PDKV_CUDA_DRIVER"):
        pytest.skip("a CUDA driver is loaded in this process")
    buf = bytearray(1 << 16)
    import ctypes

    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        r = a.register_address(addr, len(buf), kind="cuda", device=0, keepalive=buf)
        d = b.register(bytearray(4096))
        peer = a.connect(b.address)
        with pytest.raises(pdkv.NotSupported, match="CUDA driver"):
            a.prepare_extents("write", peer, [(r.id, 0, d.id, 0, 4096)])
        # The receiving side says the same when a peer writes into its device region.
        peer_a = b.connect(a.address)
        x = b.prepare_extents("write", peer_a, [(d.id, 0, r.id, 0, 4096)]).post()
        with pytest.raises(pdkv.NotSupported, match="device memory.*CUDA driver"):
            x.wait(10)
        assert not any(buf), "nothing may land in a device region that cannot be staged"
        r.close()
    # A same-host peer gets shm, which cannot touch device memory: the error says which
    # enabled transport can.
    with pdkv.Agent("a", secret="s", transports=["shm", "tcp"]) as a, \
            pdkv.Agent("b", secret="s", transports=["shm", "tcp"]) as b:
        r = a.register_address(addr, len(buf), kind="cuda", device=0, keepalive=buf)
        d = b.register(bytearray(4096))
        peer = a.connect(b.address)
        assert a.peer_transport(peer) == "shm"
        with pytest.raises(pdkv.NotSupported, match="cannot access local cuda region .*enabled transports that can: tcp"):
            a.prepare_extents("write", peer, [(r.id, 0, d.id, 0, 4096)])
        r.close()


def test_agents_do_not_initialize_cuda_until_device_memory_is_used(fakecuda_path):
    """cuInit in a process that later fork()s breaks CUDA in its children: creating
    agents (cuda_ipc offered) and moving host memory must not call it."""
    code = textwrap.dedent("""
        import ctypes, json, numpy as np, pdkv
        from fakecuda_lib import STATS
        a, b = pdkv.Agent("a", secret="s"), pdkv.Agent("b", secret="s")
        offered = "cuda_ipc" in pdkv.available_transports() and "cuda_ipc" in a.transports
        src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.connect(b.address)
        a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, 4096)]).post().wait(10)
        lib = ctypes.CDLL(__import__("os").environ["PDKV_CUDA_DRIVER"])
        arr = (ctypes.c_ulonglong * len(STATS))()
        lib.fakecuda_stats(arr, len(STATS))
        print(json.dumps({"offered": offered, "inits": dict(zip(STATS, arr))["inits"],
                          "copied": bool((dst == src).all())}))
    """)
    env = dict(os.environ, PDKV_CUDA_DRIVER=fakecuda_path, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(HERE))] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"offered": True, "inits": 0, "copied": True}
