"""GB/s per transport and payload: scattered llama-3-8b block-halves (32 KiB), one
agent writing into another's pool (both in this process; the bytes still cross the
transport). Compare runs with `--benchmark-compare`; the CLI `pdkv bench transfer`
measures across processes with the raw ceilings in the same run."""

from __future__ import annotations

import numpy as np
import pytest

import pdkv
from pdkv.bench import models

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
    prep = a.prepare("write", peer, "kv", rng.permutation(blocks)[:n], "kv", rng.permutation(blocks)[:n])
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
