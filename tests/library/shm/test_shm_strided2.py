"""Two-level runs over shm (issue 14: prepare <= 1 ms in every heterogeneous mode).

NHD <-> HND with several heads moved cuts both token and head on one side, so a
one-level strided run covers one (block, head) at most: 327,680 runs for a 4K-token
llama-3-70b request. The shm transport takes two-level runs (caps
``two_level_extents``): one head's tokens repeated per block (consecutive ids: one run
per head and (layer, part)) or per head (scattered ids: one run per block). Checked
here: the compact form is what shm gets, and the bytes that land are exactly the
requested rows, push and pull, into Agent.alloc pools (memcpy through the mapping),
numpy pools (pages shared at registration; the partial pages at the edges by
cross-memory attach) and numpy pools with page sharing off (cross-memory attach only);
a two-level copy stops at its deadline or on cancel, and a deregistration during it
waits for it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pdkv
from conftest import SECRET, post_past_deadline
from kvpools import Pool, PoolSpec

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

LAYERS, BLOCKS, D = 2, 40, 16

MODES = {  # name: (local style, T, H, remote style, T, H, heads moved, local offset, remote offset)
    "nhd:hnd": ("nhd", 16, 4, "hnd", 16, 4, 4, 0, 0),
    "hnd:nhd": ("hnd", 16, 4, "nhd", 16, 4, 4, 0, 0),
    "tp2:tp4+nhd:hnd": ("nhd", 16, 4, "hnd", 16, 2, 2, 2, 0),
    "tp4:tp2+hnd:nhd": ("hnd", 16, 2, "nhd", 16, 4, 2, 0, 2),
    "tp4:tp2+bs16:bs32+nhd:hnd": ("nhd", 16, 2, "hnd", 32, 4, 2, 0, 2),
    "bs32:bs16+hnd:nhd": ("hnd", 32, 4, "nhd", 16, 4, 4, 0, 0),
    "tp2:tp4": ("nhd", 16, 4, "nhd", 16, 2, 2, 2, 0),
    "vllm_cpu:nhd (cut)": ("vllm_cpu", 16, 2, "nhd", 16, 4, 2, 0, 1),
}
# Where both sides cut the rows differently: the modes a one-level run cannot cover.
TWO_LEVEL = {"nhd:hnd", "hnd:nhd", "tp2:tp4+nhd:hnd", "tp4:tp2+hnd:nhd", "tp4:tp2+bs16:bs32+nhd:hnd",
             "bs32:bs16+hnd:nhd"}


def check(src, sids, dst, dids, ntok, nh, sho, dho):
    got = dst.logical(dids)[:, :, :ntok, dho:dho + nh]
    want = src.logical(sids)[:, :, :ntok, sho:sho + nh]
    assert want.any()
    assert np.array_equal(got, want)
    rest = dst.logical(dids).copy()
    rest[:, :, :ntok, dho:dho + nh] = 0
    assert not rest.any(), "bytes outside the requested rows were written"


def block_ids(ids: str, nl: int, nr: int) -> tuple[list[int], list[int]]:
    if ids == "consecutive":
        return list(range(2, 2 + nl)), list(range(1, 1 + nr))
    return list(range(BLOCKS - 1, BLOCKS - 1 - nl, -1)), [(7 * i + 3) % BLOCKS for i in range(nr)]


@pytest.mark.parametrize("ids", ["consecutive", "scattered"])
@pytest.mark.parametrize("memory", ["alloc", "numpy", "cma"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("mode", list(MODES))
def test_two_level_runs_are_bit_exact(mode, op, memory, ids):
    ls, lt, lh, rs, rt, rh, nh, lho, rho = MODES[mode]
    ntok = 20 * 16 - 5  # a partial last block on both sides
    nl, nr = -(-ntok // lt), -(-ntok // rt)
    lids, rids = block_ids(ids, nl, nr)
    pull = op == "read"
    # The target (b) keeps its numpy pages private with sharing off: cross-memory attach.
    bopts = pdkv.ShmOptions(share_pages_min_bytes=0) if memory == "cma" else None
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"], options=[bopts] if bopts else []) as b:
        lspec = PoolSpec(LAYERS, BLOCKS, lt, lh, D, "bfloat16", ls)
        rspec = PoolSpec(LAYERS, BLOCKS, rt, rh, D, "bfloat16", rs)
        la, ra = (a, b) if memory == "alloc" else (None, None)
        local = Pool(lspec, None if pull else 7, shared_by=la)
        remote = Pool(rspec, 7 if pull else None, shared_by=ra)
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
        prep = a.prepare(op, peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan)
        if mode in TWO_LEVEL:
            # At most one run per (layer, part, block): never one per (block, head).
            assert prep.num_extents <= LAYERS * 2 * max(nl, nr), prep.num_extents
            if ids == "consecutive" and mode != "bs32:bs16+hnd:nhd":
                # One per head, plus one for the partial last block.
                assert prep.num_extents <= LAYERS * 2 * (nh + 1), prep.num_extents
        xfer = prep.post()
        assert xfer.wait(30)
        assert xfer.bytes_done == prep.nbytes
        if pull:
            check(remote, rids, local, lids, ntok, nh, rho, lho)
        else:
            check(local, lids, remote, rids, ntok, nh, lho, rho)


BIG = PoolSpec(layers=4, blocks=128, block_tokens=16, heads=8, head_dim=128, dtype="float16")  # 64 MiB


def big_pools(a, b, kind):
    pa = Pool(BIG, 1, shared_by=a)
    pa.register(a)
    hnd = PoolSpec(**{**BIG.to_dict(), "style": "hnd"})
    pb = Pool(hnd, None, shared_by=b if kind == "alloc" else None)
    pb.register(b)
    return pa, pb


@pytest.mark.parametrize("kind", ["alloc", "cma"])
def test_two_level_copies_stop_at_their_deadline_or_on_cancel(kind):
    """nhd:hnd copies (two-level ops) queued behind each other fail with
    TransferTimeout once their deadline passed (checked every few MiB during the
    copy), cancelled ones with Cancelled; the next transfer lands bit-exact."""
    bopts = pdkv.ShmOptions(share_pages_min_bytes=0) if kind == "cma" else None
    with pdkv.Agent("a", secret=SECRET, options=[pdkv.ShmOptions(inline_bytes=0)]) as a, \
            pdkv.Agent("b", secret=SECRET, options=[bopts] if bopts else []) as b:
        pa, pb = big_pools(a, b, kind)
        peer = a.connect(b.address)
        assert a.peer_transport(peer) == "shm"
        prep = a.prepare("write", peer, pdkv.Blocks("kv", range(128)), pdkv.Blocks("kv", range(128)))
        assert prep.num_extents == BIG.layers * 2 * BIG.blocks  # two-level runs: a block's heads in one (32 KiB spans)
        assert prep.post(timeout=60).wait(60)  # regions confirmed: what follows times out in the copy
        xs, _ = post_past_deadline(prep, 8)  # ~512 MiB of scattered 256-byte rows
        ys = [prep.post(timeout=60) for _ in range(3)]
        for y in ys:
            y.cancel()
        outcomes = []
        for x in xs + ys:
            try:
                outcomes.append(x.wait(60))
            except pdkv.TransferTimeout as e:
                outcomes.append("timeout")
                assert "timed out during the copy" in str(e)
            except pdkv.Cancelled:
                outcomes.append("cancelled")
        assert "timeout" in outcomes[:8], outcomes
        assert all(o in (True, "timeout") for o in outcomes[:8]), outcomes
        assert all(o in (True, "cancelled") for o in outcomes[8:]), outcomes
        pa.fill(9)
        assert a.write(peer, pdkv.Blocks("kv", [3, 4]), pdkv.Blocks("kv", [9, 10]), timeout=30).wait(30)
        assert pb.digest([9, 10]) == pa.digest([3, 4])


def test_deregistration_waits_for_a_two_level_copy():
    with pdkv.Agent("a", secret=SECRET, options=[pdkv.ShmOptions(inline_bytes=0)]) as a, \
            pdkv.Agent("b", secret=SECRET) as b:
        big_pools(a, b, "alloc")
        peer = a.connect(b.address)
        prep = a.prepare("write", peer, pdkv.Blocks("kv", range(128)), pdkv.Blocks("kv", range(128)))
        assert prep.num_extents == BIG.layers * 2 * BIG.blocks
        xs = [prep.post() for _ in range(6)]
        done_at_dereg = []

        def dereg():
            for r in b.regions:
                r.close()
            done_at_dereg.append(sum(x.done for x in xs))

        th = threading.Thread(target=dereg)
        th.start()
        th.join(60)
        # When b's deregistration returned, a was no longer copying into b's memory.
        assert done_at_dereg == [6]
        for x in xs:
            try:
                assert x.wait(10)
            except pdkv.NotFound as e:
                assert "deregistered" in str(e)


def test_a_layer_wise_stream_into_hnd_blocks_lands_bit_exact():
    """A streaming write prepares each batch of layers like a write: two-level runs too."""
    ls, lt, lh, rs, rt, rh, nh, lho, rho = MODES["tp2:tp4+nhd:hnd"]
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b:
        local = Pool(PoolSpec(4, BLOCKS, lt, lh, D, "float16", ls), 5, shared_by=a)
        remote = Pool(PoolSpec(4, BLOCKS, rt, rh, D, "float16", rs), None, shared_by=b)
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        lids, rids = list(range(3, 13)), list(range(20, 30))
        s = a.open_stream(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids),
                          plan=pdkv.PlanOptions(num_heads=nh, local_head_offset=lho, remote_head_offset=rho),
                          notify=b"r", timeout=30)
        for layer in (2, 0, 3, 1):
            s.post_layers(layer)
        x = s.close()
        assert x.wait(30) and x.bytes_done == x.bytes_total
        assert [n.data for n in b.wait_notifications(10)] == [b"r"]
        check(local, lids, remote, rids, 10 * lt, nh, lho, rho)


@pytest.mark.parametrize("memory", ["alloc", "numpy", "cma"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("style", ["interleaved", "cross_layer"])
@pytest.mark.parametrize("mode", ["tp2:tp4", "tp4:tp2", "3 of 4 heads"])
def test_scattered_ids_in_one_region_pools_are_one_run_per_block(mode, style, op, memory):
    """A pool that is one region with its (layer, part) segments evenly spaced (K/V
    interleaved per block, or vLLM's cross-layer blocks): with scattered block ids each
    block's run repeats in every segment at one distance, so shm gets one two-level run
    per block (per part where K and V sit apart) instead of one per block and
    segment, and the rows land bit-exact (numpy pools: the runs cross the shared
    window's edges; cma: cross-memory attach only)."""
    layers = 6
    lh, rh, nh, lho, rho = {"tp2:tp4": (4, 2, 2, 2, 0), "tp4:tp2": (2, 4, 2, 0, 2),
                            "3 of 4 heads": (4, 4, 3, 1, 0)}[mode]
    ntok = 12 * 16 - 5
    nl = nr = -(-ntok // 16)
    lids, rids = block_ids("scattered", nl, nr)
    pull = op == "read"
    bopts = pdkv.ShmOptions(share_pages_min_bytes=0) if memory == "cma" else None
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"], options=[bopts] if bopts else []) as b:
        la, ra = (a, b) if memory == "alloc" else (None, None)
        local = Pool(PoolSpec(layers, BLOCKS, 16, lh, D, "bfloat16", style), None if pull else 5, shared_by=la)
        remote = Pool(PoolSpec(layers, BLOCKS, 16, rh, D, "bfloat16", style), 5 if pull else None, shared_by=ra)
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
        prep = a.prepare(op, peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan)
        groups = 2 if style == "interleaved" else 1
        assert prep.num_extents <= groups * max(nl, nr), prep.num_extents  # was layers * 2 * blocks
        for _ in range(2):  # the second post reuses the bound ops
            xfer = prep.post()
            assert xfer.wait(30)
            assert xfer.bytes_done == prep.nbytes
        if pull:
            check(remote, rids, local, lids, ntok, nh, rho, lho)
        else:
            check(local, lids, remote, rids, ntok, nh, lho, rho)
