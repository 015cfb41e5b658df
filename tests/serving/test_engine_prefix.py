"""The engine's prefix cache: greedy outputs equal token for token with the cache on
and off (colocated and chunked; requests sharing a system prompt; multi-turn
conversations; preemption under a tiny pool; eviction under pressure), the prompt
tokens computed drop by what was cached, blocks are shared only once their KV is
computed, index events and snapshots, the decode side's reserve_prefix, imports, and
a late read of a leased block after its eviction refused by pdkv generations."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import pdkv  # noqa: E402
from pdkv.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig, KVEvent  # noqa: E402
from pdkv.serving.kv_pool import PagedKVPool  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from tinylm import VOCAB, shuffled, tiny_model  # noqa: E402

BT = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def make(model, *, cache: bool, mode: str = "colocated", num_blocks: int = 96, **kw) -> Engine:
    cfg = dict(num_blocks=num_blocks, block_tokens=BT, mode=mode, max_batch_tokens=16, max_num_seqs=8,
               prefix_cache=cache)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), block_order=shuffled(num_blocks))


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def run_waves(engine: Engine, waves: list[list[list[int]]], params: SamplingParams = GREEDY):
    """Runs each wave's prompts concurrently, waves one after the other; returns every
    request's output and handle, in order."""
    outs, handles = [], []
    for w, prompts in enumerate(waves):
        hs = [engine.add_request(f"w{w}-{i}", p, params) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        handles += hs
        outs += [list(h.output_ids) for h in hs]
    return outs, handles


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_mixed", "mistral_sw"])
def test_shared_system_prompt_equal_outputs_fewer_computed_tokens(arch: str, mode: str) -> None:
    tm = tiny_model(arch)
    system = toks(19, 1)  # 4 full blocks + 3 tokens
    waves = [[system + toks(5, 2)], [system + toks(n, 10 + n) for n in (1, 2, 5, 8, 9)]]
    off = make(tm.model, cache=False, mode=mode)
    on = make(tm.model, cache=True, mode=mode)
    ref, _ = run_waves(off, waves)
    out, handles = run_waves(on, waves)
    assert out == ref
    total = sum(len(p) for w in waves for p in w)
    assert [h.num_cached_tokens for h in handles] == [0] + [16] * 5
    s_on, s_off = on.prefix_stats(), off.prefix_stats()
    assert s_off["computed_prompt_tokens"] == s_off["queries_tokens"] == total and s_off["hit_tokens"] == 0
    assert s_on["queries_tokens"] == total and s_on["hit_tokens"] == 80
    assert s_on["computed_prompt_tokens"] == total - 80
    assert [h.num_computed_tokens for h in handles] == [len(p) - c for p, c in
                                                        zip([p for w in waves for p in w],
                                                            [h.num_cached_tokens for h in handles])]
    assert on.num_free_blocks == off.num_free_blocks == 96  # cached blocks no one holds count as free
    assert s_on["cached_blocks"] > 0 and s_on["cached_blocks"] == s_on["cached_free_blocks"]


def test_requests_admitted_together_share_nothing_uncomputed() -> None:
    tm = tiny_model("llama_gqa")
    p = toks(13, 3)
    on = make(tm.model, cache=True, max_batch_tokens=32)
    ref = make(tm.model, cache=False).generate([p], GREEDY)[0]
    a = on.add_request("a", p, GREEDY)
    b = on.add_request("b", p, GREEDY)
    st = on.step()
    assert st.num_seqs == 2 and st.num_prefill_tokens == 26  # both computed the whole prompt
    on.run_until_idle()
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert a.output_ids == b.output_ids == ref
    c = on.add_request("c", p, GREEDY)
    on.run_until_idle()
    assert c.num_cached_tokens == 12 and c.output_ids == ref  # capped: the last token computes


def test_chunked_request_shares_blocks_of_a_prefill_still_running() -> None:
    tm = tiny_model("qwen2")
    p = toks(21, 4)
    on = make(tm.model, cache=True, mode="chunked", max_batch_tokens=12, max_num_seqs=4)
    ref = make(tm.model, cache=False, mode="chunked", max_batch_tokens=12, max_num_seqs=4).generate([p], GREEDY)[0]
    a = on.add_request("a", p, GREEDY)
    b = on.add_request("b", p, GREEDY)
    assert on.step().num_seqs == 1  # a's first 12 tokens: 3 full blocks, cached now
    on.step()  # a's other 9 tokens, b joins with the 3 left of the budget
    assert b.num_cached_tokens == 12
    on.run_until_idle()
    assert a.output_ids == b.output_ids == ref


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_multi_turn_conversations(mode: str) -> None:
    tm = tiny_model("mistral_sw")
    sessions = [toks(9 + 4 * s, 20 + s) for s in range(3)]
    engines = {c: make(tm.model, cache=c, mode=mode, num_blocks=160) for c in (False, True)}
    hist = {c: [list(p) for p in sessions] for c in engines}
    for turn in range(4):
        outs = {}
        for c, eng in engines.items():
            hs = [eng.add_request(f"t{turn}-s{s}", h, GREEDY) for s, h in enumerate(hist[c])]
            eng.run_until_idle()
            outs[c] = [list(x.output_ids) for x in hs]
            if c and turn:
                # The previous turn's prompt and all but its last output token were cached.
                assert all(x.num_cached_tokens >= (len(h) - 3 - 5 - 1) // BT * BT > 0
                           for x, h in zip(hs, hist[c]))
            for s, h in enumerate(hist[c]):
                h += outs[c][s] + toks(3 + (turn + s) % 3, 100 * turn + s)
        assert outs[True] == outs[False]
        assert hist[True] == hist[False]
    on, off = engines[True].prefix_stats(), engines[False].prefix_stats()
    assert on["queries_tokens"] == off["queries_tokens"]
    assert on["computed_prompt_tokens"] < 0.45 * off["computed_prompt_tokens"]


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_preemption_under_a_tiny_pool(mode: str) -> None:
    tm = tiny_model("mistral_sw")
    params = SamplingParams(max_tokens=10)
    eng = make(tm.model, cache=True, mode=mode, num_blocks=24)
    handles = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(tm.prompts)]
    eng.run_until_idle()
    assert [h.output_ids for h in handles] == tm.refs  # == model.generate
    assert eng.num_preemptions > 0
    assert eng.prefix_stats()["readmit_hit_tokens"] > 0  # a preempted request found its own blocks
    assert eng.num_free_blocks == 24


def test_eviction_under_pressure_keeps_outputs_equal() -> None:
    tm = tiny_model("llama_gqa")
    base = [toks(17 + i % 5, 40 + i) for i in range(8)]
    waves = [[p] for p in base] + [[base[i] + toks(3, 60 + i)] for i in (7, 0, 6, 1)]
    out, _ = run_waves(make(tm.model, cache=True, num_blocks=20), waves)
    ref, _ = run_waves(make(tm.model, cache=False, num_blocks=20), waves)
    assert out == ref
    eng = make(tm.model, cache=True, num_blocks=20)
    hooks: list[list[int]] = []
    eng.set_evict_hook(hooks.append)
    _, handles = run_waves(eng, waves)
    s = eng.prefix_stats()
    assert s["evictions"] > 0 and hooks == []  # nothing was exposed: no generation bumps
    assert handles[8].num_cached_tokens == 16  # the most recent prompt is still cached
    assert handles[9].num_cached_tokens == 0   # the oldest was evicted
    assert eng.num_free_blocks == 20 and s["cached_blocks"] <= 20


def test_events_snapshot_and_lookups() -> None:
    tm = tiny_model("llama_gqa")
    eng = make(tm.model, cache=True, num_blocks=12)
    events: list[KVEvent] = []

    def sink(ev: KVEvent) -> None:
        assert not eng._lock.locked()  # delivered without the engine lock
        events.append(ev)

    eng.set_kv_event_sink(sink)
    p = toks(14, 5)
    eng.generate([p], GREEDY)
    hashes = eng.block_hashes(p + [0] * 6)
    full = eng.block_hashes(p)
    assert len(full) == 3 and hashes[:3] == full
    assert events[0] == KVEvent("stored", tuple(full[:3]))  # the prompt's blocks, after the prefill step
    stored = [h for e in events if e.kind == "stored" for h in e.hashes]
    assert set(eng.cache_snapshot()) == set(stored) and len(stored) == 4  # + one block of prompt and outputs
    assert eng.cached_prefix_tokens(p) == 12 and eng.cached_prefix_tokens(toks(14, 6)) == 0
    eng.generate([toks(40, 7)], GREEDY)  # needs 12 blocks: evicts all four
    kinds = [e.kind for e in events]
    assert "evicted" in kinds and eng.cached_prefix_tokens(p) == 0
    assert {h for e in events if e.kind == "evicted" for h in e.hashes} == set(stored)
    assert eng.clear_prefix_cache() > 0 and eng.cache_snapshot() == ()
    assert events[-1] == KVEvent("cleared", ())
    eng.set_kv_event_sink(None)
    eng.generate([p], GREEDY)
    assert events[-1] == KVEvent("cleared", ())


def test_cache_off_has_no_index_and_no_events() -> None:
    tm = tiny_model("llama_gqa")
    eng = make(tm.model, cache=False)
    events: list[KVEvent] = []
    eng.set_kv_event_sink(events.append)
    p = toks(14, 5)
    eng.generate([p, p], GREEDY)
    eng.generate([p], GREEDY)
    assert events == [] and eng.cache_snapshot() == () and eng.cached_prefix_tokens(p) == 0
    assert eng.lease("l", eng.block_hashes(p)) == []
    assert eng.reserve_prefix("d", p)[1] == 0
    with pytest.raises(InvalidArgument, match="cache is off"):
        eng.import_blocks("i", eng.block_hashes(p))


def test_decode_side_reserve_prefix_then_admit_prefilled() -> None:
    tm = tiny_model("qwen2")
    turn1 = toks(11, 8)
    turn2 = turn1 + toks(10, 9)
    ref = make(tm.model, cache=False).generate([turn2], GREEDY)[0]
    pre = make(tm.model, cache=False)   # the prefill worker
    dec = make(tm.model, cache=True, num_blocks=24)  # the decode worker: it served turn 1
    dec.generate([turn1], GREEDY)
    hooks: list[list[int]] = []
    dec.set_evict_hook(hooks.append)
    h = pre.add_request("t2", turn2, GREEDY, prefill_only=True)
    pre.run_until_idle()
    blocks, cached = dec.reserve_prefix("t2", turn2)
    assert len(blocks) == 6 and cached == 2  # turn 1's two full blocks
    with pytest.raises(AlreadyExists):
        dec.reserve_prefix("t2", turn2)
    pre.pool.copy_blocks_to(dec.pool, h.block_ids[cached:], blocks[cached:])  # what the push moves
    pre.release("t2")
    d = dec.admit_prefilled("t2", turn2, h.output_ids[0], GREEDY, seed=h.seed)
    dec.run_until_idle()
    assert [h.output_ids[0]] + d.output_ids[1:] == ref and d.output_ids == ref
    assert d.num_cached_tokens == 8
    assert dec.cached_prefix_tokens(turn2) == 20  # turn 2's prompt is cached now
    # A second reservation shares the blocks; a release gives them back.
    blocks2, cached2 = dec.reserve_prefix("t3", turn2)
    assert cached2 == 5 and blocks2[:5] == blocks[:5]
    dec.release("t3")
    dec.generate([toks(80, 10)], GREEDY)  # evicts: every reserved block was exposed
    assert hooks and set(blocks) & {b for c in hooks for b in c}


def test_admit_prefilled_without_caching_lossy_kv() -> None:
    tm = tiny_model("llama_gqa")
    p = toks(17, 14)
    pre = make(tm.model, cache=False)
    dec = make(tm.model, cache=True)
    h = pre.add_request("r", p, GREEDY, prefill_only=True)
    pre.run_until_idle()
    blocks = dec.reserve("r", len(p))
    pre.pool.copy_blocks_to(dec.pool, h.block_ids, blocks)
    d = dec.admit_prefilled("r", p, h.output_ids[0], GREEDY, seed=h.seed, cache_kv=False)
    dec.run_until_idle()
    assert d.output_ids == make(tm.model, cache=False).generate([p], GREEDY)[0]
    assert dec.cache_snapshot() == () and dec.cached_prefix_tokens(p) == 0  # nothing of it was cached


def test_import_blocks_then_hit() -> None:
    tm = tiny_model("llama_gqa")
    p = toks(18, 11)
    ref = make(tm.model, cache=False).generate([p], GREEDY)[0]
    src = make(tm.model, cache=True)
    src.generate([p], GREEDY)
    hashes = src.block_hashes(p)[:4]
    held = src.lease("pull-1", hashes)
    assert len(held) == 4
    dst = make(tm.model, cache=True)
    got = dst.import_blocks("imp-1", hashes)
    assert dst.cached_prefix_tokens(p) == 0  # not before the commit
    src.pool.copy_blocks_to(dst.pool, held, got)  # what the pdkv read moves
    assert src.unlease("pull-1") and not src.unlease("pull-1")
    assert dst.commit_import("imp-1") == 4
    h = dst.add_request("r", p, GREEDY)
    dst.run_until_idle()
    assert h.output_ids == ref
    assert h.num_cached_tokens == 16 and h.num_imported_tokens == 16 and h.num_computed_tokens == 2
    assert dst.unlease("imp-1")
    s = dst.prefix_stats()
    assert s["pulled_hit_tokens"] == 16 and s["hit_tokens"] == 16 and s["leases"] == 0


def test_bad_input() -> None:
    tm = tiny_model("llama_gqa")
    with pytest.raises(InvalidArgument, match="cache_salt"):
        EngineConfig(num_blocks=8, cache_salt="not-a-salt")
    with pytest.raises(InvalidArgument, match="prefix_cache"):
        EngineConfig(num_blocks=8, prefix_cache="yes")
    eng = make(tm.model, cache=True)
    with pytest.raises(InvalidArgument, match="malformed"):
        eng.lease("l", ["zz"])
    with pytest.raises(InvalidArgument, match="empty prompt"):
        eng.reserve_prefix("r", [])
    with pytest.raises(InvalidArgument, match="vocabulary"):
        eng.reserve_prefix("r", [VOCAB])
    assert eng.cache_salt == make(tm.model, cache=False).cache_salt  # derived the same way each time
    salt = "0123456789abcdef"
    other = Engine(tm.model, EngineConfig(num_blocks=8, block_tokens=BT, cache_salt=salt))
    assert other.cache_salt == salt and other.block_hashes(list(range(3, 7))) != eng.block_hashes(list(range(3, 7)))


def test_late_lease_read_after_eviction_is_stale() -> None:
    """A remote reader leased blocks and read them; once unleased, evicted and reused,
    a read with the generations it was given fails with StaleBlock (the evict hook
    bumped them), never returning the new prompt's KV."""
    tm = tiny_model("llama_gqa")
    owner = pdkv.Agent("cache-owner", secret="s3", listen="127.0.0.1:0", transports=["tcp"])
    reader = pdkv.Agent("cache-reader", secret="s3", listen="127.0.0.1:0", transports=["tcp"])
    try:
        geo = pdkv.KVGeometry.from_hf_config(tm.model.config, num_blocks=12, block_tokens=BT, dtype="float32")
        pool = PagedKVPool.shared(owner, geo, block_order=shuffled(12))
        eng = Engine(tm.model, EngineConfig(num_blocks=12, block_tokens=BT, prefix_cache=True), pool=pool)
        eng.set_evict_hook(lambda ids: owner.bump_generations("kv", ids))
        mine = PagedKVPool.shared(reader, geo)
        peer = reader.add_peer(owner.metadata())
        p = toks(14, 12)
        eng.generate([p], GREEDY)
        ids = eng.lease("L", eng.block_hashes(p))
        gens = owner.generations("kv", ids)
        assert len(ids) == 3
        reader.read(peer, pdkv.Blocks("kv", [0, 1, 2]), pdkv.Blocks("kv", ids, generations=gens)).wait(10)
        assert mine.storage[:, :, :3].equal(pool.storage[:, :, ids])
        eng.generate([toks(40, 13)], GREEDY)  # the lease pins them: no eviction while it holds
        assert eng.cached_prefix_tokens(p) == 12
        eng.unlease("L")
        eng.generate([toks(40, 13)], GREEDY)  # now they are evicted and reused
        assert eng.cached_prefix_tokens(p) == 0 and eng.prefix_stats()["evict_hook_calls"] >= 1
        assert owner.generations("kv", ids) != gens
        with pytest.raises(pdkv.StaleBlock):
            reader.read(peer, pdkv.Blocks("kv", [3, 4, 5]), pdkv.Blocks("kv", ids, generations=gens)).wait(10)
        assert not mine.storage[:, :, 3:6].any()  # nothing of the reused blocks landed
    finally:
        reader.close()
        owner.close()


def test_events_replayed_in_order_equal_the_snapshot_under_concurrency() -> None:
    """A stepping thread plus threads that add requests, reserve, lease and release at
    the same time: the events, applied in the order delivered, rebuild the index."""
    import threading

    tm = tiny_model("llama_gqa")
    eng = make(tm.model, cache=True, num_blocks=40, max_num_seqs=4)
    seen: set[str] = set()
    order_ok = [True]

    def sink(ev: KVEvent) -> None:
        if ev.kind == "stored":
            order_ok[0] &= seen.isdisjoint(ev.hashes)  # never stored twice without an eviction between
            seen.update(ev.hashes)
        elif ev.kind == "evicted":
            order_ok[0] &= set(ev.hashes) <= seen
            seen.difference_update(ev.hashes)
        else:
            seen.clear()

    eng.set_kv_event_sink(sink)
    stop = threading.Event()

    def stepper() -> None:
        while not stop.is_set():
            if eng.wait_for_work(0.01):
                eng.step()

    prompts = [toks(6 + 5 * (i % 4), 200 + i % 6) for i in range(24)]

    def client(k: int) -> None:
        for i in range(k, len(prompts), 3):
            p = prompts[i]
            h = eng.add_request(f"c{i}", p, SamplingParams(max_tokens=3))
            try:
                eng.reserve_prefix(f"res{i}", p)
                eng.lease(f"l{i}", eng.block_hashes(p))
            except ResourceExhausted:  # a full pool refuses a reservation: fine here
                pass
            eng.unlease(f"l{i}")
            try:
                eng.release(f"res{i}")
            except NotFound:  # no reservation was made
                pass
            assert h.wait(30)

    t = threading.Thread(target=stepper)
    t.start()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(60)
    stop.set()
    t.join(10)
    assert order_ok[0]
    assert seen == set(eng.cache_snapshot()) and seen
    assert eng.num_free_blocks == 40 and eng.prefix_stats()["leases"] == 0
