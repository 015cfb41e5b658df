"""Device memory over tcp, staged through pinned host buffers: every direction, bit exact.

Run as a script in a fresh process (the CUDA driver is loaded once per process):
``python tests/library/cuda/tcp_staging_child.py``. It talks to the driver pdkv loads
(``$PDKV_CUDA_DRIVER``, else ``libcuda.so.1``) through ctypes, so the same checks run
against the fake driver in CI (tests/library/cuda/test_tcp_staging.py) and against a real GPU
(bench/gpu_check.sh). Prints one JSON line: {"ok": true, "checks": [...], "stats": ...};
any mismatch raises (non-zero exit with the traceback).
"""

from __future__ import annotations

import json
import os
import sys
from ctypes import c_ulonglong

import numpy as np

import pdkv
from pdkv.lab.transfer.devmem import DeviceMemory

MEM = DeviceMemory()  # the driver pdkv loads: $PDKV_CUDA_DRIVER, else libcuda.so.1
LIB = MEM.lib
FAKE = hasattr(LIB, "fakecuda_fail_copies")


# Small blocks and small staging chunks: one transfer spans many batches, the two
# pooled buffers are reused many times and the receiver's double buffer alternates.
GEOM = pdkv.KVGeometry(num_layers=3, num_blocks=64, block_tokens=4, kv_heads=2, head_dim=64, dtype="float32")
BB = GEOM.block_bytes
# STAGING_CONNS=2: batches spread over two connections and progress threads (the
# notification then travels separately, after every batch was acknowledged).
_CONNS = int(os.environ.get("STAGING_CONNS", "1"))
TCP = pdkv.TcpOptions(stage_chunk_bytes=16384, stage_buffers=2, conns_per_peer=_CONNS, progress_threads=_CONNS)


class Side:
    """One agent with a device pool ("dev") and a host pool ("host"), same geometry."""

    def __init__(self, name: str, seed: int) -> None:
        self.agent = pdkv.Agent(name, secret="s", transports=["tcp"], options=[TCP])
        n = GEOM.pool_bytes
        self.dev = MEM.alloc(n)
        rng = np.random.default_rng(seed)
        MEM.htod(self.dev, rng.integers(0, 256, n, dtype=np.uint8))
        self.host = rng.integers(0, 256, n, dtype=np.uint8)
        self.agent.register_address(self.dev, n, kind="cuda", device=0)
        self.agent.register(self.host)
        self.agent.add_layout("dev", pdkv.KVLayout.contiguous(GEOM, self.dev))
        self.agent.add_layout("host", pdkv.KVLayout.contiguous(GEOM, self.host))

    def pool(self, which: str) -> np.ndarray:
        return MEM.dtoh(self.dev, GEOM.pool_bytes, np.uint8) if which == "dev" else self.host.copy()


def blocks(pool: np.ndarray, ids: list[int]) -> np.ndarray:
    v = pool.reshape(GEOM.num_layers * GEOM.kv_parts, GEOM.num_blocks, BB)
    return v[:, ids, :].copy()


def failure(x: pdkv.Transfer) -> str:
    try:
        x.wait(30)
    except pdkv.PdkvError as e:
        return str(e)
    raise AssertionError("the transfer should have failed")


def main() -> None:
    a, b = Side("dev-a", 1), Side("dev-b", 2)
    peer = a.agent.connect(b.agent.address)
    assert a.agent.peer_transport(peer) == "tcp", a.agent.peer_transport(peer)
    checks = []
    lids = [5, 9, 10, 11, 40, 2, 63, 17, 18, 30, 31, 32, 50, 1, 0, 44, 45, 46, 47, 12]
    rids = [60, 3, 4, 5, 20, 21, 22, 7, 8, 9, 33, 34, 35, 36, 37, 38, 39, 0, 1, 2]

    def write(src: str, dst: str, notif: bytes) -> None:
        want = blocks(a.pool(src), lids)
        x = a.agent.write(peer, pdkv.Blocks(src, lids), pdkv.Blocks(dst, rids), notify=notif)
        # The notification must find every byte already in place.
        got = b.agent.wait_notifications(timeout=30)
        if not got:
            x.wait(0)  # raises the transfer's error, if any
        assert [n.data for n in got] == [notif], got
        assert np.array_equal(blocks(b.pool(dst), rids), want), f"write {src}->{dst}: bytes differ at notification"
        assert x.wait(30), x.error
        assert x.bytes_done == x.bytes_total == len(lids) * GEOM.num_layers * GEOM.kv_parts * BB
        checks.append(f"write {src}->{dst}")

    def read(dst: str, src: str, ids: list[int], rids_: list[int]) -> None:
        want = blocks(b.pool(src), rids_)
        x = a.agent.read(peer, pdkv.Blocks(dst, ids), pdkv.Blocks(src, rids_))
        assert x.wait(30), x.error
        assert np.array_equal(blocks(a.pool(dst), ids), want), f"read {src}->{dst}: bytes differ"
        checks.append(f"read {src}->{dst}")

    write("dev", "dev", b"d2d")
    write("host", "dev", b"h2d")
    write("dev", "host", b"d2h")
    read("dev", "dev", lids, rids)
    read("host", "dev", lids[::-1], rids)
    read("dev", "host", lids, rids[::-1])
    # Whole pool at once: the responder's payload exceeds a chunk (dedicated buffer).
    every = list(range(GEOM.num_blocks))
    read("host", "dev", every, every)
    # A prepared device transfer posted again moves the current bytes.
    prep = a.agent.prepare("write", peer, pdkv.Blocks("dev", lids), pdkv.Blocks("dev", rids))
    for _ in range(3):
        MEM.htod(a.dev, np.random.default_rng(len(checks)).integers(0, 256, GEOM.pool_bytes, dtype=np.uint8))
        assert prep.post().wait(30)
        assert np.array_equal(blocks(b.pool("dev"), rids), blocks(a.pool("dev"), lids))
    checks.append("prepared reposted")

    if FAKE:
        # A failing device copy fails that transfer with the CUDA error, nothing else.
        LIB.fakecuda_fail_copies(1)  # the sender's gather
        err = failure(a.agent.write(peer, pdkv.Blocks("dev", lids), pdkv.Blocks("dev", rids), notify=b"never"))
        assert "CUDA error 700" in err, err
        LIB.fakecuda_fail_copies(1)  # the receiver's copy into device memory
        err = failure(a.agent.write(peer, pdkv.Blocks("host", lids), pdkv.Blocks("dev", rids), notify=b"never"))
        assert "device memory" in err and "700" in err, err
        assert b.agent.get_notifications() == [], "a failed transfer notified"
        write("dev", "dev", b"after-failure")
        checks.append("copy failures")
    # Cancelling a staged write in flight ends it (cancelled, or done if every batch
    # was already on the wire) without hanging; the agent keeps working.
    x = a.agent.write(peer, pdkv.Blocks("dev", lids), pdkv.Blocks("dev", rids))
    x.cancel()
    try:
        x.wait(30)
    except pdkv.Cancelled:
        pass
    write("dev", "dev", b"after-cancel")
    checks.append("cancel")
    # The peer going away in the middle of a staged write fails that transfer (or it
    # completed first), never the process; the agent then works with a new peer.
    x = a.agent.write(peer, pdkv.Blocks("dev", lids), pdkv.Blocks("dev", rids))
    b.agent.close()
    try:
        x.wait(30)
    except (pdkv.PeerConnectionError, pdkv.Cancelled):
        pass
    b = Side("dev-c", 3)
    peer = a.agent.connect(b.agent.address)
    write("dev", "dev", b"new-peer")
    checks.append("peer closed")
    a.agent.close()
    b.agent.close()
    stats = None
    if FAKE:  # after close: nothing leaked, nothing called without a context
        arr = (c_ulonglong * 32)()
        n = LIB.fakecuda_stats(arr, 32)
        stats = list(arr)[:n]
    print(json.dumps({"ok": True, "checks": checks, "stats": stats}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
