"""Several tcp progress threads and connections per peer, driven from several Python
threads at once, with connections opened and closed while data moves.

This is the workload ``scripts/sanitize.sh tsan`` runs under ThreadSanitizer (the
plain run checks the same results): every connection an agent accepts is handed to
one of its progress threads while others are busy, transfers from different callers
share connections, and notifications arrive from many peers.
"""

from __future__ import annotations

import threading

import numpy as np

import pdkv
from conftest import SECRET
from kvpools import Pool, PoolSpec

SPEC = PoolSpec(layers=2, blocks=64, block_tokens=4, heads=2, head_dim=16, dtype="float16")
N_INIT = 3
SLICE = 16  # initiator i writes target blocks [i * SLICE, (i + 1) * SLICE) from its blocks [0, SLICE)
TAIL = N_INIT * SLICE  # target blocks [TAIL, 64) are only read
ROUNDS = 6


def _tcp(threads: int, conns: int) -> pdkv.TcpOptions:
    # Small batches: one transfer spreads over every connection and thread.
    return pdkv.TcpOptions(progress_threads=threads, conns_per_peer=conns, batch_bytes=8 << 10, batch_extents=3)


def _run_threads(fns) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts), "a worker thread hung"
    if errors:
        raise errors[0]


def test_many_initiators_write_and_read_concurrently_while_peers_come_and_go():
    with pdkv.Agent("target", secret=SECRET, options=[_tcp(3, 2)], transports=["tcp"]) as target:
        tpool = Pool(SPEC, 100)
        tpool.register(target)
        agents = [pdkv.Agent(f"init{i}", secret=SECRET, options=[_tcp(2, 3)], transports=["tcp"]) for i in range(N_INIT)]
        try:
            pools = [Pool(SPEC, i + 1) for i in range(N_INIT)]
            for a, p in zip(agents, pools):
                p.register(a)
            peers = [a.connect(target.address) for a in agents]
            expected = dict.fromkeys(range(SPEC.blocks))  # target block -> bytes it must hold

            def initiator(i: int):
                a, p, peer = agents[i], pools[i], peers[i]
                for r in range(ROUNDS):
                    lids = [(r * 2 + k) % SLICE for k in range(2)]
                    rids = [i * SLICE + b for b in lids]
                    x = a.write(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), notify=f"w{i}.{r}")
                    assert x.wait(60) and x.state is pdkv.XferState.DONE, x.error
                    expected.update({rb: p.logical([lb]) for lb, rb in zip(lids, rids)})
                    # Read a block of the target's untouched tail into this pool's upper half.
                    x = a.read(peer, pdkv.Blocks("kv", [SLICE + r]), pdkv.Blocks("kv", [TAIL + r]))
                    assert x.wait(60), x.error

            def churn():
                # Short-lived peers: each connection the target accepts is added to one
                # of its progress threads while they carry the initiators' transfers.
                for r in range(ROUNDS):
                    with pdkv.Agent(f"churn{r}", secret=SECRET, options=[_tcp(1, 2)], transports=["tcp"]) as c:
                        peer = c.connect(target.address)
                        c.notify(peer, f"c{r}")

            notes: list[str] = []
            want = {f"w{i}.{r}" for i in range(N_INIT) for r in range(ROUNDS)} | {f"c{r}" for r in range(ROUNDS)}

            def collect():
                while not want <= set(notes):
                    got = target.wait_notifications(timeout=60)
                    assert got, f"notifications missing: {sorted(want - set(notes))}"
                    notes.extend(n.data.decode() for n in got)

            _run_threads([lambda i=i: initiator(i) for i in range(N_INIT)] + [churn, collect])

            assert sorted(notes) == sorted(want)  # each exactly once
            for block, data in expected.items():
                if data is not None:
                    assert np.array_equal(tpool.logical([block]), data), f"target block {block}"
            for i, p in enumerate(pools):
                for r in range(ROUNDS):
                    assert np.array_equal(p.logical([SLICE + r]), tpool.logical([TAIL + r])), (i, r)
        finally:
            for a in agents:
                a.close()
