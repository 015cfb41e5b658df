"""Device pools from ``Agent.alloc(nbytes, device=N)`` (cuda-python, no torch) moved bit
exact over tcp staging and cuda_ipc, every direction.

Run as a script in a fresh process (the CUDA driver is loaded once per process):
``python tests/library/cuda/device_pool_child.py``. It uses whatever driver pdkv and
cuda-python load (``$PDKV_CUDA_DRIVER``, else ``libcuda.so.1``), so the same checks run
against the fake driver (tests/library/cuda/test_device_pool.py) and on a real GPU
(bench/gpu_check.sh). cuda_ipc needs two processes: the script starts itself again as
the target (``target`` argument). Prints one JSON line: {"checks": [...], ...}; a
mismatch raises (non-zero exit with the traceback).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pdkv
from pdkv.device import DeviceBuffer, DeviceRegion, device_count

N = 3 << 20  # 3 MiB: several tcp staging chunks
TCP = pdkv.TcpOptions(stage_chunk_bytes=256 << 10, stage_buffers=2)
DEV1 = 1 if device_count() > 1 else 0  # the second device when there is one


def pattern(seed: int, n: int = N) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest() * 64
        i += 1
    return bytes(out[:n])


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def move(a: pdkv.Agent, peer: str, op: str, local: pdkv.Region, remote_id: int, n: int = N) -> None:
    a.prepare_extents(op, peer, [(local.id, 0, remote_id, 0, n)]).post().wait(60)


def tcp_checks(checks: list) -> None:
    with pdkv.Agent("a", secret="s", transports=["tcp"], options=[TCP]) as a, \
            pdkv.Agent("b", secret="s", transports=["tcp"], options=[TCP]) as b:
        src, dst = a.alloc(N, device=0), b.alloc(N, device=DEV1)
        assert isinstance(src, DeviceRegion) and src.kind == "cuda" and src.device == 0 and dst.device == DEV1
        host = a.register(bytearray(N))
        peer = a.connect(b.address)
        assert a.peer_transport(peer) == "tcp"
        src.copy_from_host(pattern(1))
        move(a, peer, "write", src, dst.id)
        assert dst.copy_to_host() == pattern(1), "write dev->dev"
        checks.append("tcp write dev->dev")
        dst.copy_from_host(pattern(2))
        move(a, peer, "read", src, dst.id)
        assert src.copy_to_host() == pattern(2), "read dev<-dev"
        checks.append("tcp read dev<-dev")
        move(a, peer, "read", host, dst.id)
        assert bytes(host._obj) == pattern(2), "read host<-dev"
        checks.append("tcp read host<-dev")
        host._obj[:] = pattern(3)
        move(a, peer, "write", host, dst.id)
        assert dst.copy_to_host() == pattern(3), "write host->dev"
        checks.append("tcp write host->dev")
        # Not closed here: closing the agent frees its device memory.


def dlpack_checks(checks: list) -> None:
    with pdkv.Agent("c", secret="s", transports=["tcp"]) as c:
        buf = DeviceBuffer(1 << 16, 0)
        assert buf.__dlpack_device__() == (2, 0)
        r = c.register(buf)  # read natively from the DLPack capsule
        assert (r.addr, r.nbytes, r.kind, r.device) == (buf.ptr, 1 << 16, "cuda", 0), r
        r.close()
        from pdkv import device

        assert not device._exports, device._exports  # pdkv's register consumed it and ran the deleter
        cap = buf.__dlpack__()
        del cap  # dropped unconsumed: kept until free()
        try:
            import numpy as np

            np.from_dlpack(buf)
        except ImportError:
            pass
        except (BufferError, RuntimeError, TypeError, ValueError) as e:  # numpy refuses CUDA memory, cleanly
            assert "CUDA" in str(e) or "device" in str(e).lower(), e
        buf.free()
        assert not device._exports, device._exports
        checks.append("dlpack export")


def ipc_checks(checks: list) -> None:
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, __file__, "target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        hello = json.loads(p.stdout.readline())
        with pdkv.Agent("i", secret="s", transports=["cuda_ipc", "tcp"]) as a:
            src, back = a.alloc(N, device=0), a.alloc(N, device=DEV1)
            peer = a.connect(hello["address"])
            assert a.peer_transport(peer) == "cuda_ipc", a.peer_transport(peer)
            src.copy_from_host(pattern(7))
            move(a, peer, "write", src, hello["region"])
            p.stdin.write("digest\n")
            p.stdin.flush()
            assert json.loads(p.stdout.readline())["digest"] == digest(pattern(7)), "cuda_ipc write dev->dev"
            checks.append("cuda_ipc write dev->dev")
            p.stdin.write("fill 8\n")
            p.stdin.flush()
            p.stdout.readline()
            move(a, peer, "read", back, hello["region"])
            assert back.copy_to_host() == pattern(8), "cuda_ipc read dev<-dev"
            checks.append("cuda_ipc read dev<-dev")
            src.close()
            back.close()
    finally:
        p.stdin.write("exit\n")
        p.stdin.flush()
        p.wait(30)
    assert p.returncode == 0


def target() -> int:
    with pdkv.Agent("t", secret="s", transports=["cuda_ipc", "tcp"]) as t:
        r = t.alloc(N, device=DEV1)
        print(json.dumps({"address": t.address, "region": r.id}), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "digest":
                print(json.dumps({"digest": digest(r.copy_to_host())}), flush=True)
            elif cmd[0] == "fill":
                r.copy_from_host(pattern(int(cmd[1])))
                print("{}", flush=True)
            else:
                break
    return 0


def error_checks(checks: list) -> None:
    with pdkv.Agent("e", secret="s", transports=["tcp"]) as a:
        try:
            a.alloc(4096, device=device_count())
        except pdkv.NotSupported as e:
            assert f"no CUDA device {device_count()}" in str(e), e
        else:
            raise AssertionError("alloc on a device this host does not have succeeded")
        for bad in (-1, "0", 1.5):
            try:
                a.alloc(4096, device=bad)
            except pdkv.InvalidArgument:
                pass
            else:
                raise AssertionError(f"device={bad!r} accepted")
        assert not a.regions, a.regions
    checks.append("bad device")


def main() -> int:
    checks: list[str] = []
    tcp_checks(checks)
    dlpack_checks(checks)
    if "cuda_ipc" in pdkv.available_transports():
        ipc_checks(checks)
    error_checks(checks)
    out = {"checks": checks, "devices": device_count()}
    lib = getattr(__import__("ctypes").CDLL(os.environ["PDKV_CUDA_DRIVER"]), "fakecuda_stats", None) \
        if os.environ.get("PDKV_CUDA_DRIVER") else None
    if lib is not None:
        from ctypes import c_ulonglong

        arr = (c_ulonglong * 32)()
        n = lib(arr, 32)
        out["stats"] = list(arr[:n])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(target() if sys.argv[1:] == ["target"] else main())
