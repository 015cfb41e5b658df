"""Heterogeneous transfers staged through a local buffer (cpp/src/core/relayout.h): the
wire carries few, large extents and the bytes that land are exactly the requested
rows, pushes and pulls, over tcp and shm (which takes the direct plan: its copies cost
what their bytes cost), for every dtype, partial last blocks and head offsets.

tcp takes two-level runs, so it is handed the direct plan too (agent.cc prepare_staged:
NHD <-> HND is a few runs per head, not one per (block, head)); under the benchmark
switch PDKV_BENCH_TCP_ONE_LEVEL=1 it takes one-level runs and stages as it did before.
The tests that need tcp to stage run in a child process with the switch set
(test_tcp_stages_with_one_level_runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import pdkv
from kvpools import Pool, PoolSpec

LAYERS, BLOCKS, D = 8, 64, 16
TCP_STAGES = os.environ.get("PDKV_BENCH_TCP_ONE_LEVEL") == "1"
needs_tcp_staging = pytest.mark.skipif(not TCP_STAGES, reason="tcp stages only with one-level runs: checked by "
                                       "test_tcp_stages_with_one_level_runs in a child process")


def pools(a: pdkv.Agent, b: pdkv.Agent, lspec: PoolSpec, rspec: PoolSpec, seed: int = 3, pull: bool = False):
    local, remote = (Pool(lspec), Pool(rspec, seed)) if pull else (Pool(lspec, seed), Pool(rspec))
    local.register(a)
    remote.register(b)
    return local, remote, a.add_peer(b.metadata())


def check(local, lids, remote, rids, ntok, nh, lho, rho):
    got = remote.logical(rids)[:, :, :ntok, rho:rho + nh]
    want = local.logical(lids)[:, :, :ntok, lho:lho + nh]
    assert want.any()
    assert np.array_equal(got, want)
    rest = remote.logical(rids).copy()
    rest[:, :, :ntok, rho:rho + nh] = 0
    assert not rest.any(), "bytes outside the requested rows were written"


MODES = {  # name: (local style, T, H, remote style, T, H, heads moved, local offset, remote offset)
    "nhd:hnd": ("nhd", 16, 4, "hnd", 16, 4, 4, 0, 0),
    "tp2:tp4": ("nhd", 16, 4, "nhd", 16, 2, 2, 2, 0),
    "nhd:hnd+bs16:bs8": ("nhd", 16, 4, "hnd", 8, 4, 4, 0, 0),
    "vllm_cpu:nhd": ("vllm_cpu", 16, 4, "nhd", 16, 4, 4, 0, 0),
    "gqa-replica": ("nhd", 16, 4, "hnd", 16, 2, 1, 3, 1),  # one head into slot 1 of a 2-head rank
}


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("mode", list(MODES))
def test_staged_transfers_are_bit_exact(op, transport, dtype, mode):
    ls, lt, lh, rs, rt, rh, nh, lho, rho = MODES[mode]
    ntok = 32 * 16 - 5  # a partial last block on both sides
    with pdkv.Agent("a", secret="s", transports=[transport]) as a, \
            pdkv.Agent("b", secret="s", transports=[transport]) as b:
        local, remote, peer = pools(a, b, PoolSpec(LAYERS, BLOCKS, lt, lh, D, dtype, ls),
                                    PoolSpec(LAYERS, BLOCKS, rt, rh, D, dtype, rs), pull=op == "read")
        lids = list(range(BLOCKS - 1, BLOCKS - 1 - -(-ntok // lt), -1))  # descending: no two consecutive
        rids = [(3 * i + 1) % BLOCKS for i in range(-(-ntok // rt))]
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
        prep = a.prepare(op, peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan)
        direct = pdkv.plan_blocks(local.layout, lids, remote.layout, rids, plan=plan)
        if transport == "shm":  # a memcpy engine: staging would add a copy (TransportCaps.direct_small_extents);
            # it takes the direct plan as strided runs (one per run of pieces, never more than the pieces)
            assert prep.num_extents <= len(direct)
        else:
            assert prep.num_extents * 4 <= len(direct), "the transfer was not staged"
        assert prep.nbytes == sum(e[4] for e in direct)
        xfer = prep.post()
        xfer.wait(10)
        assert xfer.bytes_done == prep.nbytes
        if op == "write":
            check(local, lids, remote, rids, ntok, nh, lho, rho)
        else:
            check(remote, rids, local, lids, ntok, nh, rho, lho)


@pytest.mark.skipif(TCP_STAGES, reason="(this is the child)")
def test_tcp_stages_with_one_level_runs():
    """This file again, in a child process where tcp takes one-level runs (and so stages)."""
    env = dict(os.environ, PDKV_BENCH_TCP_ONE_LEVEL="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" in r.stdout  # (the child skips only this test)


@needs_tcp_staging
def test_each_post_gathers_the_rows_as_they_are_then():
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local, remote, peer = pools(a, b, PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "nhd"),
                                    PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "hnd"))
        ids = list(range(BLOCKS))  # 4096 direct runs (block x head x segment): staged
        prep = a.prepare("write", peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids))
        assert prep.num_extents < 64
        for seed in (1, 2):
            local.fill(seed)
            prep.post().wait(10)
            check(local, ids, remote, ids, len(ids) * 16, 4, 0, 0)


@needs_tcp_staging
def test_a_staged_pull_from_a_gone_peer_fails_and_writes_nothing():
    with pdkv.Agent("a", secret="s", transports=["tcp"], default_timeout=5.0) as a:
        with pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
            local, remote, peer = pools(a, b, PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "nhd"),
                                        PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "hnd"), pull=True)
            ids = list(range(BLOCKS))  # 4096 direct runs (block x head x segment): staged
            prep = a.prepare("read", peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids))
            assert prep.num_extents < 64
        with pytest.raises(pdkv.PdkvError):
            prep.post(timeout=5.0).wait(20)
        assert not local.logical(ids).any()
        # The buffer is free again: the next post fails the same way instead of waiting.
        with pytest.raises(pdkv.PdkvError):
            prep.post(timeout=5.0).wait(20)


@needs_tcp_staging
@pytest.mark.parametrize("op", ["write", "read"])
def test_posts_of_one_staged_transfer_take_turns(op):
    """Posts from several threads share one staging buffer: each gathers only once the
    previous one is done, and every one lands whole."""
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local, remote, peer = pools(a, b, PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "nhd"),
                                    PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "hnd"), pull=op == "read")
        ids = list(range(BLOCKS))  # 4096 direct runs (block x head x segment): staged
        prep = a.prepare(op, peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids))
        errors = []

        def post():
            try:
                for _ in range(5):
                    prep.post().wait(10)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=post) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        if op == "write":
            check(local, ids, remote, ids, len(ids) * 16, 4, 0, 0)
        else:
            check(remote, ids, local, ids, len(ids) * 16, 4, 0, 0)


def test_small_or_whole_block_plans_are_not_staged():
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local, remote, peer = pools(a, b, PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "nhd"),
                                    PoolSpec(LAYERS, BLOCKS, 8, 4, D, "float16", "nhd"))
        # bs16 -> bs8: whole runs already, nothing to gain.
        prep = a.prepare("write", peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [0, 1, 2, 3]),
                         plan=pdkv.PlanOptions(num_tokens=32))
        assert prep.num_extents == len(pdkv.plan_blocks(local.layout, [0, 1], remote.layout, [0, 1, 2, 3],
                                                        plan=pdkv.PlanOptions(num_tokens=32)))
        # A small NHD -> HND push (below the staging threshold) keeps the direct plan.
        remote2 = Pool(PoolSpec(1, BLOCKS, 16, 4, D, "float16", "hnd"))
        local2 = Pool(PoolSpec(1, BLOCKS, 16, 4, D, "float16", "nhd"), 1)
        remote2.register(b, "small")
        local2.register(a, "small")
        peer = a.add_peer(b.metadata())
        prep = a.prepare("write", peer, pdkv.Blocks("small", [0]), pdkv.Blocks("small", [0]))
        assert len(pdkv.plan_blocks(local2.layout, [0], remote2.layout, [0])) == 2 * 16 * 4
        # The direct plan as strided runs: one per (part, head), 16 tokens each; as two-level
        # runs (what tcp takes unless switched off) one per part, a head's tokens repeated per head.
        assert prep.num_extents == (2 * 4 if TCP_STAGES else 2)
        prep.post().wait(10)
        assert np.array_equal(remote2.logical([0]), local2.logical([0]))


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_layer_range_moves_only_those_layers(op):
    """Agent.prepare/write/read take first_layer/num_layers: only those layers move,
    staged or not, and a range beyond the layouts is refused."""
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local, remote, peer = pools(a, b, PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "nhd"),
                                    PoolSpec(LAYERS, BLOCKS, 16, 4, D, "float16", "hnd"), pull=op == "read")
        src, dst = (local, remote) if op == "write" else (remote, local)
        ids = list(range(40))
        whole = a.prepare(op, peer, pdkv.Blocks("kv", ids))
        prep = a.prepare(op, peer, pdkv.Blocks("kv", ids), plan=pdkv.PlanOptions(first_layer=2, num_layers=3))
        assert prep.nbytes * LAYERS == whole.nbytes * 3
        prep.post().wait(10)
        got, want = dst.logical(ids), src.logical(ids)
        assert np.array_equal(got[2:5], want[2:5]) and want[2:5].any()
        assert not got[:2].any() and not got[5:].any()
        # The rest from layer 5 on (num_layers 0: through the last layer), with write()/read().
        getattr(a, op)(peer, pdkv.Blocks("kv", ids), plan=pdkv.PlanOptions(first_layer=5)).wait(10)
        assert np.array_equal(dst.logical(ids)[2:], want[2:]) and not dst.logical(ids)[:2].any()
        for bad in (pdkv.PlanOptions(first_layer=LAYERS), pdkv.PlanOptions(first_layer=2, num_layers=LAYERS - 1)):
            with pytest.raises(pdkv.OutOfRange, match="exceed the 8 layers"):
                a.prepare(op, peer, pdkv.Blocks("kv", ids), plan=bad)
        with pytest.raises(pdkv.InvalidArgument, match="first_layer"):
            a.prepare(op, peer, pdkv.Blocks("kv", ids), plan=pdkv.PlanOptions(first_layer=-1))
