"""TP head splits whose pieces are small on the receiving side (issue 14, the speed
half): tcp lands strided pieces under 4 KiB in a per-connection buffer and scatters
them with streaming stores (transport/tcp/scatter.h, util/piece_copy.h), larger ones
are received straight into place; shm copies a strided run's pieces with the same
streaming stores, and tcp's staged plans fill and empty their staging buffer so.
These tests take both sides of the threshold, pieces whose destinations are not
16-byte aligned (the memcpy fallback), push and pull with either side cut, tcp and
shm, and peers that die while a landed strided payload is in flight.

tcp walks strided runs lazily (the sender gathers a run's pieces into its chunk, the
receiver scatters them out of its landing chunk, never listing one iovec per piece),
so a TP head split goes direct over tcp at any size; the larger cases below are the
ones that were staged before, now moved by the lazy walk, push and pull, with and
without compression (codecs list a batch's pieces when they need them)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pdkv
from conftest import SECRET, freeze
from kvpools import Pool, PoolSpec
from test_bad_input import T_ACK, T_WRITE, recv_frame
from test_hostile_tcp import REGION, raw_header, target  # noqa: F401 (fixture)

LAYERS, BLOCKS = 2, 24

CASES = {  # name: (head_dim, dtype, heads (narrow side, wide side), heads moved, head offset on the wide side)
    # 512-byte pieces at a 1 KiB stride: the llama-3-70b-tp8 tp4:tp2 shape, landed
    "512B-landed": (128, "bfloat16", (2, 4), 2, 2),
    # 2000-byte pieces: landed, a tail of 16-byte streaming stores
    "2000B-landed": (500, "float16", (1, 3), 1, 1),
    # 600-byte pieces at 200-byte head offsets: destinations not 16-byte aligned
    "600B-unaligned": (100, "float16", (3, 5), 3, 1),
    # 13-byte fp8 pieces: under one streaming block, memcpy only
    "13B-fp8": (13, "float8_e4m3fn", (1, 4), 1, 3),
    # 8 KiB pieces: above the landing threshold, received straight into place
    "8KiB-direct": (1024, "float32", (2, 4), 2, 2),
}


def check(src, sids, dst, dids, ntok, nh, sho, dho):
    got = dst.logical(dids)[:, :, :ntok, dho:dho + nh]
    want = src.logical(sids)[:, :, :ntok, sho:sho + nh]
    assert want.any()
    assert np.array_equal(got, want)
    rest = dst.logical(dids).copy()
    rest[:, :, :ntok, dho:dho + nh] = 0
    assert not rest.any(), "bytes outside the requested rows were written"


@pytest.mark.parametrize("ids", ["consecutive", "scattered"])
@pytest.mark.parametrize("cut", ["receiver", "sender"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("case", list(CASES))
def test_small_and_large_strided_pieces_are_bit_exact(case, transport, op, cut, ids):
    """`cut`: which end holds the pieces at a stride (the side with more heads): the
    receiver (a push into a peer's wider blocks, a pull into ours: landed and
    scattered) or the sender (gathered)."""
    d, dtype, (narrow, wide), nh, off = CASES[case]
    ntok = 16 * 16 - 3  # a partial last block
    n = -(-ntok // 16)
    if ids == "consecutive":
        lids, rids = list(range(3, 3 + n)), list(range(1, 1 + n))
    else:
        lids = list(range(BLOCKS - 1, BLOCKS - 1 - n, -1))
        rids = [(7 * i + 2) % BLOCKS for i in range(n)]
    pull = op == "read"
    local_wide = (cut == "receiver") == pull  # the receiver of a pull is this side
    lh, rh = (wide, narrow) if local_wide else (narrow, wide)
    lho, rho = (off, 0) if local_wide else (0, off)
    with pdkv.Agent("a", secret="s", transports=[transport]) as a, \
            pdkv.Agent("b", secret="s", transports=[transport]) as b:
        lspec = PoolSpec(LAYERS, BLOCKS, 16, lh, d, dtype, "nhd")
        rspec = PoolSpec(LAYERS, BLOCKS, 16, rh, d, dtype, "nhd")
        local, remote = (Pool(lspec), Pool(rspec, 11)) if pull else (Pool(lspec, 11), Pool(rspec))
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
        x = a.prepare(op, peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan).post()
        assert x.wait(30), x.error
        if pull:
            check(remote, rids, local, lids, ntok, nh, rho, lho)
        else:
            check(local, lids, remote, rids, ntok, nh, lho, rho)


def test_the_tp4_tp2_pair_of_pushes_into_one_block_is_bit_exact():
    """Two prefill ranks (2 heads each) push into one 4-head decode block, both in
    flight together: each lands its own half of every 1 KiB row, over tcp and shm."""
    for transport in ("tcp", "shm"):
        with pdkv.Agent("p", secret="s", transports=[transport]) as p, \
                pdkv.Agent("d", secret="s", transports=[transport]) as dec:
            srcs = [Pool(PoolSpec(LAYERS, BLOCKS, 16, 2, 128, "bfloat16", "nhd"), 20 + r) for r in range(2)]
            dst = Pool(PoolSpec(LAYERS, BLOCKS, 16, 4, 128, "bfloat16", "nhd"))
            for r, s in enumerate(srcs):
                s.register(p, f"rank{r}")
            dst.register(dec)
            peer = p.add_peer(dec.metadata())
            ids = list(range(BLOCKS))
            xs = [p.prepare("write", peer, pdkv.Blocks(f"rank{r}", ids), pdkv.Blocks("kv", ids),
                            plan=pdkv.PlanOptions(num_heads=2, remote_head_offset=2 * r)).post()
                  for r in range(2)]
            for x in xs:
                assert x.wait(30), x.error
            for r, s in enumerate(srcs):
                assert np.array_equal(dst.logical(ids)[:, :, :, 2 * r:2 * r + 2], s.logical(ids))


# ---------------------------------------------------------------- peers that die mid-landing
DOOMED = textwrap.dedent(f"""
    import json, sys, numpy as np, pdkv
    with pdkv.Agent("doomed", secret={SECRET!r}, transports=["tcp"]) as t:
        mem = np.full(64 << 20, 3, np.uint8)
        r = t.register(mem)
        print(json.dumps({{"address": t.address, "region": r.id}}), flush=True)
        sys.stdin.read()
""")


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_peer_killed_mid_landing_fails_only_that_transfer(op):
    """A target process killed while a strided transfer of 512-byte pieces is in flight
    (its receiver landing them, or its read response being landed by us): the transfer
    fails with a named error, the agent carries on, and its next strided transfer to a
    live peer is bit-exact."""
    with pdkv.Agent("init", secret=SECRET, transports=["tcp"]) as a, \
            pdkv.Agent("good", secret=SECRET, transports=["tcp"]) as good:
        mem = np.random.default_rng(5).integers(0, 256, 64 << 20, dtype=np.uint8)
        rs = a.register(mem)
        proc = subprocess.Popen([sys.executable, "-c", DOOMED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            info = json.loads(proc.stdout.readline())
            doomed = a.connect(info["address"])
            # 32 MiB in 512-byte pieces: ours contiguous, the peer's at a 1 KiB stride.
            ext = [(rs.id, i * 512, info["region"], i * 1024, 512) for i in range((32 << 20) // 512)]
            prep = a.prepare_extents(op, doomed, ext)
            freeze(proc.pid)  # it stops mid-stream: the frame stays half-moved
            x = prep.post(timeout=30)
            proc.kill()
            with pytest.raises((pdkv.PeerConnectionError, pdkv.TransferTimeout)):
                x.wait(30)
        finally:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()
        # The same agent, a live peer, the same shape of transfer: every byte in place.
        dst = np.zeros(8 << 20, np.uint8)
        rd = good.register(dst)
        peer = a.connect(good.address)
        ext = [(rs.id, i * 512, rd.id, i * 1024, 512) for i in range((4 << 20) // 512)]
        assert a.prepare_extents("write", peer, ext).post(timeout=30).wait(30)
        assert np.array_equal(dst.reshape(-1, 2, 512)[:, 0], mem[:4 << 20].reshape(-1, 512))
        assert not dst.reshape(-1, 2, 512)[:, 1].any()
        back = np.zeros(4 << 20, np.uint8)
        rb = a.register(back)
        ext = [(rb.id, i * 512, rd.id, i * 1024, 512) for i in range((4 << 20) // 512)]
        assert a.prepare_extents("read", peer, ext).post(timeout=30).wait(30)
        assert np.array_equal(back, mem[:4 << 20])


SEXT = struct.Struct("<QQQQQ")  # region, offset, len, count, stride
F_STRIDED = 8


def test_a_raw_initiator_dying_mid_landed_strided_payload(target):  # noqa: F811
    """A valid strided Write of 512-byte pieces at a 1 KiB stride (landed), half its
    payload, then the socket closes: nothing outside the pieces is written, the target
    serves the next client, and a complete strided write from a new connection lands
    every piece exactly."""
    rid = target["victim"].id
    count = REGION // 1024
    payload = bytes(np.random.default_rng(8).integers(0, 256, count * 512, dtype=np.uint8))
    desc = SEXT.pack(rid, 0, 512, count, 1024)
    s = target["connect"]()
    head = raw_header(T_WRITE, count=1, payload=len(payload), flags=F_STRIDED) + desc
    s.sendall(head + payload[:len(payload) // 2 + 99])
    s.close()
    assert target["serves"]()
    mem = target["mem"][:REGION].reshape(-1, 2, 512)
    assert not mem[:, 1].any()
    s = target["connect"]()
    s.sendall(head + payload)
    h, _ = recv_frame(s)
    assert h[1] == T_ACK and h[8] == 0
    assert np.array_equal(mem[:, 0].reshape(-1), np.frombuffer(payload, np.uint8))
    assert not mem[:, 1].any()


# ---------------------------------------------------------------- large TP splits: the lazy walk
# 4 layers x 128 blocks of 16 tokens: the direct plan has 16k+ pieces, which tcp
# used to stage; it now takes the runs as they are.
BIG_LAYERS, BIG_BLOCKS = 4, 128


@pytest.mark.parametrize("compress", [None, "lossless"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
@pytest.mark.parametrize("ids", ["consecutive", "scattered"])
@pytest.mark.parametrize("split", ["tp2:tp4", "tp4:tp2"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_large_tp_splits_over_tcp_walk_the_runs_bit_exact(op, split, ids, dtype, compress):
    """tp2:tp4: the prefill rank (4 heads) sends 2 of them to a decode rank (2 heads);
    tp4:tp2: a prefill rank (2 heads) fills half of each 4-head decode row. A push runs
    from the prefill side, a pull from the decode side; a partial last block."""
    wide_prefill = split == "tp2:tp4"
    ntok = BIG_BLOCKS * 16 - 7
    n = -(-ntok // 16)
    if ids == "consecutive":
        pids, dids = list(range(n)), list(range(n))
    else:
        pids = list(range(BIG_BLOCKS - 1, BIG_BLOCKS - 1 - n, -1))
        dids = [(5 * i + 1) % BIG_BLOCKS for i in range(n)]
    pspec = PoolSpec(BIG_LAYERS, BIG_BLOCKS, 16, 4 if wide_prefill else 2, 128, dtype, "nhd")
    dspec = PoolSpec(BIG_LAYERS, BIG_BLOCKS, 16, 2 if wide_prefill else 4, 128, dtype, "nhd")
    pho, dho = (2, 0) if wide_prefill else (0, 2)
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        prefill, decode = Pool(pspec, 13), Pool(dspec)
        if op == "write":
            prefill.register(a)
            decode.register(b)
            lids, rids, lho, rho = pids, dids, pho, dho
        else:
            decode.register(a)
            prefill.register(b)
            lids, rids, lho, rho = dids, pids, dho, pho
        peer = a.add_peer(b.metadata())
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=2, local_head_offset=lho, remote_head_offset=rho)
        prep = a.prepare(op, peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan,
                         options=pdkv.XferOptions(compress=compress))
        # Direct: the transport got the planner's runs (one per block or block range and
        # (layer, part)), not a staging buffer's.
        assert prep.num_extents <= 2 * BIG_LAYERS * n
        for _ in range(2):  # a prepared transfer posts again with the same result
            x = prep.post()
            assert x.wait(60), x.error
            check(prefill, pids, decode, dids, ntok, 2, pho, dho)


DOOMED_KV = textwrap.dedent(f"""
    import json, sys, numpy as np, pdkv
    with pdkv.Agent("doomedkv", secret={SECRET!r}, transports=["tcp"]) as t:
        parts = [np.full(({BIG_BLOCKS}, 16, 2, 128), 3, np.uint16) for _ in range({2 * BIG_LAYERS})]
        for p in parts:
            t.register(p)
        t.add_layout("kv", pdkv.KVLayout.from_tensors(parts[0::2], parts[1::2], order="NHD", dtype="bfloat16"))
        print(json.dumps({{"address": t.address}}), flush=True)
        sys.stdin.read()
""")


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_peer_killed_mid_lazy_tp_split_fails_and_the_next_one_lands(op):
    """A large TP split (our 4-head rows, heads 2..3, against a 2-head peer) with a
    process that is stopped, then killed, mid-transfer: the transfer fails with a named
    error; the same transfer with a live peer lands every byte."""
    with pdkv.Agent("init", secret=SECRET, transports=["tcp"]) as a:
        mine = Pool(PoolSpec(BIG_LAYERS, BIG_BLOCKS, 16, 4, 128, "bfloat16", "nhd"), None if op == "read" else 19)
        mine.register(a)
        ids = list(range(BIG_BLOCKS))
        plan = pdkv.PlanOptions(num_heads=2, local_head_offset=2)
        proc = subprocess.Popen([sys.executable, "-c", DOOMED_KV], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            info = json.loads(proc.stdout.readline())
            doomed = a.connect(info["address"])
            prep = a.prepare(op, doomed, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids), plan=plan)
            freeze(proc.pid)  # it stops mid-stream: a frame stays half-moved
            x = prep.post(timeout=30)
            proc.kill()
            with pytest.raises((pdkv.PeerConnectionError, pdkv.TransferTimeout)):
                x.wait(30)
        finally:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()
        with pdkv.Agent("good", secret=SECRET, transports=["tcp"]) as good:
            theirs = Pool(PoolSpec(BIG_LAYERS, BIG_BLOCKS, 16, 2, 128, "bfloat16", "nhd"), 17 if op == "read" else None)
            theirs.register(good)
            peer = a.add_peer(good.metadata())
            x = a.prepare(op, peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids), plan=plan).post()
            assert x.wait(60), x.error
            assert np.array_equal(mine.logical(ids)[:, :, :, 2:4], theirs.logical(ids))
