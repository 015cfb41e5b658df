"""GB/s per transport and payload: scattered llama-3-8b block-halves (32 KiB), one
agent writing into another's pool (both in this process; the bytes still cross the
transport). Compare runs with `--benchmark-compare`; the CLI `pdkv bench transfer`
measures across processes with the raw ceilings in the same run."""

from __future__ import annotations

import numpy as np
import pytest

import pdkv
from pdkv.lab.transfer import models

PAYLOADS = {"64M": 64 << 20, "256M": 256 << 20}


@pytest.fixture(scope="module", params=[t for t in ("tcp", "shm") if t in pdkv.available_transports()])
def pair(request):
    t = request.param
    blocks = max(PAYLOADS.values()) // (2 << 20) + 1
    geo = models.geometry("llama-3-8b", blocks)
    with pdkv.Agent("bench-a", secret="b", transports=[t, "tcp"] if t != "tcp" else ["tcp"]) as a, \
            pdkv.Agent("bench-b", secret="b", transports=[t, "tcp"] if t != "tcp" else ["tcp"]) as b:
        pools = []
        for ag in (a, b):
            buf = ag.alloc(geo.pool_bytes).array()
            buf[:] = 1
            ag.add_layout("kv", pdkv.KVLayout.contiguous(geo, buf))
            pools.append(buf)
        peer = a.connect(b.address, transport=t)
        yield t, a, peer, blocks


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_write_scattered_blocks(benchmark, pair, payload):
    t, a, peer, blocks = pair
    n = PAYLOADS[payload] // (2 << 20)
    rng = np.random.default_rng(0)
    prep = a.prepare("write", peer, pdkv.Blocks("kv", rng.permutation(blocks)[:n]),
                     pdkv.Blocks("kv", rng.permutation(blocks)[:n]))
    prep.post().wait(60)
    benchmark.extra_info.update(transport=t, payload_bytes=prep.nbytes, extents=prep.num_extents)
    benchmark.pedantic(lambda: prep.post().wait(60), rounds=5, iterations=1)
    benchmark.extra_info["gbps"] = prep.nbytes / benchmark.stats["mean"] / 1e9


def test_write_one_block_half_latency(benchmark, pair):
    t, a, peer, blocks = pair
    info = a.peer_info(peer)["layouts"]["kv"].segments[0]
    seg = a.layout("kv").segments[0]
    prep = a.prepare_extents("write", peer, [(seg["region_id"], seg["region_offset"], info["region_id"],
                                              info["region_offset"], 32 << 10)])
    benchmark.extra_info.update(transport=t, payload_bytes=32 << 10)
    benchmark(lambda: prep.post().wait(10))


# ---------------------------------------------------------------- heterogeneous (pdkv.lab.transfer.hetero)
HETERO = ["tp2:tp4", "tp4:tp2", "bs16:bs32", "nhd:hnd"]


@pytest.fixture(scope="module", params=[t for t in ("tcp", "shm") if t in pdkv.available_transports()])
def hetero_pair(request):
    t = request.param
    with pdkv.Agent("hetero-a", secret="b", transports=[t, "tcp"] if t != "tcp" else ["tcp"]) as a, \
            pdkv.Agent("hetero-b", secret="b", transports=[t, "tcp"] if t != "tcp" else ["tcp"]) as b:
        yield t, a, b, a.connect(b.address, transport=t)


@pytest.mark.parametrize("kind", ["hetero", "homogeneous"])
@pytest.mark.parametrize("spec", HETERO)
def test_write_hetero_16M(benchmark, hetero_pair, spec, kind):
    """Decode rank 0 of llama-3-8b receiving 16 MiB pushed by its prefill ranks (--hetero
    SPEC), or the homogeneous write of the same bytes; verified after timing."""
    from pdkv.lab.transfer import hetero

    t, a, b, peer = hetero_pair
    plan = hetero.Plan(hetero.parse_spec(spec, "llama-3-8b"), "llama-3-8b")
    n_dst = plan.dst_blocks_for(16 << 20)
    region = b.alloc(plan.dst_geometry(2 * n_dst).pool_bytes)
    b.add_layout("kv", pdkv.KVLayout.contiguous(plan.dst_geometry(2 * n_dst), region.array()))
    a.remove_peer(peer)
    peer = a.connect(b.address, transport=t)  # sees the new layout
    req = hetero.make_request(plan, 16 << 20, 2 * n_dst, 0)
    pools = hetero.make_pools(a, plan, len(req.src_ids), n_dst, 0)
    try:
        expected = hetero.reference(plan, pools.src, req.src_ids, req.tokens)
        hetero.store(pools.hom[0], pools.hom[1], req.hom_local, expected)
        if kind == "hetero":
            preps = [a.prepare("write", peer, pdkv.Blocks(f"src{p.prefill_rank}", req.src_ids),
                               pdkv.Blocks("kv", req.het_ids), plan=hetero._push_plan(plan, p, req.tokens))
                     for p in plan.pushes]
        else:
            preps = [a.prepare("write", peer, pdkv.Blocks("hom", req.hom_local), pdkv.Blocks("kv", req.hom_ids))]
        hetero.time_round(preps)
        benchmark.extra_info.update(transport=t, spec=spec, kind=kind, payload_bytes=sum(p.nbytes for p in preps),
                                    extents=sum(p.num_extents for p in preps))
        benchmark.pedantic(lambda: hetero.time_round(preps), rounds=5, iterations=1)
        if benchmark.stats:  # None under --benchmark-disable
            benchmark.extra_info["gbps"] = benchmark.extra_info["payload_bytes"] / benchmark.stats["mean"] / 1e9
        args = type("Args", (), {"corrupt_reference": False})()
        assert hetero.verify(args, a, peer, pools, expected, [req.het_ids if kind == "hetero" else req.hom_ids])
    finally:
        pools.close(a)
        b.remove_layout("kv")
        region.close()
