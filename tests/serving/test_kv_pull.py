"""Cross-worker prefix reuse through real workers (in-process, over HTTP and pdkv):
the decode worker keeps a conversation's KV between turns, so turn 2 pushes only the
new blocks and the prefill worker reads the decode-held ones instead of computing
them; a third worker's lease (``/pd/kv_lease``) is read the same way; a pull whose
blocks were reused (generations bumped) or evicted between lease and read, or whose
holder is unreachable, fails and the tokens are computed. Every output is compared
token for token with a cache-off engine; blocks, bytes and tokens are counted."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

import pdkv

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.serving.aio import ServerThread  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.kv_pull import PullConfig  # noqa: E402
from pdkv.serving.protocol import (GenerateRequest, GenParams, KVLease, KVResult, PrefillRequest,  # noqa: E402
                                   Reservation)
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from pdkv.serving.worker import Worker, WorkerConfig  # noqa: E402
from servers import SECRET, Stack, build_tiny, completion_ids, concurrently, signed, spost  # noqa: E402
from kvpools import PoolSpec  # noqa: E402
from tinylm import make_prompts, tiny_model  # noqa: E402

BT = 4
MAX_NEW = 10
PARAMS = GenParams(max_tokens=MAX_NEW, temperature=0.0, seed=1, ignore_eos=True)


def engine_config(num_blocks: int, prefix_cache: bool, block_tokens: int = BT,
                  max_batch_tokens: int = 64) -> EngineConfig:
    return EngineConfig(num_blocks=num_blocks, block_tokens=block_tokens, mode="chunked",
                        max_batch_tokens=max_batch_tokens, max_num_seqs=4, num_threads=1, prefix_cache=prefix_cache)


class Cluster:
    """A prefill, a decode and a third worker (all with the prefix cache on), and a
    cache-off engine for the reference outputs."""

    def __init__(self, tm: Any, *, third_blocks: int = 64, stream_layers: bool = True,
                 pull_timeout_s: float = 2.0, prefill_bt: int = BT, decode_bt: int = BT,
                 prefill_batch_tokens: int = 64, prefill_kw: dict | None = None,
                 decode_kw: dict | None = None) -> None:
        self.tm = tm
        self.threads: list[ServerThread] = []
        self.prefill = self._worker("prefill", 64, prefill_bt, kv_pull=PullConfig(policy="always",
                                                                                  timeout_s=pull_timeout_s),
                                    stream_layers=stream_layers, batch_tokens=prefill_batch_tokens,
                                    **(prefill_kw or {}))
        self.decode = self._worker("decode", 64, decode_bt, **(decode_kw or {}))
        self.third = self._worker("decode", third_blocks, BT)
        self.reference = Engine(tm.model, engine_config(128, prefix_cache=False))

    def _worker(self, role: str, num_blocks: int, block_tokens: int, batch_tokens: int = 64, **kw: Any) -> Worker:
        cfg = WorkerConfig(role=role, engine=engine_config(num_blocks, True, block_tokens, batch_tokens),
                           model_name="tiny", secret=SECRET, **kw)
        w = Worker(self.tm.model, cfg)
        t = ServerThread(w)
        t.start()
        self.threads.append(t)
        return w

    def close(self) -> None:
        for t in reversed(self.threads):
            t.stop()

    def ref(self, prompt: list[int]) -> list[int]:
        return self.reference.generate([prompt], SamplingParams.of(PARAMS))[0]

    # -------------------------------------------------------------- the proxy's part
    def run(self, rid: str, prompt: list[int], *, src: KVLease | None = None, before_prefill: Any = None,
            recomputed: bool = False) -> tuple[list[int], KVResult, Reservation]:
        """One disaggregated request as the proxy runs it: reserve on decode, prefill
        (pushing into the reservation), then decode's tokens. Returns (output, the
        prefill's KV result, the reservation)."""
        body = json.dumps(GenerateRequest(rid, tuple(prompt), PARAMS, 20.0).to_json()).encode()
        url = self.decode.url + "/pd/decode"
        dreq = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                               **signed("POST", url, body)})
        with urllib.request.urlopen(dreq, timeout=60) as dresp:
            res = Reservation.from_json(json.loads(dresp.readline())["reserved"])
            if before_prefill is not None:
                before_prefill(res)
            lines = prefill_lines(self.prefill.url, PrefillRequest(rid, tuple(prompt), PARAMS, res, 20.0, src))
            first = lines[0]["first"]["t"]
            kv = KVResult.from_json(lines[-1]["kv"])
            if not kv.ok:  # as the proxy does: decode recomputes, after the first token
                status, _ = spost(self.decode.url + "/pd/kv_failed",
                                  {"rid": rid, "first_token": first, "error": kv.error, "terminal": True})
                assert status == 200
            out = [first]
            for raw in dresp:
                line = json.loads(raw)
                assert "error" not in line, line
                if "t" in line:
                    out.append(line["t"])
                if "done" in line:
                    assert line["done"]["recomputed"] is recomputed, line
        return out, kv, res

    def lease(self, worker: Worker, lease_id: str, prompt: list[int], ttl_s: float = 30.0) -> KVLease:
        hashes = self.prefill.engine.block_hashes(prompt)
        status, obj = spost(worker.url + "/pd/kv_lease", {"lease_id": lease_id, "hashes": hashes, "ttl_s": ttl_s})
        assert status == 200, obj
        return KVLease.from_json(obj["lease"])

    def generate_on(self, worker: Worker, rid: str, prompt: list[int]) -> list[int]:
        url = worker.url + "/pd/generate"
        body = json.dumps(GenerateRequest(rid, tuple(prompt), PARAMS).to_json()).encode()
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                              **signed("POST", url, body)})
        with urllib.request.urlopen(req, timeout=60) as r:
            return [ln["t"] for ln in map(json.loads, r.read().splitlines()) if "t" in ln]

    def pulls(self, result: str) -> float:
        return metric(self.prefill, "pdkv_kv_pulls_total", f'result="{result}"')


def prefill_lines(base: str, req: PrefillRequest) -> list[dict[str, Any]]:
    url = base + "/pd/prefill"
    body = json.dumps(req.to_json()).encode()
    r = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                        **signed("POST", url, body)})
    with urllib.request.urlopen(r, timeout=60) as resp:
        lines = [json.loads(x) for x in resp.read().splitlines()]
    assert "first" in lines[0] and "kv" in lines[-1], lines
    return lines


def metric(worker: Worker, name: str, labels: str = "") -> float:
    for line in worker.registry.render().splitlines():
        if line.startswith(name + ("{" + labels + "}" if labels else " ")):
            return float(line.split()[-1])
    return 0.0


def block_bytes(w: Worker) -> int:
    g = w.engine.pool.geometry
    return g.num_layers * g.kv_parts * g.block_bytes


@pytest.fixture
def cluster():
    c = Cluster(tiny_model("llama_gqa"))
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("stream_layers,batch_tokens,new_len", [(True, 64, 7), (True, 8, 19), (False, 64, 7)],
                         ids=["streamed", "streamed-in-chunks", "one-write"])
def test_second_turn_pulls_decode_held_blocks_and_pushes_only_new_ones(stream_layers, batch_tokens,
                                                                        new_len) -> None:
    c = Cluster(tiny_model("llama_gqa"), stream_layers=stream_layers, prefill_batch_tokens=batch_tokens)
    try:
        _two_turns(c, new_len)
        path = "streamed" if stream_layers else "monolithic"  # no stream fell back to one write
        assert metric(c.prefill, "pdkv_kv_streamed_total", f'path="{path}"') == 2
    finally:
        c.close()


def _two_turns(c: Cluster, new_len: int) -> None:
    p1 = make_prompts((23,), seed=11)[0]
    out1, kv1, res1 = c.run("turn1", p1)
    assert out1 == c.ref(p1)
    assert res1.cached_blocks == 0 and kv1.skipped_blocks == 0 and kv1.pulled_tokens == 0
    assert kv1.bytes == 6 * block_bytes(c.decode)  # 23 tokens: 6 blocks pushed
    # Turn 2: the history (turn 1's prompt and answer) plus a new user message.
    p2 = p1 + out1 + make_prompts((new_len,), seed=12)[0]  # 33 + new_len tokens
    # Decode computed p1 and out1[:9] (32 tokens): 8 full blocks; prefill holds p1's 5.
    assert c.prefill.engine.cached_prefix_tokens(p2) == 20
    out2, kv2, res2 = c.run("turn2", p2)
    assert out2 == c.ref(p2)
    assert res2.cached_blocks == 8
    new_blocks = -(-len(p2) // BT) - 8
    assert kv2.skipped_blocks == 8 and kv2.bytes == new_blocks * block_bytes(c.decode)  # only the new blocks moved
    assert kv2.pulled_tokens == 12 and kv2.pulled_bytes == 3 * block_bytes(c.decode)  # blocks 5..7 read
    assert kv2.cached_tokens == 32 and kv2.computed_tokens == len(p2) - 32
    assert c.pulls("ok") == 1
    assert metric(c.prefill, "pdkv_kv_pushed_skipped_blocks_total") == 8
    assert metric(c.prefill, "pdkv_kv_pull_bytes_total") == 3 * block_bytes(c.decode)
    assert metric(c.prefill, "pdkv_prefix_hit_tokens_total", 'source="pulled"') == 12
    assert metric(c.prefill, "pdkv_prefix_hit_tokens_total", 'source="local"') == 20
    assert c.prefill.engine.cached_prefix_tokens(p2) == len(p2) // BT * BT  # pulled and computed blocks stay
    # Nothing leaked: every lease ended, every reservation admitted and finished.
    assert c.prefill.engine.prefix_stats()["leases"] == 0


def test_stale_decode_blocks_are_computed_instead(cluster) -> None:
    c = cluster
    p1 = make_prompts((23,), seed=21)[0]
    out1, _, _ = c.run("s1", p1)
    p2 = p1 + out1 + make_prompts((7,), seed=22)[0]

    def reuse_them(res: Reservation) -> None:  # decode reused blocks 5..7 between reservation and read
        c.decode.agent.bump_generations("kv", list(res.blocks[5:8]))

    out2, kv2, res2 = c.run("s2", p2, before_prefill=reuse_them)
    assert out2 == c.ref(p2)
    assert res2.cached_blocks == 8 and kv2.skipped_blocks == 8  # decode's KV in them is still right
    assert kv2.pulled_tokens == 0 and kv2.cached_tokens == 20 and kv2.computed_tokens == 20
    assert c.pulls("stale") == 1 and c.pulls("ok") == 0
    assert c.prefill.engine.prefix_stats()["leases"] == 0


def test_a_third_workers_lease_is_read(cluster) -> None:
    c = cluster
    p = make_prompts((30,), seed=31)[0]
    assert c.generate_on(c.third, "warm", p[:26]) == c.ref(p[:26])  # the third worker computes 6 blocks of it
    lease = c.lease(c.third, "L1", p)
    assert lease.start == 0 and len(lease.blocks) == 6 and lease.agent == c.third.agent_address
    assert metric(c.third, "pdkv_kv_leases") == 1
    out, kv, res = c.run("lease1", p, src=lease)
    assert out == c.ref(p)
    assert res.cached_blocks == 0 and kv.pulled_tokens == 24 and kv.cached_tokens == 24 and kv.computed_tokens == 6
    assert kv.bytes == 8 * block_bytes(c.decode)  # decode held nothing: every block pushed
    status, obj = spost(c.third.url + "/pd/kv_release", {"lease_id": "L1"})
    assert status == 200 and obj == {"ok": True}
    status, obj = spost(c.third.url + "/pd/kv_release", {"lease_id": "L1"})
    assert status == 404 and obj["error"]["code"] == "unknown_lease"
    assert metric(c.third, "pdkv_kv_leases") == 0


def test_a_reused_or_evicted_lease_is_recomputed(cluster) -> None:
    c = cluster
    p = make_prompts((30,), seed=41)[0]
    c.generate_on(c.third, "warm", p)
    # Reused between lease and read: the holder bumped the leased blocks' generations.
    lease = c.lease(c.third, "L2", p)
    c.third.agent.bump_generations("kv", list(lease.blocks))
    out, kv, _ = c.run("stale1", p, src=lease)
    assert out == c.ref(p) and kv.pulled_tokens == 0 and kv.computed_tokens == 30
    assert c.pulls("stale") == 1
    # Evicted between lease and read: released, then dropped from the holder's cache
    # (the eviction bumps the generations of blocks it had leased out).
    q = make_prompts((30,), seed=42)[0]
    c.generate_on(c.third, "warm2", q)
    lease = c.lease(c.third, "L3", q)
    assert spost(c.third.url + "/pd/kv_release", {"lease_id": "L3"})[0] == 200
    gens = c.third.agent.generations("kv", list(lease.blocks))
    assert c.third.engine.clear_prefix_cache() > 0
    assert all(a != b for a, b in zip(c.third.agent.generations("kv", list(lease.blocks)), gens))
    out, kv, _ = c.run("stale2", q, src=lease)
    assert out == c.ref(q) and kv.pulled_tokens == 0
    assert c.pulls("stale") == 2 and c.pulls("ok") == 0
    assert c.prefill.stats()["kv_pulls"] == {"ok": 0, "stale": 2}
    assert c.prefill.engine.prefix_stats()["leases"] == 0


def test_an_unreachable_holder_is_recomputed(cluster) -> None:
    c = cluster
    p = make_prompts((17,), seed=51)[0]
    dead = KVLease("gone", "127.0.0.1:1", "nobody", BT, 0, (0, 1, 2), (1, 1, 1))
    out, kv, _ = c.run("dead1", p, src=dead)
    assert out == c.ref(p) and kv.pulled_tokens == 0 and kv.computed_tokens == 17
    assert c.pulls("peer") == 1
    assert c.prefill.engine.prefix_stats()["leases"] == 0


def test_a_frozen_holder_costs_the_pull_timeout_then_computes(spawn_peer) -> None:
    c = Cluster(tiny_model("llama_gqa"), pull_timeout_s=0.5)
    try:
        g = c.prefill.engine.pool.geometry
        proc = spawn_peer("frozen-holder", PoolSpec(layers=g.num_layers, blocks=8, block_tokens=BT, heads=g.kv_heads,
                                                    head_dim=g.head_dim, dtype="float32"), seed=1, secret=SECRET)
        # The prefill worker reaches the holder once, then the holder freezes (SIGSTOP).
        status, obj = spost(c.prefill.url + "/pd/check_peer", {"agent": proc.address, "timeout": 10})
        assert status == 200 and obj["ok"], obj
        proc.pause()
        try:
            p = make_prompts((17,), seed=61)[0]
            frozen = KVLease("fz", proc.address, "frozen-holder", BT, 0, (0, 1, 2), (1, 1, 1))
            t0 = time.monotonic()
            out, kv, _ = c.run("frozen1", p, src=frozen)
            waited = time.monotonic() - t0
        finally:
            proc.resume()
        assert out == c.ref(p) and kv.pulled_tokens == 0 and kv.computed_tokens == 17
        assert c.pulls("timeout") + c.pulls("peer") == 1, c.prefill.registry.render()
        assert waited < 15  # bounded by the pull's timeout, not by the frozen peer
        assert c.prefill.engine.prefix_stats()["leases"] == 0
    finally:
        c.close()


def test_lease_routes_validate_and_cap() -> None:
    tm = tiny_model("llama_gqa")
    cfg = WorkerConfig(role="decode", engine=engine_config(32, True), model_name="tiny", secret=SECRET,
                       max_kv_leases=2)
    w = Worker(tm.model, cfg)
    t = ServerThread(w)
    t.start()
    try:
        url = w.url
        h = w.engine.block_hashes(list(range(3, 20)))
        assert spost(url + "/pd/kv_lease", {"lease_id": "a", "hashes": h, "ttl_s": 30})[0] == 200
        status, obj = spost(url + "/pd/kv_lease", {"lease_id": "a", "hashes": h})
        assert status == 409 and obj["error"]["code"] == "duplicate_lease"
        assert spost(url + "/pd/kv_lease", {"lease_id": "b", "hashes": h, "ttl_s": 0.2})[0] == 200
        status, obj = spost(url + "/pd/kv_lease", {"lease_id": "c", "hashes": h})
        assert status == 503 and obj["error"]["code"] == "too_many_leases"
        status, obj = spost(url + "/pd/kv_lease", {"lease_id": "c", "hashes": ["nothex"]})
        assert status == 400 and "block hashes" in obj["error"]["message"]
        status, obj = spost(url + "/pd/kv_lease", {"lease_id": "c", "hashes": h, "ttl_s": 1e9})
        assert status == 400 and "ttl_s" in obj["error"]["message"]
        deadline = time.monotonic() + 10
        while len(w.leases) > 1:  # "b" expires after 0.2 s
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert w.leases.counts["expired"] == 1
        assert spost(url + "/pd/kv_release", {"lease_id": "b"})[0] == 404
        assert spost(url + "/pd/kv_lease", {"lease_id": "c", "hashes": h})[0] == 200
        # Unsigned calls never reach the handler.
        req = urllib.request.Request(url + "/pd/kv_lease", data=b'{"lease_id": "x", "hashes": []}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
        e.value.close()
    finally:
        t.stop()


def test_two_turns_through_the_proxy(tmp_path_factory) -> None:
    """The proxy carries ``cached_blocks`` from decode to prefill; the client's pdkv
    stats show the skipped and pulled blocks of turn 2; the answers equal a cache-off
    colocated worker's."""
    tiny = build_tiny(tmp_path_factory.mktemp("models"))
    st = Stack()
    try:
        pre = st.worker(tiny, "prefill", mode="chunked", kv_pull=PullConfig(policy="always"))
        dec = st.worker(tiny, "decode", mode="chunked")
        ref = st.worker(tiny, "colocated", mode="chunked", prefix_cache=False)
        px = st.proxy("disagg", prefill=[pre], decode=[dec])
        p1 = tiny.prompts[3]
        out1, s1 = completion_ids(px, tiny.name, p1)
        assert out1 == completion_ids(ref, tiny.name, p1)[0]
        p2 = p1 + out1 + tiny.prompts[2]
        out2, s2 = completion_ids(px, tiny.name, p2)
        assert out2 == completion_ids(ref, tiny.name, p2)[0]
        held = (len(p1) + len(out1) - 1) // BT  # decode computed turn 1's prompt and all but its last token
        extra = s2["extra"]
        assert extra["kv_skipped_blocks"] == held, s2
        assert extra["kv_pulled_tokens"] == (held - len(p1) // BT) * BT, s2
        assert extra["prefill_computed_tokens"] == len(p2) - held * BT, s2
        assert s1["extra"]["kv_skipped_blocks"] == 0
    finally:
        st.close()


@pytest.mark.parametrize("stream_layers", [True, False], ids=["streamed", "one-write"])
@pytest.mark.parametrize("prefill_bt,decode_bt,p1_len", [(4, 8, 23), (8, 4, 21), (8, 4, 23)],
                         ids=["decode-larger", "decode-ends-inside", "decode-aligned"])
def test_different_block_sizes_skip_up_to_a_shared_boundary(stream_layers, prefill_bt, decode_bt, p1_len) -> None:
    """No pull across block sizes; the push skips decode's blocks up to the last block
    boundary both sides share (decode's blocks after it are rewritten with the same
    tokens' KV)."""
    c = Cluster(tiny_model("llama_gqa"), stream_layers=stream_layers, prefill_bt=prefill_bt, decode_bt=decode_bt)
    try:
        p1 = make_prompts((p1_len,), seed=71)[0]
        out1, kv1, _ = c.run("bs1", p1)
        assert out1 == c.ref(p1) and kv1.ok
        p2 = p1 + out1 + make_prompts((7,), seed=72)[0]
        held = (len(p1) + len(out1) - 1) // decode_bt
        shared = held * decode_bt // max(prefill_bt, decode_bt) * max(prefill_bt, decode_bt)  # lcm: the larger
        out2, kv2, res2 = c.run("bs2", p2)
        assert out2 == c.ref(p2)
        assert res2.cached_blocks == held and kv2.pulled_tokens == 0
        assert kv2.ok and kv2.skipped_blocks == shared // decode_bt
        pushed = len(p2) - shared
        assert kv2.bytes == pushed * block_bytes(c.decode) // decode_bt, (pushed, kv2)  # those tokens only
    finally:
        c.close()


def test_lossy_pushes_stay_out_of_decode_cache_and_pulls_are_exact() -> None:
    """A prefill worker that may push fp8 says so in its notification: the decode
    worker keeps that KV out of its prefix cache (no other request reuses it). Its
    pulls still ask for lossless responses: the imported blocks equal the holder's
    bit for bit."""
    fp8 = pdkv.TcpCompression(mode="fp8")
    c = Cluster(tiny_model("llama_gqa"), prefill_kw={"kv_compress": fp8, "transports": ("tcp",)},
                decode_kw={"transports": ("tcp",)})
    try:
        p1 = make_prompts((23,), seed=81)[0]
        c.run("lossy1", p1)
        assert c.decode.engine.cached_prefix_tokens(p1) == 0  # fp8-pushed KV is never shared
        # A third worker's exact KV, read by the lossy prefill worker: lossless on the wire.
        p = make_prompts((30,), seed=82)[0]
        c.generate_on(c.third, "warm", p)
        lease = c.lease(c.third, "L9", p)
        _, kv, _ = c.run("lossy2", p, src=lease)
        assert kv.pulled_tokens == 28
        hashes = c.prefill.engine.block_hashes(p)[:7]
        mine = c.prefill.engine.lease("probe", hashes)
        try:
            assert len(mine) == 7
            for pool_a, pool_b in ((c.prefill.engine.pool.k_caches, c.third.engine.pool.k_caches),
                                   (c.prefill.engine.pool.v_caches, c.third.engine.pool.v_caches)):
                for la, lb in zip(pool_a, pool_b):
                    assert torch.equal(la[list(mine)], lb[list(lease.blocks)])
        finally:
            c.prefill.engine.unlease("probe")
    finally:
        c.close()


def test_concurrent_calls_sharing_a_context_pull_it_once_or_more_and_agree(cluster) -> None:
    """Agentic traffic: several calls at once extend the same history. Each may import
    the decode-held blocks (duplicates are dropped at commit) or find them cached by an
    earlier one; every answer equals the cache-off engine's and nothing stays leased."""
    c = cluster
    p1 = make_prompts((23,), seed=91)[0]
    out1, _, _ = c.run("ctx", p1)
    calls = [p1 + out1 + tool for tool in make_prompts((5, 9, 13), seed=92)]
    results = concurrently(lambda i: c.run(f"call{i}", calls[i]), range(len(calls)))
    for (out, kv, res), p in zip(results, calls):
        assert out == c.ref(p)
        assert res.cached_blocks == 8 and kv.skipped_blocks == 8 and kv.cached_tokens == 32
    assert c.pulls("ok") >= 1 and sum(kv.pulled_tokens for _, kv, _ in results) == 12 * c.pulls("ok")
    assert c.prefill.engine.prefix_stats()["leases"] == 0
    assert c.decode.engine.prefix_stats()["leases"] == 0


def test_leases_together_pin_at_most_their_block_budget() -> None:
    """However many leases readers with the secret take, they pin at most
    ``max_blocks`` blocks together (default: a quarter of the pool): the engine keeps
    the rest to serve with. A lease past the budget is granted the leading hashes that
    fit (maybe none); released and expired leases give their blocks back."""
    from types import SimpleNamespace

    from pdkv.serving.kv_pull import LeaseTable
    from pdkv.serving.protocol import LeaseRequest
    from pdkv.serving.prefix_hash import block_hashes, cache_salt

    pinned: dict[str, list[int]] = {}

    class Engine:
        pool = SimpleNamespace(num_blocks=40, block_tokens=4)

        def lease(self, lid: str, hashes: list[str]) -> list[int]:
            pinned[lid] = list(range(len(hashes)))
            return pinned[lid]

        def unlease(self, lid: str) -> bool:
            return pinned.pop(lid, None) is not None

    agent = SimpleNamespace(name="w", generations=lambda layout, ids: [1] * len(ids))
    now = [0.0]
    table = LeaseTable(agent, Engine(), address="127.0.0.1:1", clock=lambda: now[0])
    assert table.max_blocks == 10
    h = block_hashes(list(range(4 * 8)), 4, cache_salt("m", block_tokens=4, dtype="float32"))  # 8 blocks
    assert len(table.grant(LeaseRequest("a", tuple(h), 30.0)).blocks) == 8
    assert len(table.grant(LeaseRequest("b", tuple(h), 1.0)).blocks) == 2   # what is left of the budget
    assert len(table.grant(LeaseRequest("c", tuple(h), 30.0)).blocks) == 0  # none left: an empty lease
    assert sum(map(len, pinned.values())) == 10
    assert table.release("a")
    assert len(table.grant(LeaseRequest("d", tuple(h), 30.0)).blocks) == 8
    now[0] = 2.0  # "b" expires: its 2 blocks come back
    assert len(table.grant(LeaseRequest("e", tuple(h), 30.0)).blocks) == 2
    assert sum(map(len, pinned.values())) == 10
    with pytest.raises(pdkv.InvalidArgument):
        LeaseTable(agent, Engine(), address="x", max_blocks=-1)
