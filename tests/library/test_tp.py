"""pdkv.tp: the TP mapping against a brute-force head assignment, its input checks,
and real agents moving KV between TP groups with its output (bit-exact)."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import numpy as np
import pytest

import pdkv
from pdkv.errors import InvalidArgument
from pdkv.tp import HeadRange, TPMapping, heads_of_rank

from kvpools import Pool, PoolSpec

TPS = (1, 2, 4, 8, 16)
HEADS = (1, 2, 4, 8, 16, 32)


def held(tp: int, kv_heads: int, rank: int) -> list[int]:
    """Brute force: the global heads a rank holds, by the engines' rule stated head by head."""
    if tp <= kv_heads:
        return [h for h in range(kv_heads) if h * tp // kv_heads == rank]
    return [h for h in range(kv_heads) if rank * kv_heads // tp == h]


def expand(t, mine: list[int], theirs: list[int]) -> list[tuple[int, int, int]]:
    """A transfer as (global head, index in this pool, index in the peer's pool) triples,
    checking its three ranges agree."""
    out = []
    for i in range(t.num_heads):
        g = t.global_heads.start + i
        assert mine[t.local_heads.start + i] == g and theirs[t.remote_heads.start + i] == g
        out.append((g, t.local_heads.start + i, t.remote_heads.start + i))
    return out


def heads(plan: pdkv.PlanOptions) -> dict[str, int]:
    """The head fields of a transfer's plan."""
    return {"num_heads": plan.num_heads, "local_head_offset": plan.local_head_offset,
            "remote_head_offset": plan.remote_head_offset}


def deliveries(m: TPMapping, mode: str) -> set[tuple[int, int, int]]:
    """Every (prefill rank, decode rank, head) moved in ``mode``, from the initiators'
    lists, checking each against brute-force ownership and plan()."""
    side = "prefill" if mode == "push" else "decode"
    other = "decode" if side == "prefill" else "prefill"
    tp, otp = (m.prefill_tp, m.decode_tp) if side == "prefill" else (m.decode_tp, m.prefill_tp)
    seen = []
    for rank in range(tp):
        mine = held(tp, m.kv_heads, rank)
        for t in m.transfers(side=side, rank=rank, mode=mode):
            assert t.initiator and t.op == ("write" if mode == "push" else "read") and t.peer_side == other
            assert 0 <= t.peer_rank < otp
            theirs = held(otp, m.kv_heads, t.peer_rank)
            kw = heads(t.plan())
            if kw["num_heads"] == 0:
                assert len(mine) == len(theirs) == t.num_heads and kw == dict.fromkeys(kw, 0)
            else:
                assert kw == {"num_heads": t.num_heads, "local_head_offset": t.local_heads.start,
                              "remote_head_offset": t.remote_heads.start}
            for g, _, _ in expand(t, mine, theirs):
                pre, dec = (rank, t.peer_rank) if side == "prefill" else (t.peer_rank, rank)
                seen.append((pre, dec, g))
    assert len(seen) == len(set(seen)), "a head moved twice between the same two ranks"
    return set(seen)


@pytest.mark.parametrize("kv_heads", HEADS)
@pytest.mark.parametrize("prefill_tp,decode_tp", list(itertools.product(TPS, TPS)))
def test_mapping_matches_brute_force(prefill_tp, decode_tp, kv_heads):
    m = TPMapping(prefill_tp, decode_tp, kv_heads)
    for side, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        for r in range(tp):
            assert list(m.heads(side, r)) == held(tp, kv_heads, r)
    push, pull = deliveries(m, "push"), deliveries(m, "pull")
    assert push == pull
    # Every decode rank receives every head it holds exactly once, from a holder; nothing else.
    got = defaultdict(list)
    for pre, dec, g in push:
        assert g in held(prefill_tp, kv_heads, pre)
        got[dec].append(g)
    for d in range(decode_tp):
        assert sorted(got[d]) == held(decode_tp, kv_heads, d)
    # Load spread: per head, its prefill replicas serve decode ranks evenly (within one).
    for g in range(kv_heads):
        load = Counter(pre for pre, _, h in push if h == g)
        counts = [load.get(p, 0) for p in range(prefill_tp) if g in held(prefill_tp, kv_heads, p)]
        assert max(counts) - min(counts) <= 1, (g, counts)
    # The passive lists mirror the initiators' ones.
    for mode, side, tp in (("push", "decode", decode_tp), ("pull", "prefill", prefill_tp)):
        mirror = set()
        for r in range(tp):
            for t in m.transfers(side=side, rank=r, mode=mode):
                assert not t.initiator
                with pytest.raises(InvalidArgument, match="does not issue"):
                    t.plan()
                peer_tp = prefill_tp if side == "decode" else decode_tp
                mine, theirs = held(tp, kv_heads, r), held(peer_tp, kv_heads, t.peer_rank)
                for g, _, _ in expand(t, mine, theirs):
                    mirror.add((t.peer_rank, r, g) if side == "decode" else (r, t.peer_rank, g))
        assert mirror == push


def test_worked_example_tp4_to_tp2_push():
    """The table in docs/api.md ("Tensor-parallel mapping")."""
    m = TPMapping(prefill_tp=4, decode_tp=2, kv_heads=8)
    (t,) = m.transfers(side="prefill", rank=2, mode="push")
    assert (t.op, t.peer_rank, t.global_heads) == ("write", 1, HeadRange(4, 2))
    assert heads(t.plan()) == {"num_heads": 2, "local_head_offset": 0, "remote_head_offset": 0}
    (t,) = m.transfers(side="prefill", rank=3, mode="push")
    assert (t.op, t.peer_rank, t.local_heads, t.remote_heads) == ("write", 1, HeadRange(0, 2), HeadRange(2, 2))
    assert heads(t.plan()) == {"num_heads": 2, "local_head_offset": 0, "remote_head_offset": 2}
    # The plan keeps what the caller's base says besides the heads, and leaves the base as it was.
    base = pdkv.PlanOptions(num_tokens=7, first_layer=1)
    assert t.plan(base) == pdkv.PlanOptions(num_tokens=7, num_heads=2, remote_head_offset=2, first_layer=1)
    assert base == pdkv.PlanOptions(num_tokens=7, first_layer=1)
    with pytest.raises(InvalidArgument, match="plan must be a pdkv.PlanOptions"):
        t.plan({"num_tokens": 7})
    # The same pair pulled from the decode side: offsets swap sides.
    pulls = m.transfers(side="decode", rank=1, mode="pull")
    assert [(p.peer_rank, heads(p.plan())) for p in pulls] == [
        (2, {"num_heads": 2, "local_head_offset": 0, "remote_head_offset": 0}),
        (3, {"num_heads": 2, "local_head_offset": 2, "remote_head_offset": 0})]


def test_replicated_heads_pick_one_source_and_spread():
    # 2 kv heads, prefill TP8 (each head on 4 ranks), decode TP2 (one head each).
    m = TPMapping(prefill_tp=8, decode_tp=2, kv_heads=2)
    assert [m.source(0, 0), m.source(1, 1)] == [0, 5]
    assert [len(m.transfers(side="prefill", rank=r, mode="push")) for r in range(8)] == [1, 0, 0, 0, 0, 1, 0, 0]
    # decode TP8 from prefill TP4 over 2 heads: each prefill replica serves two decode ranks.
    m = TPMapping(prefill_tp=4, decode_tp=8, kv_heads=2)
    assert [m.source(d, d // 4) for d in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_equal_tp_moves_whole_pools():
    for t in TPMapping(4, 4, 8).transfers(side="decode", rank=2, mode="pull"):
        assert t.peer_rank == 2 and t.plan() == pdkv.PlanOptions()


@pytest.mark.parametrize("args,match", [
    ((3, 2, 8), "8 kv heads do not split evenly over prefill_tp=3"),
    ((2, 6, 4), "decode_tp=6 exceeds the 4 kv heads"),
    ((0, 2, 8), "prefill_tp must be a positive integer, got 0"),
    ((2, 2, -1), "kv_heads must be a positive integer, got -1"),
    ((2, True, 8), "decode_tp must be a positive integer, got True"),
    ((2.0, 2, 8), "prefill_tp must be a positive integer, got 2.0"),
])
def test_rejects_bad_groups(args, match):
    with pytest.raises(InvalidArgument, match=match):
        TPMapping(*args)


def test_rejects_bad_rank_side_mode():
    m = TPMapping(2, 4, 8)
    with pytest.raises(InvalidArgument, match=r"decode rank 4 out of range \[0, 4\)"):
        m.transfers(side="decode", rank=4, mode="pull")
    with pytest.raises(InvalidArgument, match=r"prefill rank -1 out of range"):
        m.transfers(side="prefill", rank=-1, mode="push")
    with pytest.raises(InvalidArgument, match="side must be 'prefill' or 'decode', got 'pd'"):
        m.transfers(side="pd", rank=0, mode="push")
    with pytest.raises(InvalidArgument, match="mode must be 'push' or 'pull', got 'write'"):
        m.transfers(side="prefill", rank=0, mode="write")
    with pytest.raises(InvalidArgument, match="does not hold head 0"):
        m.source(1, 0)
    with pytest.raises(InvalidArgument, match=r"head 8 out of range"):
        m.holders("prefill", 8)
    assert m.transfers(side="decode", rank=np.int64(3), mode="pull")[0].peer_rank == 1


def test_heads_of_rank_is_the_engines_rule():
    assert heads_of_rank(2, 8, 1) == HeadRange(4, 4)
    assert heads_of_rank(16, 8, 5) == HeadRange(2, 1)


# ------------------------------------------------------------------ real agents over tcp
L, T, D = 2, 4, 8
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def group(n: int, prefix: str) -> list[pdkv.Agent]:
    return [pdkv.Agent(f"{prefix}{r}", secret="tp", transports=["tcp"]) for r in range(n)]


def load(pool: Pool, ids, ref: np.ndarray) -> None:
    """Writes ``ref`` ([L, 2, len(ids)*T, heads, D*itemsize] uint8) into ``pool``'s blocks ``ids``."""
    n, t = len(ids), pool.spec.block_tokens
    for layer in range(pool.spec.layers):
        for part, cache in enumerate((pool.k[layer], pool.v[layer])):
            x = ref[layer, part].reshape(n, t, *ref.shape[3:])
            if pool.spec.style == "hnd":
                x = x.transpose(0, 2, 1, 3)
            b = cache.view(np.uint8)
            b[np.asarray(ids)] = x


def move_between_groups(m: TPMapping, mode: str, *, decode_style: str = "nhd", dtype: str = "float16",
                        num_tokens: int = 0, via: str = "submit") -> None:
    """Each rank an Agent with its own pool; prefill pools hold their heads of a random
    reference; the initiators issue exactly what the mapping returns; then every decode
    pool holds its heads of the reference (the first ``num_tokens`` tokens; the rest
    untouched) and every prefill pool is unchanged."""
    rng = np.random.default_rng(m.prefill_tp * 100 + m.decode_tp * 10 + m.kv_heads)
    nblocks, blocks = 3, 8
    tokens = num_tokens or nblocks * T
    ref = rng.integers(0, 256, (L, 2, nblocks * T, m.kv_heads, D * ITEMSIZE[dtype]), dtype=np.uint8)
    pre_ids = [[int(x) for x in rng.permutation(blocks)[:nblocks]] for _ in range(m.prefill_tp)]
    dec_ids = [[int(x) for x in rng.permutation(blocks)[:nblocks]] for _ in range(m.decode_tp)]
    pre, dec = group(m.prefill_tp, "p"), group(m.decode_tp, "d")
    try:
        ppools, dpools, before = [], [], []
        for r, a in enumerate(pre):
            h = m.heads("prefill", r)
            pool = Pool(PoolSpec(L, blocks, T, h.count, D, dtype, "nhd"), seed=r, shared_by=a)
            load(pool, pre_ids[r], ref[:, :, :, h.start:h.stop])
            pool.register(a)
            ppools.append(pool)
        for r, a in enumerate(dec):
            h = m.heads("decode", r)
            pool = Pool(PoolSpec(L, blocks, T, h.count, D, dtype, decode_style), seed=1000 + r, shared_by=a)
            pool.register(a)
            dpools.append(pool)
            before.append(pool.logical(dec_ids[r]))
        initiators, targets, ids = (pre, dec, (pre_ids, dec_ids)) if mode == "push" else (dec, pre, (dec_ids, pre_ids))
        side = "prefill" if mode == "push" else "decode"
        xfers = []
        for r, a in enumerate(initiators):
            for t in m.transfers(side=side, rank=r, mode=mode):
                peer = a.connect(targets[t.peer_rank].address)
                if via == "submit":
                    xfers.append(t.submit(a, peer, pdkv.Blocks("kv", ids[0][r]), pdkv.Blocks("kv", ids[1][t.peer_rank]),
                                          plan=pdkv.PlanOptions(num_tokens=num_tokens), timeout=30))
                else:
                    prep = t.prepare(a, peer, pdkv.Blocks("kv", ids[0][r]), pdkv.Blocks("kv", ids[1][t.peer_rank]),
                                     plan=pdkv.PlanOptions(num_tokens=num_tokens))
                    xfers.append(prep.post(timeout=30))
        assert xfers
        for x in xfers:
            assert x.wait(30)
        for r, pool in enumerate(dpools):
            h = m.heads("decode", r)
            got = pool.logical(dec_ids[r])
            assert np.array_equal(got[:, :, :tokens], ref[:, :, :tokens, h.start:h.stop])
            assert np.array_equal(got[:, :, tokens:], before[r][:, :, tokens:])
        for r, pool in enumerate(ppools):
            h = m.heads("prefill", r)
            assert np.array_equal(pool.logical(pre_ids[r]), ref[:, :, :, h.start:h.stop])
    finally:
        for a in pre + dec:
            a.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("prefill_tp,decode_tp,kv_heads,decode_style", [
    (2, 4, 8, "nhd"), (4, 2, 8, "nhd"), (2, 4, 4, "hnd"),  # plain splits (HND on the decode side)
    (2, 4, 2, "nhd"), (4, 2, 2, "nhd"),  # GQA: heads replicated on one side
])
def test_agents_move_kv_between_tp_groups(mode, prefill_tp, decode_tp, kv_heads, decode_style):
    move_between_groups(TPMapping(prefill_tp, decode_tp, kv_heads), mode, decode_style=decode_style)


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_replicated_heads_partial_last_block_every_dtype(dtype, mode):
    """Prefill TP4 over 2 heads (each replicated twice) -> decode TP2, HND, 9 of 12 tokens."""
    move_between_groups(TPMapping(4, 2, 2), mode, decode_style="hnd", dtype=dtype, num_tokens=3 * T - 3,
                        via="prepare")


def test_module_example_runs():
    import doctest

    import pdkv.tp

    res = doctest.testmod(pdkv.tp)
    assert res.attempted > 0 and res.failed == 0
