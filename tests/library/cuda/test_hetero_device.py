"""Heterogeneous transfers between DEVICE pools (issue 14), on the fake CUDA driver:
TP head splits (tp4:tp2, tp2:tp4), NHD <-> HND, block sizes (bs16:bs32), fp8 rows of
13 bytes and pools at unaligned addresses, pushed and pulled, over cuda_ipc and over
tcp with device staging. The planner hands both transports strided runs; device memory
now takes them as runs: one launch of the strided-copy kernel (cpp/src/cuda/
strided_copy.cu, run by the fake driver as host code from the same source) per batch,
no cuMemcpyAsync or batched-copy extent per piece.

Each case checks the bytes that land (exactly the requested rows and heads, nothing
else in the target blocks), and the fake driver's counters: the per-piece path is gone
(``kernel``); with PDKV_BENCH_DEVICE_PIECES=1 (``pieces``, the old path kept for
benchmarks) the same bytes land through one copy or batched-copy extent per piece,
which is what the ``kernel`` assertions would refuse.
"""

from __future__ import annotations

import struct

import pytest

import pdkv
from fake_gpu_peers import fake_peer  # noqa: F401  (fixture)
from kvpools import Pool, PoolSpec

LAYERS, BLOCKS = 2, 24

MODES = {  # name: (pusher spec kw, receiver spec kw, heads moved, pusher head offset, receiver head offset, alloc)
    "tp4:tp2": (dict(style="nhd", block_tokens=16, heads=2), dict(style="nhd", block_tokens=16, heads=4), 2, 0, 2,
                "per-array"),
    "tp2:tp4": (dict(style="nhd", block_tokens=16, heads=4), dict(style="nhd", block_tokens=16, heads=2), 2, 2, 0,
                "per-array"),
    "nhd:hnd": (dict(style="nhd", block_tokens=16, heads=2), dict(style="hnd", block_tokens=16, heads=4), 2, 0, 1,
                "per-array"),
    "bs16:bs32": (dict(style="nhd", block_tokens=16, heads=4), dict(style="hnd", block_tokens=32, heads=4), 4, 0, 0,
                  "per-array"),
    "fp8-13B-rows+unaligned": (dict(style="nhd", block_tokens=16, heads=2, head_dim=13, dtype="float8_e4m3fn"),
                               dict(style="hnd", block_tokens=16, heads=4, head_dim=13, dtype="float8_e4m3fn"), 1,
                               1, 3, "odd"),
}
PATHS = {"kernel": {}, "pieces": {"PDKV_BENCH_DEVICE_PIECES": "1"}}
SLOW = {"FAKECUDA_COPY_DELAY_US": "200"}


def specs(mode: str) -> tuple[PoolSpec, PoolSpec]:
    a, b, *_ = MODES[mode]
    base = dict(layers=LAYERS, blocks=BLOCKS, head_dim=16, dtype="float16")
    return PoolSpec(**{**base, **a}), PoolSpec(**{**base, **b})


def pieces_of(la: PoolSpec, lids, lb: PoolSpec, rids, **plan) -> int:
    """How many pieces the plan cuts the transfer into (each a copy on the old path)."""
    return len(pdkv.plan_blocks(Pool(la).layout, lids, Pool(lb).layout, rids, plan=pdkv.PlanOptions(**plan)))


def check_moved(src, sids, sh0, dst, dids, dh0, ntok, nh) -> None:
    want = src.call(cmd="rows", blocks=sids, ntok=ntok, h0=sh0, nh=nh)
    got = dst.call(cmd="rows", blocks=dids, ntok=ntok, h0=dh0, nh=nh)
    assert want["nonzero"], "the source rows are all zero: nothing would be checked"
    assert got["digest"] == want["digest"], "the rows that landed differ"
    assert got["rest_zero"], "bytes outside the requested rows were written"


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("transport", ["cuda_ipc", "tcp"])
@pytest.mark.parametrize("mode", list(MODES))
def test_hetero_device_push_and_pull_bit_exact(fake_peer, mode, transport, path):  # noqa: F811
    if path == "pieces" and mode not in ("tp4:tp2", "fp8-13B-rows+unaligned"):
        pytest.skip("the old path is checked on two modes")
    sa, sb = specs(mode)
    _, _, nh, ah0, bh0, alloc = MODES[mode]
    env = {**SLOW, **PATHS[path]}
    transports = "cuda_ipc,tcp" if transport == "cuda_ipc" else "tcp"
    # tcp: small staging chunks, so one transfer is many batches and pinned buffers end
    # inside pieces (13-byte rows, 64-byte head rows): the receiver's copy-out resumes mid-piece.
    a = fake_peer("hd-a", sa, 7, env=env, transports=transports, alloc=alloc, **{"stage-chunk": 4099})
    b = fake_peer("hd-b", sb, None, env=env, transports=transports, alloc=alloc, **{"stage-chunk": 4099})
    ntok = 6 * 16 - 5  # a partial last block
    na, nb = -(-ntok // sa.block_tokens), -(-ntok // sb.block_tokens)
    a_ids = [(3 * i + 1) % BLOCKS for i in range(na)]
    b_push = list(range(BLOCKS - 1, BLOCKS - 1 - nb, -1))
    b_pull = list(range(nb))
    assert not set(b_push) & set(b_pull)

    # Push: a writes its rows into b's blocks.
    plan = dict(num_tokens=ntok, num_heads=nh, local_head_offset=ah0, remote_head_offset=bh0)
    r = a.call(cmd="xfer", op="write", address=b.address, lblocks=a_ids, rblocks=b_push, plan=plan)
    assert r["ok"], r["error"]
    assert r["transport"] == transport
    check_moved(a, a_ids, ah0, b, b_push, bh0, ntok, nh)
    # Pull: b reads a's rows into other blocks of its own.
    plan = dict(num_tokens=ntok, num_heads=nh, local_head_offset=bh0, remote_head_offset=ah0)
    r = b.call(cmd="xfer", op="read", address=a.address, lblocks=b_pull, rblocks=a_ids, plan=plan)
    assert r["ok"], r["error"]
    check_moved(a, a_ids, ah0, b, b_pull, bh0, ntok, nh)

    n = pieces_of(sa, a_ids, sb, b_push, num_tokens=ntok, num_heads=nh, local_head_offset=ah0,
                  remote_head_offset=bh0)
    sa_, sb_ = a.stats(), b.stats()
    if sa_["module_loads"] == 0 and sb_["module_loads"] == 0 and path == "kernel":
        pytest.skip("pdkv was built without nvcc: no strided-copy kernel to emulate")
    # What each side copied piece by piece: cuMemcpyAsync calls and batched-copy extents.
    per_piece = [s["async_copies"] + s["batch_extents"] for s in (sa_, sb_)]
    launches = [s["strided_launches"] for s in (sa_, sb_)]
    if path == "kernel":
        assert per_piece == [0, 0], (per_piece, n)
        if transport == "cuda_ipc":  # the initiator copies: one launch per transfer
            assert launches == [1, 1], launches
        else:  # both sides stage: a launch per batch (several: 4099-byte chunks), far fewer than pieces
            assert 4 < sum(launches) < n, (launches, n)
    else:
        assert sum(launches) == 0
        assert sum(per_piece) >= n, (per_piece, n)
    for p in (a, b):
        st = p.call(cmd="close")["stats"]
        assert st["no_context_errors"] == 0 and st["live_pinned"] == 0 and st["live_streams"] == 0, st


def shrink_cuda_ipc_export(blob: bytes, new_len: int) -> bytes:
    """The metadata with the first region's cuda_ipc export (not its region entry) cut
    to ``new_len`` bytes: the agent's own checks pass, the transport must refuse."""
    extra = pdkv.decode_metadata(blob)["extras"]["cuda_ipc"]
    (n,) = struct.unpack_from("<I", extra)
    assert n >= 1
    patched = extra[:12] + struct.pack("<Q", new_len) + extra[20:]  # u32 count, u64 id, u64 len, ...
    assert blob.count(extra) == 1
    return blob.replace(extra, patched)


@pytest.mark.parametrize("op", ["write", "read"])
def test_cuda_ipc_refuses_a_run_outside_the_exported_region(fake_peer, op):  # noqa: F811
    sa, sb = specs("tp4:tp2")
    a = fake_peer("hx-a", sa, 7 if op == "write" else None)
    b = fake_peer("hx-b", sb, None if op == "write" else 7)
    blob = bytes.fromhex(b.call(cmd="metadata")["blob"])
    # Long enough for the first pieces of the runs, not their last ones.
    r = a.call(cmd="add_peer", address=b.address, blob=shrink_cuda_ipc_export(blob, 4096).hex())
    assert r["ok"], r["error"]
    ids = list(range(8))
    plan = dict(num_heads=2, local_head_offset=0, remote_head_offset=2)
    r = a.call(cmd="xfer", op=op, address=b.address, lblocks=ids, rblocks=ids, plan=plan)
    assert not r["ok"]
    assert "OutOfRange" in r["error"] and "exports through cuda_ipc" in r["error"], r["error"]
    target, tids = (b, ids) if op == "write" else (a, ids)
    got = target.call(cmd="rows", blocks=tids, ntok=8 * 16, h0=0, nh=2)
    assert not got["nonzero"] and got["rest_zero"], "bytes moved for a refused transfer"
    s = a.stats()
    assert s["strided_launches"] == 0 and s["async_copies"] == 0


@pytest.mark.parametrize("op", ["write", "read"])
def test_tcp_refuses_a_strided_run_outside_a_device_region(fake_peer, op):  # noqa: F811
    """A raw strided descriptor (docs/wire.md, flag 8) whose last piece falls past a
    device region: refused by name before any byte is staged or copied, the target's
    device memory untouched, and it keeps serving (a good heterogeneous push lands)."""
    import socket

    from test_bad_input import T_HELLO_ACK, T_READ_REQ, T_WRITE, authenticate, expect_error_and_close
    from test_hetero_strided_hostile import F_STRIDED, SEXT
    from test_hostile_tcp import raw_header

    sa, sb = specs("tp4:tp2")
    target = fake_peer("dv-target", sb, None, transports="tcp")
    good = fake_peer("dv-good", sa, 7, transports="tcp")
    region = pdkv.decode_metadata(bytes.fromhex(target.call(cmd="metadata")["blob"]))["regions"][0]
    assert region["kind"] == "cuda"
    host, port = target.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    try:
        assert authenticate(s, "s", target="dv-target")[0][1] == T_HELLO_ACK
        # 256-byte pieces every 512 bytes: the first inside, the last past the region's end.
        piece, stride = 256, 512
        count = region["len"] // stride + 1
        payload = piece * count if op == "write" else 0  # a consistent frame: only the region check refuses it
        s.sendall(raw_header(T_WRITE if op == "write" else T_READ_REQ, count=1, payload=payload, flags=F_STRIDED)
                  + SEXT.pack(region["id"], 0, piece, count, stride))
        expect_error_and_close(s, "OutOfRange", "outside")
    finally:
        s.close()
    every = list(range(BLOCKS))
    got = target.call(cmd="rows", blocks=every, ntok=BLOCKS * sb.block_tokens, h0=0, nh=sb.heads)
    assert not got["nonzero"], "bytes landed in device memory from a refused request"
    st = target.stats()
    assert st["strided_launches"] == 0 and st["async_copies"] == 0, st
    ids = list(range(8))
    r = good.call(cmd="xfer", op="write", address=target.address, lblocks=ids, rblocks=ids,
                  plan=dict(num_heads=2, local_head_offset=0, remote_head_offset=2))
    assert r["ok"], r["error"]
    check_moved(good, ids, 0, target, ids, 2, 8 * 16, 2)


def test_cuda_ipc_hetero_from_a_pageable_host_pool_goes_piece_by_piece(fake_peer):  # noqa: F811
    """The initiator's pool is pageable host memory, which a kernel cannot touch: the
    strided runs are copied piece by piece (cuMemcpyAsync), bit exact, no launch."""
    sa, sb = specs("tp2:tp4")
    _, _, nh, ah0, bh0, _ = MODES["tp2:tp4"]
    a = fake_peer("hh-a", sa, 7, memory="host")
    b = fake_peer("hh-b", sb, None)
    ids = list(range(6))
    plan = dict(num_heads=nh, local_head_offset=ah0, remote_head_offset=bh0)
    r = a.call(cmd="xfer", op="write", address=b.address, lblocks=ids, rblocks=ids, plan=plan)
    assert r["ok"], r["error"]
    assert r["transport"] == "cuda_ipc"
    check_moved(a, ids, ah0, b, ids, bh0, 6 * 16, nh)
    s = a.stats()
    assert s["strided_launches"] == 0 and s["kernel_launches"] == 0
    assert s["async_copies"] >= pieces_of(sa, ids, sb, ids, **plan)
