"""Device pools from ``Agent.alloc(nbytes, device=N)`` through cuda-python, on the fake
CUDA driver (tests/fakecuda): bit exact over tcp staging and cuda_ipc, DLPack export,
freed on close, and clear errors without a driver, without cuda-python, for a bad device.

The moves run in device_pool_child.py (a fresh process per run: the driver is loaded
once per process); bench/gpu_check.sh runs the same script on a real GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import pdkv



def _has_cuda_python() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:
        return False


needs_cuda_python = pytest.mark.skipif(not _has_cuda_python(), reason="needs cuda-python (the gpu extra)")

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "device_pool_child.py")


def run(code_or_script: list[str], driver: str | None, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "PDKV_CUDA_DRIVER"}
    if driver:
        e["PDKV_CUDA_DRIVER"] = driver
    e.update(env)
    return subprocess.run([sys.executable, *code_or_script], env=e, capture_output=True, text=True, timeout=120)


@needs_cuda_python
@pytest.mark.parametrize("devices", ["1", "2"])
def test_device_pools_move_bit_exact_over_tcp_staging_and_cuda_ipc(fakecuda_path, devices):
    import fakecuda_lib

    r = run([CHILD], fakecuda_path, FAKECUDA_DEVICES=devices, FAKECUDA_COPY_DELAY_US="50")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["devices"] == int(devices)
    assert out["checks"] == ["tcp write dev->dev", "tcp read dev<-dev", "tcp read host<-dev", "tcp write host->dev",
                             "dlpack export", "cuda_ipc write dev->dev", "cuda_ipc read dev<-dev", "bad device"]
    stats = dict(zip(fakecuda_lib.STATS, out["stats"]))
    # Every allocation freed (regions closed, or their agent), the peer's memory opened
    # through IPC once, and pdkv/cuda-python never called the driver without a context.
    assert stats["live_allocs"] == 0 and stats["live_ipc_mappings"] == 0, stats
    assert stats["ipc_opens"] >= 1 and stats["no_context_errors"] == 0, stats


@needs_cuda_python
def test_alloc_on_a_device_without_a_driver_says_so():
    if os.environ.get("PDKV_CUDA_DRIVER") or "cuda_ipc" in pdkv.available_transports():
        pytest.skip("a CUDA driver is loaded here (a GPU machine): bench/gpu_check.sh checks it for real")
    r = run(["-c", textwrap.dedent("""
        import pdkv
        with pdkv.Agent("a", secret="s", transports=["tcp"]) as a:
            try:
                a.alloc(4096, device=0)
            except pdkv.NotSupported as e:
                print("NotSupported:", e)
            assert not a.regions
    """)], None)
    assert r.returncode == 0, r.stderr
    assert "NotSupported: no CUDA driver" in r.stdout or "NotSupported: the CUDA driver" in r.stdout, r.stdout


def test_alloc_on_a_device_without_cuda_python_says_so(fakecuda_path):
    r = run(["-c", textwrap.dedent("""
        import sys
        sys.modules["cuda"] = None  # cuda-python not installed
        import pdkv
        with pdkv.Agent("a", secret="s", transports=["tcp"]) as a:
            try:
                a.alloc(4096, device=0)
            except pdkv.NotSupported as e:
                print("NotSupported:", e)
            r = a.alloc(4096)  # host pools need nothing
            print(type(r).__name__)
    """)], fakecuda_path)
    assert r.returncode == 0, r.stderr
    assert "NotSupported: cuda-python is not installed" in r.stdout and "pdkv[gpu]" in r.stdout, r.stdout
    assert "SharedRegion" in r.stdout


@needs_cuda_python
def test_a_driver_override_cuda_python_cannot_share_is_refused():
    # libm has no soname libcuda.so.1: cuda-python would load another driver than pdkv.
    r = run(["-c", "import pdkv\ntry:\n    pdkv.Agent('a', secret='s').alloc(4096, device=0)\n"
             "except pdkv.NotSupported as e:\n    print(e)"], "libm.so.6")
    assert r.returncode == 0, r.stderr
    assert "has no soname libcuda.so.1" in r.stdout, r.stdout


def test_alloc_validates_before_touching_cuda():
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a:
        for bad in (-1, "0", 1.5, True):
            with pytest.raises(pdkv.InvalidArgument, match="device must be a CUDA ordinal"):
                a.alloc(4096, device=bad)
        with pytest.raises(pdkv.InvalidArgument):
            a.alloc(0, device=0)
