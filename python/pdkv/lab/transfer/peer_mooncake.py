"""Mooncake Transfer Engine in a peer-library benchmark: the target and initiator roles
its two children play (TCP protocol, ``P2PHANDSHAKE`` metadata; see
:mod:`pdkv.lab.transfer.peers` for the traps). Mooncake is imported only inside the
roles, that is only in a child."""

from __future__ import annotations

from typing import Any

import numpy as np

from pdkv.lab.transfer.peer_child import (cpu_meter, cpu_s, expect, latency_loop, timed_loop, touched_zeros,
                                          verify, workload_of)
from pdkv.lab.transfer.peer_common import Channel

__all__ = ["MC_QUEUE_MAX", "initiator", "target"]

#: Mooncake's TCP per-peer queue limits (defaults 1024 + 1024, maximum 65535 each).
MC_QUEUE_MAX = 65535


def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize returned {rc}")
    return te


def target(chan: Channel) -> None:
    """The Mooncake target: registers a zeroed pool, sends its session, verifies it when told."""
    msg = expect(chan, "setup")
    w = workload_of(msg)
    te = _mooncake_engine()
    pool = touched_zeros(w.payload_bytes)
    rc = te.register_memory(pool.ctypes.data, pool.nbytes)
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory returned {rc}")
    chan.send({"session": f"127.0.0.1:{te.get_rpc_port()}", "base": pool.ctypes.data})
    # Mooncake's TCP path has no completion notification in its Python API; the caller
    # sends "verify" only after the initiator saw every write complete.
    expect(chan, "verify")
    ok, bad = verify(w, pool)
    chan.send({"verified": ok, "mismatched_blocks": bad, "cpu_s": cpu_s()})
    expect(chan, "exit")
    te.unregister_memory(pool.ctypes.data)


def initiator(chan: Channel) -> None:
    """The Mooncake initiator: writes the workload into the target's pool, sends the timings."""
    msg = expect(chan, "run")
    w = workload_of(msg)
    tinfo = msg["target"]
    te = _mooncake_engine()
    src = w.source_pool()
    rc = te.register_memory(src.ctypes.data, src.nbytes)
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory returned {rc}")
    session = tinfo["session"]
    base = int(tinfo["base"])
    bs = w.block_bytes
    perm = w.permutation()
    srcs = (src.ctypes.data + np.arange(w.num_blocks, dtype=np.int64) * bs).tolist()
    dsts = (base + perm * bs).tolist()
    lens = [bs] * w.num_blocks
    chunks = [
        (srcs[s : s + MC_QUEUE_MAX], dsts[s : s + MC_QUEUE_MAX], lens[s : s + MC_QUEUE_MAX])
        for s in range(0, w.num_blocks, MC_QUEUE_MAX)
    ]

    def post_batch() -> None:
        for c in chunks:  # one chunk unless a batch exceeds Mooncake's queue maximum
            rc = te.batch_transfer_sync_write(session, *c)
            if rc != 0:
                raise RuntimeError(
                    f"Mooncake batch_transfer_sync_write of {len(c[0])} blocks failed "
                    f"(returned {rc})"
                )

    post_batch()  # warm-up
    with cpu_meter(tinfo).measure() as timed_cpu:
        elapsed = timed_loop(post_batch, w.iters)

    def single(b: int) -> None:
        rc = te.transfer_sync_write(session, srcs[b], dsts[b], bs)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer_sync_write failed (returned {rc})")

    lat = latency_loop(single, w.latency_blocks())
    chan.send({"gbps": w.payload_bytes * w.iters / elapsed / 1e9, "lat_us": lat, "cpu_s": cpu_s(),
               "cpu_timed_s": timed_cpu.by_process})
    expect(chan, "exit")
    te.unregister_memory(src.ctypes.data)
