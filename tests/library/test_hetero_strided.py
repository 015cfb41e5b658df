"""Heterogeneous transfers whose fragmented side is the PEER (issue 14): pushing 2 heads
into a 4-head NHD block of the target, pulling a head range out of a peer's NHD blocks,
NHD <-> HND with the far side cut. The planner hands tcp and shm strided runs (one per
block and head at most, one per (layer, part) for consecutive block ids) instead of one
extent per token; tcp carries them as strided descriptors (docs/wire.md, flag 8) that
the target checks and scatters. The bytes that land are exactly the requested rows,
pushes and pulls, for every dtype, partial last blocks, scattered block ids and a
replicated GQA head; nothing outside them is written."""

from __future__ import annotations

import numpy as np
import pytest

import pdkv
from kvpools import Pool, PoolSpec

LAYERS, BLOCKS, D = 4, 48, 16

MODES = {  # name: (local style, T, H, remote style, T, H, heads moved, local offset, remote offset)
    "tp4:tp2 (2 heads into a 4-head NHD block)": ("nhd", 16, 2, "nhd", 16, 4, 2, 0, 2),
    "tp4:tp2+hnd:nhd": ("hnd", 16, 2, "nhd", 16, 4, 2, 0, 2),
    "tp4:tp2+bs16:bs32+nhd:hnd": ("nhd", 16, 2, "hnd", 32, 4, 2, 0, 2),
    "tp8:tp4+bs32:bs16": ("nhd", 32, 1, "nhd", 16, 2, 1, 0, 1),
    "gqa-replica (one head into slot 3 of an HND rank)": ("nhd", 16, 1, "hnd", 16, 4, 1, 0, 3),
    "vllm_cpu:nhd (cut)": ("vllm_cpu", 16, 2, "nhd", 16, 4, 2, 0, 1),
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
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("mode", list(MODES))
def test_peer_fragmented_transfers_are_bit_exact(mode, dtype, transport, op, ids):
    ls, lt, lh, rs, rt, rh, nh, lho, rho = MODES[mode]
    ntok = 20 * 16 - 5  # a partial last block on both sides
    nl, nr = -(-ntok // lt), -(-ntok // rt)
    if ids == "consecutive":
        lids, rids = list(range(2, 2 + nl)), list(range(1, 1 + nr))
    else:
        lids = list(range(BLOCKS - 1, BLOCKS - 1 - nl, -1))
        rids = [(5 * i + 3) % BLOCKS for i in range(nr)]
    pull = op == "read"
    with pdkv.Agent("a", secret="s", transports=[transport]) as a, \
            pdkv.Agent("b", secret="s", transports=[transport]) as b:
        lspec = PoolSpec(LAYERS, BLOCKS, lt, lh, D, dtype, ls)
        rspec = PoolSpec(LAYERS, BLOCKS, rt, rh, D, dtype, rs)
        local, remote = (Pool(lspec), Pool(rspec, 7)) if pull else (Pool(lspec, 7), Pool(rspec))
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
        prep = a.prepare(op, peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan)
        pieces = len(pdkv.plan_blocks(local.layout, lids, remote.layout, rids, plan=plan))
        # Strided runs: at most one per (layer, part, block, head), never one per token.
        assert prep.num_extents <= LAYERS * 2 * max(nl, nr) * nh
        assert prep.num_extents < pieces or pieces <= LAYERS * 2 * max(nl, nr)
        xfer = prep.post()
        xfer.wait(20)
        assert xfer.bytes_done == prep.nbytes
        if pull:
            check(remote, rids, local, lids, ntok, nh, rho, lho)
        else:
            check(local, lids, remote, rids, ntok, nh, lho, rho)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_consecutive_blocks_are_one_run_per_layer_part(transport):
    """A 2-head push into 4-head NHD blocks with consecutive ids: one strided run per
    (layer, part) (or fewer: layers that follow each other at one stride merge)."""
    with pdkv.Agent("a", secret="s", transports=[transport]) as a, \
            pdkv.Agent("b", secret="s", transports=[transport]) as b:
        local, remote = Pool(PoolSpec(LAYERS, BLOCKS, 16, 2, D, "bfloat16", "nhd"), 5), \
            Pool(PoolSpec(LAYERS, BLOCKS, 16, 4, D, "bfloat16", "nhd"))
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        ids = list(range(32))
        for op in ("write", "read"):
            prep = a.prepare(op, peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids),
                             plan=pdkv.PlanOptions(num_heads=2, remote_head_offset=2))
            assert prep.num_extents <= LAYERS * 2
            assert prep.nbytes == LAYERS * 2 * 32 * 16 * 2 * D * 2
            prep.post().wait(10)
        check(local, ids, remote, ids, 32 * 16, 2, 0, 2)



def test_a_compressed_push_into_a_peers_cut_blocks_is_bit_exact():
    """Compressed writes (kWriteZ) carry strided descriptors too: the codec frames decode
    into the pieces the target expanded from them."""
    from pdkv import codec

    opts = pdkv.TcpCompression(mode="lossless", codec="zstd" if codec.available("zstd") else "raw",
                               dtype="bfloat16", chunk_bytes=64 * 1024)
    with pdkv.Agent("a", secret="s", transports=["tcp"], options=[pdkv.TcpOptions(compress=opts)]) as a, \
            pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local, remote = Pool(PoolSpec(LAYERS, BLOCKS, 16, 2, D, "bfloat16", "nhd"), 9), \
            Pool(PoolSpec(LAYERS, BLOCKS, 16, 4, D, "bfloat16", "nhd"))
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        ids = list(range(40))
        x = a.prepare("write", peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids),
                      plan=pdkv.PlanOptions(num_heads=2, remote_head_offset=2)).post()
        assert x.wait(20), x.error
        assert x.compression != ""
        check(local, ids, remote, ids, 40 * 16, 2, 0, 2)


def test_a_peer_without_strided_extents_gets_every_piece_plain():
    """An older peer's tcp metadata extra lacks feature bit 1 (docs/wire.md): the sender
    expands the strided runs into plain extents for it (no flag 8 reaches it), and the
    bytes are the same."""
    import struct

    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local, remote = Pool(PoolSpec(LAYERS, BLOCKS, 16, 2, D, "float16", "nhd"), 4), \
            Pool(PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "nhd"))
        local.register(a)
        remote.register(b)
        blob = b.metadata()
        extra = pdkv.decode_metadata(blob)["extras"]["tcp"]
        magic, features = struct.unpack_from("<II", extra)
        assert features & 2, "this pdkv publishes strided extents"
        old = blob.replace(extra, struct.pack("<II", magic, features & ~2) + extra[8:])
        assert old != blob and not struct.unpack_from("<I", pdkv.decode_metadata(old)["extras"]["tcp"], 4)[0] & 2
        peer = a.add_peer(old)
        ids = list(range(8, 24))
        for op in ("write", "read"):
            x = a.prepare(op, peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids),
                          plan=pdkv.PlanOptions(num_heads=2, remote_head_offset=1)).post()
            assert x.wait(10), x.error
        check(local, ids, remote, ids, 16 * 16, 2, 0, 1)
