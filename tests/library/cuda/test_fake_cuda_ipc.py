"""cuda_ipc between two processes over a fake GPU (tests/fakecuda): runs without one.

Each agent runs in a child process (fake_peer.py) whose PDKV_CUDA_DRIVER names the
fake driver: device memory that is not host-accessible, asynchronous streams and
events, CUDA IPC through /proc/<pid>/fd, the batched-copy kernel emulated. Copies
are slowed (FAKECUDA_COPY_DELAY_US) so a notification sent before its bytes landed
would be caught. Not marked ``cuda``: these run in every ``pytest``.

The fake driver itself is built by the ``fakecuda_path`` fixture (tests/conftest.py);
``fake_peer`` comes from tests/fake_gpu_peers.py (shared with tests/library/test_fault_contract.py)
rather than a tests/library/cuda/conftest.py: test modules import tests/conftest.py as
``conftest``, and a second conftest.py would shadow it.
"""

from __future__ import annotations

import random
import time

import pytest

import pdkv

from fake_gpu_peers import fake_peer  # noqa: F401  (fixture)
from kvpools import PoolSpec

SPEC = dict(layers=2, blocks=64, block_tokens=4, heads=2, head_dim=16, dtype="float16")
SLOW = {"FAKECUDA_COPY_DELAY_US": "2000"}
PATHS = {"kernel": {}, "fallback": {"FAKECUDA_NO_KERNEL": "1"}}


def scattered(seed, n: int = 40, blocks: int = 64) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(blocks), n), rng.sample(range(blocks), n)


def write_expecting(init, target, lids, rids, notif: str, wait: float = 10, **xfer) -> tuple[dict, dict]:
    """Writes with a notification while ``target`` checks the bytes the moment it arrives
    (waiting up to ``wait`` seconds for it)."""
    want = init.call(cmd="digest", blocks=lids)["digest"]
    target.send(cmd="expect", items=[{"notif": notif, "blocks": rids, "digest": want}], timeout=wait)
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=lids, rblocks=rids, notify=notif, **xfer)
    return r, target.recv(30)


def spec_arrays(spec: PoolSpec) -> list:
    """The pool's arrays (one device allocation each in a per-array peer)."""
    from kvpools import Pool

    return Pool(spec).arrays


def assert_path(stats: dict, path: str) -> None:
    if path == "kernel":
        if stats["module_loads"] == 0:
            pytest.skip("pdkv was built without nvcc: no batched-copy kernel to emulate")
        assert stats["kernel_launches"] > 0
    else:
        assert stats["module_loads"] == 0 and stats["kernel_launches"] == 0
        assert stats["async_copies"] > 0


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("style", ["vllm", "hnd"])
def test_write_then_read_bit_exact(fake_peer, path, style):
    spec = PoolSpec(style=style, **SPEC)
    env = {**SLOW, **PATHS[path]}
    # The target's arrays share one allocation (torch's caching allocator): each region
    # exports the same IPC handle at its own offset.
    target = fake_peer("target", spec, 1, env=env, alloc="one")
    init = fake_peer("init", spec, 2, env=env)
    assert "cuda_ipc" in init.available
    lids, rids = scattered(style)
    r, got = write_expecting(init, target, lids, rids, "w1")
    assert r["ok"], r["error"]
    assert r["peer_transport"] == "cuda_ipc" and r["transport"] == "cuda_ipc"
    assert got == {"results": [{"notif": "w1", "ok": True}], "missing": []}

    # Read other blocks back into other local blocks, notifying the target afterwards;
    # the prepared transfer is posted twice.
    lids2, rids2 = scattered(style + "read", 24)
    target.send(cmd="expect", items=[{"notif": "r1", "blocks": [], "digest": None}], timeout=10)
    r = init.call(cmd="xfer", op="read", address=target.address, lblocks=lids2, rblocks=rids2, notify="r1",
                  repeat=2)
    assert r["ok"], r["error"]
    assert target.recv(30)["missing"] == []
    assert init.call(cmd="digest", blocks=lids2) == target.call(cmd="digest", blocks=rids2)

    s = init.stats()
    assert_path(s, path)
    assert s["ipc_opens"] == 1 and s["live_ipc_mappings"] == 1  # one allocation, opened once
    assert target.stats()["ipc_opens"] == 0
    closed = init.call(cmd="close")["stats"]
    assert closed["live_ipc_mappings"] == 0, str(closed)
    assert closed["live_streams"] == 0 and closed["live_events"] == 0
    assert closed["live_allocs"] == len(spec_arrays(spec))  # descriptor buffers freed
    assert closed["no_context_errors"] == 0


@pytest.mark.parametrize("path", list(PATHS))
def test_back_to_back_writes_each_notify_after_their_bytes(fake_peer, path):
    """Several transfers in flight on one stream; every notification after its own bytes."""
    spec = PoolSpec(style="vllm", **SPEC)
    env = {**SLOW, **PATHS[path]}
    target = fake_peer("target", spec, 1, env=env)
    init = fake_peer("init", spec, 2, env=env)
    lids, rids = scattered(11, 64)
    items = [{"lblocks": lids[i::8], "rblocks": rids[i::8], "notify": f"n{i}"} for i in range(8)]
    expect = [{"notif": it["notify"], "blocks": it["rblocks"],
               "digest": init.call(cmd="digest", blocks=it["lblocks"])["digest"]} for it in items]
    target.send(cmd="expect", items=expect, timeout=20)
    r = init.call(cmd="burst", address=target.address, items=items)
    assert r["ok"], r["error"]
    got = target.recv(30)
    assert got["missing"] == [] and all(x["ok"] for x in got["results"]), got
    assert_path(init.stats(), path)


@pytest.mark.parametrize("path", list(PATHS))
def test_host_pool_to_device_pool(fake_peer, path):
    """The initiator's pool is pageable host memory (not GPU-visible); the target's is on the GPU."""
    spec = PoolSpec(style="nhd", **SPEC)
    env = {**SLOW, **PATHS[path]}
    target = fake_peer("target", spec, 1, env=env)
    init = fake_peer("init", spec, 2, env=env, memory="host")
    lids, rids = scattered(7)
    r, got = write_expecting(init, target, lids, rids, "h1")
    assert r["ok"], r["error"]
    assert r["transport"] == "cuda_ipc"
    assert got["results"] == [{"notif": "h1", "ok": True}]
    r = init.call(cmd="xfer", op="read", address=target.address, lblocks=lids[:10], rblocks=rids[10:20])
    assert r["ok"], r["error"]
    assert init.call(cmd="digest", blocks=lids[:10]) == target.call(cmd="digest", blocks=rids[10:20])
    assert init.stats()["kernel_launches"] == 0  # a kernel cannot touch pageable memory


@pytest.mark.parametrize("style", ["vllm", "hnd"])
def test_device_pools_over_tcp_between_processes(fake_peer, style):
    """GPU pools in two processes that only share tcp (as across hosts): staged
    through pinned buffers both ways, bit exact, notification after the bytes."""
    spec = PoolSpec(style=style, **SPEC)
    target = fake_peer("target", spec, 1, env=SLOW, transports="tcp")
    init = fake_peer("init", spec, 2, env=SLOW, transports="tcp")
    lids, rids = scattered(12)
    r, got = write_expecting(init, target, lids, rids, "over-tcp")
    assert r["ok"] and r["transport"] == "tcp", r
    assert got == {"results": [{"notif": "over-tcp", "ok": True}], "missing": []}
    r = init.call(cmd="xfer", op="read", address=target.address, lblocks=lids[:15], rblocks=rids[20:35])
    assert r["ok"], r["error"]
    assert init.call(cmd="digest", blocks=lids[:15]) == target.call(cmd="digest", blocks=rids[20:35])
    for p in (init, target):
        st = p.stats()
        # Staged by the strided-copy kernel (one launch per batch), or piece by piece without it.
        assert st["async_copies"] + st["strided_launches"] > 0, st
        assert st["ipc_opens"] == 0 and st["no_context_errors"] == 0, st


@pytest.mark.parametrize("path", list(PATHS))
def test_copy_failure_fails_the_transfer_and_the_agent_recovers(fake_peer, path):
    spec = PoolSpec(style="nhd", **SPEC)
    target = fake_peer("target", spec, 1, env=PATHS[path])
    init = fake_peer("init", spec, 2, env=PATHS[path])
    lids, rids = scattered(3)
    # A copy fails on the stream: reported by the event, the notification withheld.
    r, got = write_expecting(init, target, lids, rids, "bad", wait=1, fail_after_prepare=1)
    assert not r["ok"]
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in r["error"], r["error"]
    assert got["missing"] == ["bad"], "notification sent although the copy failed"
    # A read fails the same way.
    r = init.call(cmd="xfer", op="read", address=target.address, lblocks=lids, rblocks=rids, fail_after_prepare=1)
    assert not r["ok"] and "CUDA_ERROR_ILLEGAL_ADDRESS" in r["error"], r["error"]
    # A failure while preparing (the kernel path uploads its descriptors then).
    init.call(cmd="fail_copies", n=1)
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=lids[:5], rblocks=rids[:5])
    assert not r["ok"] and "CUDA_ERROR_ILLEGAL_ADDRESS" in r["error"], r["error"]
    assert init.stats()["failed_copies"] == 3
    # The agent keeps working: the same transfer, bit exact.
    r, got = write_expecting(init, target, lids, rids, "good")
    assert r["ok"], r["error"]
    assert got == {"results": [{"notif": "good", "ok": True}], "missing": []}
    assert init.call(cmd="close")["stats"]["live_ipc_mappings"] == 0


def test_control_socket_rejects_bad_input_and_keeps_serving(fake_peer, tmp_path):
    """The cuda_ipc control socket (revocation channel) is an entry point too: garbage,
    a wrong secret, a stale instance, a non-hello first frame and a client that never
    speaks are refused, and the exporter keeps serving real importers."""
    import glob
    import socket
    import struct

    spec = PoolSpec(style="vllm", **SPEC)
    target = fake_peer("target", spec, 1, env={"PDKV_SHM_DIR": str(tmp_path)})
    [path] = glob.glob(str(tmp_path / "target-*.cuda.sock"))
    instance = int(path.rsplit("-", 1)[1].split(".")[0], 16)

    def frame(type_: int, aux: bytes = b"", magic: int = 0x434B4450) -> bytes:
        return struct.pack("<IHHQII", magic, type_, 0, 0, len(aux), 0) + aux

    def hello(secret: str | None = None, inst: int = instance, version: int = 2) -> bytes:
        """A hello (no secret: a nonce and an ephemeral key); with `secret`, exchange()
        answers the exporter's challenge with a proof made with it."""
        def s(x: str) -> bytes:
            return struct.pack("<I", len(x)) + x.encode()
        hs = pdkv._native.module().InitiatorHandshake("cuda_ipc", 2, "mallory")
        hellos[0] = (hs, secret)
        return frame(1, struct.pack("<HQ", version, inst) + s("mallory") + hs.nonce + hs.pub)

    hellos: list = [None]

    def exchange(data: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            c.connect(path)
            c.sendall(data)
            hs, secret = hellos[0] or (None, None)
            hellos[0] = None
            out = b""
            while True:  # until the exporter closes (or answers and we stop)
                try:
                    chunk = c.recv(4096)
                except ConnectionResetError:  # closed with our bytes unread
                    return out
                if not chunk:
                    return out
                out += chunk
                if len(out) >= 24 and struct.unpack_from("<H", out, 4)[0] == 6 and hs is not None:
                    aux_len = struct.unpack_from("<I", out, 16)[0]
                    if len(out) < 24 + aux_len:
                        continue
                    aux = out[24:24 + aux_len]  # the challenge: prove (maybe a wrong secret)
                    inst_t, n = struct.unpack_from("<QI", aux)
                    proof = hs.answer(aux[12:12 + n].decode(), inst_t, aux[12 + n:44 + n], aux[44 + n:76 + n],
                                      (secret or "").encode() or b"?")
                    c.sendall(frame(7, proof))
                    out, hs = b"", None
                    continue
                if len(out) >= 24 and struct.unpack_from("<H", out, 4)[0] == 2:
                    return out  # hello-ack: accepted

    def error_of(reply: bytes) -> str:
        assert len(reply) >= 24, reply
        magic, type_, _, _, aux_len, _ = struct.unpack_from("<IHHQII", reply)
        assert magic == 0x434B4450 and type_ == 5, reply  # an error frame, then closed
        return reply[24:24 + aux_len].decode()

    assert exchange(b"\x00" * 24 + b"garbage") == b""  # bad magic: dropped
    assert "first control frame must be a hello" in error_of(exchange(frame(3)))
    assert "wrong secret" in error_of(exchange(hello("nope")))
    assert "restarted" in error_of(exchange(hello("s", inst=instance + 1)))
    assert "first control frame must be a hello" in error_of(exchange(frame(7, b"\0" * 32)))  # a proof first
    assert "version 9" in error_of(exchange(hello("s", version=9)))
    assert "malformed hello" in error_of(exchange(frame(1, b"\x01\x00")))
    assert exchange(frame(1, b"x" * 5000)) == b""  # oversized aux: dropped
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.settimeout(15)
        silent.connect(path)
        assert silent.recv(1) == b""  # never said hello: closed after the handshake timeout
    # A correct hello is accepted.
    assert struct.unpack_from("<H", exchange(hello("s")), 4)[0] == 2
    # Real importers are unaffected.
    init = fake_peer("init", spec, 2)
    lids, rids = scattered(11)
    r, got = write_expecting(init, target, lids, rids, "still-serving")
    assert r["ok"] and r["transport"] == "cuda_ipc", r
    assert got == {"results": [{"notif": "still-serving", "ok": True}], "missing": []}


def test_peer_death_fails_transfers_without_crashing(fake_peer):
    spec = PoolSpec(style="vllm", **SPEC)
    target = fake_peer("target", spec, 1)
    init = fake_peer("init", spec, 2)
    lids, rids = scattered(5)
    r, got = write_expecting(init, target, lids, rids, "before")
    assert r["ok"] and got["missing"] == []
    target.kill()
    # The mapping outlives the exporter (as with CUDA), but the notification has no way
    # to reach it: the transfer fails.
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=lids, rblocks=rids, notify="after")
    assert not r["ok"], r
    assert "Connection" in r["error"] or "connect" in r["error"], r["error"]
    # A restarted target at a new address: the initiator's agent still works.
    target2 = fake_peer("target", spec, 3)
    r, got = write_expecting(init, target2, lids, rids, "again")
    assert r["ok"], r["error"]
    assert got == {"results": [{"notif": "again", "ok": True}], "missing": []}
    assert init.stats()["live_ipc_mappings"] >= 1


def test_deregistering_revokes_importers_after_their_copies_finish(fake_peer):
    """The exporter's deregistration waits until every importer's copies in flight have
    landed and its mapping is closed; afterwards the importer refuses to touch it."""
    spec = PoolSpec(style="vllm", **SPEC)
    target = fake_peer("target", spec, 1)
    # Slow per-extent copies on the importer: ~0.8 s of copies in flight.
    init = fake_peer("init", spec, 2, env={"FAKECUDA_COPY_DELAY_US": "5000", "FAKECUDA_NO_KERNEL": "1"})
    lids, rids = scattered(7)
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=lids, rblocks=rids, keep="p")
    assert r["ok"] and r["transport"] == "cuda_ipc", r
    assert init.stats()["live_ipc_mappings"] >= 1
    # Different bytes in flight (a burst of writes from other blocks), then deregister.
    items = [{"lblocks": lids[i:i + 10], "rblocks": rids[i:i + 10]} for i in range(0, 40, 10)]
    src = [b for it in items for b in it["lblocks"]]
    want = init.call(cmd="digest", blocks=src)["digest"]
    assert init.call(cmd="post_async", address=target.address, items=items)["posted"] == 4
    elapsed = target.call(cmd="deregister")["elapsed"]
    # Every copy posted before the revocation landed before deregistration returned...
    assert target.call(cmd="digest", blocks=rids)["digest"] == want
    assert init.call(cmd="wait_async") == {"ok": True, "error": None}
    assert elapsed > 0.05, elapsed  # it did wait for them
    # ... and nothing lands afterwards: the importer closed its mappings,
    assert init.stats()["live_ipc_mappings"] == 0
    # refuses a prepared transfer that targets the revoked region,
    r = init.call(cmd="xfer", op="write", address=target.address, reuse="p")
    assert not r["ok"] and r["error"].startswith("NotFound") and "deregistered" in r["error"], r
    # and refuses to prepare against the stale metadata.
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=lids, rblocks=rids)
    assert not r["ok"] and r["error"].startswith("NotFound") and "deregistered" in r["error"], r
    assert target.call(cmd="digest", blocks=rids)["digest"] == want


def test_deregistering_with_no_importer_or_a_dead_one_does_not_wait(fake_peer):
    spec = PoolSpec(style="vllm", **SPEC)
    target = fake_peer("target", spec, 1)
    init = fake_peer("init", spec, 2)
    lids, rids = scattered(8)
    assert init.call(cmd="xfer", op="write", address=target.address, lblocks=lids, rblocks=rids)["ok"]
    init.kill()
    assert target.call(cmd="deregister")["elapsed"] < 5


def test_transfers_to_a_dead_exporter_fail_even_without_a_notification(fake_peer):
    spec = PoolSpec(style="vllm", **SPEC)
    target = fake_peer("target", spec, 1)
    init = fake_peer("init", spec, 2)
    lids, rids = scattered(9)
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=lids, rblocks=rids, keep="p")
    assert r["ok"] and r["transport"] == "cuda_ipc", r
    target.kill()
    # The importer notices the control connection drop (asynchronously).
    for _ in range(50):
        r = init.call(cmd="xfer", op="write", address=target.address, reuse="p")
        if not r["ok"]:
            break
        time.sleep(0.1)
    assert not r["ok"] and r["error"].startswith("PeerConnectionError") and "gone" in r["error"], r


def test_a_removed_peers_prepared_transfer_fails_instead_of_writing(fake_peer):
    """remove_peer drops the peer's mappings; a transfer prepared before must not write
    through the mapping it still holds."""
    spec = PoolSpec(style="vllm", **SPEC)
    target = fake_peer("target", spec, 1)
    init = fake_peer("init", spec, 2)
    lids, rids = scattered(10)
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=lids, rblocks=rids, keep="p")
    assert r["ok"] and r["transport"] == "cuda_ipc", r
    assert init.call(cmd="remove_peer", address=target.address) == {"ok": True}
    r = init.call(cmd="xfer", op="write", address=target.address, reuse="p")
    assert not r["ok"] and r["error"].startswith("PeerConnectionError") and "gone" in r["error"], r


def test_same_process_agents_use_tcp_staging_not_cuda_ipc(fake_peer):
    """CUDA refuses IPC handles in the process that made them; cuda_ipc must not claim such a peer."""
    spec = PoolSpec(style="nhd", **SPEC)
    p = fake_peer("solo", spec, 1)
    r = p.call(cmd="same_process_pair")
    assert r["peer_transport"] == "tcp"
    # ... and tcp carries device memory through pinned staging buffers, bit exact.
    assert r["ok"] and r["error"] is None, r
