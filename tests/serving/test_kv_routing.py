"""KV-aware routing (proxy_kv): which decode and prefill workers a request goes to by
the KV they hold and their load, session affinity while the index is cold, dead workers
never chosen for their KV, and third-party leases passed to the prefill worker as
``src`` and released after it. Deterministic: fake pools, an index fed from in-process
event logs, and fake workers over HTTP for the lease path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402

from pdkv.serving.frontend import RequestTrace  # noqa: E402
from pdkv.serving.kv_index import KVIndex  # noqa: E402
from pdkv.serving.metrics import Registry  # noqa: E402
from pdkv.serving.protocol import GenParams, Reservation  # noqa: E402
from pdkv.serving.proxy_client import WorkerClient  # noqa: E402
from pdkv.serving.proxy_config import ProxyConfig  # noqa: E402
from pdkv.serving.proxy_kv import KVRouting, check_lease  # noqa: E402
from pdkv.serving.proxy_links import LinkHealth  # noqa: E402
from pdkv.serving.proxy_liveness import Liveness  # noqa: E402
from pdkv.serving.proxy_metrics import ProxyMetrics  # noqa: E402
from pdkv.serving.proxy_pool import WorkerPool  # noqa: E402
from pdkv.serving.proxy_prefill import PrefillLeg, PrefillOutcome  # noqa: E402
from test_kv_index import BT, HS, PROMPT, FakeCache, chain, sync  # noqa: E402

D0, D1, D2 = "http://d0", "http://d1", "http://d2"
P0, P1 = "http://p0", "http://p1"


class Fleet:
    """Pools, an index and KVRouting over fake workers whose caches the test fills."""

    def __init__(self, decode=(D0, D1), prefill=(P0, P1), load_tokens: int = 8, urls: dict[str, str] | None = None,
                 client: Any = None) -> None:
        self.cfg = ProxyConfig("disagg", prefill=list(prefill), decode=list(decode), secret="s", routing="kv",
                               kv_load_tokens=load_tokens, kv_timeout_s=5.0, connect_timeout_s=1.0)
        self.decode = WorkerPool("decode", decode)
        self.prefill = WorkerPool("prefill", prefill)
        for w in self.decode.workers + self.prefill.workers:
            w.info = object()  # type: ignore[assignment] - known (it answered /pd/info)
        self.index = KVIndex()
        self.caches: dict[str, FakeCache] = {}
        self.registry = Registry()
        self.metrics = ProxyMetrics(self.registry, lambda: self.prefill.workers + self.decode.workers, lambda: [])
        self.kv = KVRouting(self.cfg, self.index, self.prefill, self.decode, client, self.metrics, self.registry)

    def hold(self, url: str, blocks: int) -> None:
        c = self.caches.setdefault(url, FakeCache())
        c.store(HS[:blocks])
        sync(self.index, url, c)

    def worker(self, url: str):
        return next(w for w in self.decode.workers + self.prefill.workers if w.url == url)

    def metric(self, name: str) -> str:
        return "\n".join(x for x in self.registry.render().splitlines() if x.startswith(name))


def test_a_request_goes_to_the_decode_worker_holding_its_prefix():
    f = Fleet()
    f.hold(D1, 3)
    for _ in range(4):                       # not round-robin luck: every time
        plan = f.kv.plan(PROMPT, "")
        assert f.kv.pick_decode(plan, set()).url == D1
        assert plan.how == "kv_prefix" and plan.decode_tokens == 3 * BT
    assert 'how="kv_prefix"} 4' in f.metric("pdkv_kv_decode_picks_total")
    assert "kv_" not in f.metric("pdkv_routed_requests_total")  # summing routes counts each request once
    assert 'held_by="decode"} 48' in f.metric("pdkv_kv_route_matched_tokens_total")


def test_load_outweighs_a_small_match_but_not_a_large_one():
    f = Fleet(load_tokens=8)
    f.hold(D1, 1)                            # 4 tokens held
    f.worker(D1).in_flight = 2               # 2 requests weigh 16 tokens
    plan = f.kv.plan(PROMPT, "")
    assert f.kv.pick_decode(plan, set()).url == D0 and plan.how == "kv_load"
    f.hold(D1, 5)                            # the whole prompt: 20 tokens
    plan = f.kv.plan(PROMPT, "")
    assert f.kv.pick_decode(plan, set()).url == D1 and plan.how == "kv_prefix"


def test_session_affinity_when_the_index_is_cold_and_round_robin_without_a_session():
    f = Fleet()
    first = f.kv.pick_decode(plan := f.kv.plan(PROMPT, "alice"), set())
    assert plan.how == "kv_cold"
    for _ in range(4):
        plan = f.kv.plan(PROMPT, "alice")
        assert f.kv.pick_decode(plan, set()).url == first.url and plan.how == "kv_session"
    picks = [f.kv.pick_decode(f.kv.plan(PROMPT, ""), set()).url for _ in range(4)]
    assert sorted(picks) == [D0, D0, D1, D1]  # no session: every worker in turn
    # The prefill worker sticks to the session too.
    p = f.kv.pick_prefill(f.kv.plan(PROMPT, "bob"), 0, set())
    assert all(f.kv.pick_prefill(f.kv.plan(PROMPT, "bob"), 0, set()).url == p.url for _ in range(3))


def test_a_prefix_wins_over_session_affinity():
    f = Fleet()
    s = f.kv.pick_decode(f.kv.plan(PROMPT, "alice"), set()).url
    other = D1 if s == D0 else D0
    f.hold(other, 2)
    plan = f.kv.plan(PROMPT, "alice")
    assert f.kv.pick_decode(plan, set()).url == other and plan.how == "kv_prefix"


def test_a_dead_worker_is_never_chosen_for_its_kv():
    f = Fleet()
    f.hold(D1, 5)
    f.hold(P1, 5)
    f.worker(D1).alive = False               # missed a liveness probe
    f.worker(P1).down_until = float("inf")   # failed a request: cooling down
    for _ in range(3):
        plan = f.kv.plan(PROMPT, "")
        assert D1 not in plan.matched and P1 not in plan.matched
        assert f.kv.pick_decode(plan, set()).url == D0
        assert f.kv.pick_prefill(plan, 0, set()).url == P0
        assert f.kv.third(plan, P0, D0, 0) is None
    f.worker(D1).alive = True
    plan = f.kv.plan(PROMPT, "")
    assert f.kv.pick_decode(plan, {D1}).url == D0            # excluded after a failure: not chosen either
    assert f.kv.pick_decode(f.kv.plan(PROMPT, ""), set()).url == D1


def test_prefill_pick_counts_its_own_cache_and_what_decode_holds():
    f = Fleet()
    f.hold(P1, 3)
    plan = f.kv.plan(PROMPT, "")
    assert f.kv.pick_prefill(plan, 0, set()).url == P1       # computes 8 tokens, P0 would compute 20
    f.worker(P1).load_tokens = 5
    assert f.kv.pick_prefill(plan, 4 * BT, set()).url == P0  # decode holds more: both compute 4; P1 is loaded
    assert f.kv.pick_prefill(plan, 0, {P1}).url == P0


def test_a_third_worker_with_at_least_one_more_block_is_found():
    f = Fleet(decode=(D0, D1, D2))
    f.hold(P0, 1)
    f.hold(D2, 4)
    plan = f.kv.plan(PROMPT, "")
    assert f.kv.third(plan, P0, D0, BT) == (D2, 4 * BT)
    assert f.kv.third(plan, P0, D0, 3 * BT + 1) is None     # less than a block more
    assert f.kv.third(plan, P0, D2, BT) is None             # the decode worker itself holds it
    f.hold(P1, 5)
    plan = f.kv.plan(PROMPT, "")
    assert f.kv.third(plan, P0, D0, BT) == (P1, 5 * BT)      # the most wins, any pool


def test_check_lease_refuses_what_was_not_asked_for():
    good = {"lease_id": "r.lease", "agent": "h:1", "name": "a", "block_tokens": 4, "start": 1, "blocks": [7, 8],
            "generations": [0, 3]}
    assert check_lease(good, "r.lease", 1, 3) == good
    assert check_lease({**good, "lease_id": "x"}, "r.lease", 1, 3) is None
    assert check_lease({**good, "start": 0}, "r.lease", 1, 3) is None
    assert check_lease({**good, "blocks": [1, 2, 3]}, "r.lease", 1, 3) is None
    assert check_lease({**good, "generations": [0]}, "r.lease", 1, 3) is None
    assert check_lease({**good, "blocks": [-1, 2]}, "r.lease", 1, 3) is None
    assert check_lease({**good, "block_tokens": 0}, "r.lease", 1, 3) is None
    assert check_lease(None, "r.lease", 1, 3) is None


# ---------------------------------------------------------------- the lease path over HTTP
class FakeWorkers:
    """One aiohttp server playing a prefill worker (/pd/prefill) and a lease holder
    (/pd/kv_lease, /pd/kv_release) under several URL prefixes."""

    def __init__(self, lease_status: int = 200, lease_answer: Any = None) -> None:
        self.bodies: dict[str, list[Any]] = {"prefill": [], "lease": [], "release": []}
        self.lease_status = lease_status
        self.lease_answer = lease_answer
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/{w}/pd/prefill", self._prefill)
        app.router.add_post("/{w}/pd/kv_lease", self._lease)
        app.router.add_post("/{w}/pd/kv_release", self._release)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _prefill(self, request: web.Request) -> web.StreamResponse:
        self.bodies["prefill"].append((request.match_info["w"], await request.json()))
        resp = web.StreamResponse()
        await resp.prepare(request)
        for line in ({"first": {"t": 5}}, {"kv": {"ok": True, "posted": True, "bytes": 10, "transport": "tcp"}}):
            await resp.write(json.dumps(line).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def _lease(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies["lease"].append((request.match_info["w"], body))
        if self.lease_answer is not None:
            return web.json_response(self.lease_answer, status=self.lease_status)
        n = len(body["hashes"])
        return web.json_response({"lease": {"lease_id": body["lease_id"], "agent": "127.0.0.1:1", "name": "holder",
                                            "block_tokens": BT, "start": body["start"], "blocks": list(range(n)),
                                            "generations": [1] * n}}, status=self.lease_status)

    async def _release(self, request: web.Request) -> web.Response:
        self.bodies["release"].append((request.match_info["w"], await request.json()))
        return web.json_response({})


async def _prefill_through(fw: FakeWorkers, holder_blocks: int, prefill_blocks: int):
    base = await fw.start()
    p0, d0, d1 = f"{base}/p0", f"{base}/d0", f"{base}/d1"
    client = WorkerClient("s", 1.0)
    client.start()
    f = Fleet(decode=(d0, d1), prefill=(p0,), client=client)
    f.hold(d1, holder_blocks)
    if prefill_blocks:
        f.hold(p0, prefill_blocks)
    f.worker(d1).in_flight = 100             # the holder is too busy to decode this one
    liveness = Liveness(f.cfg, client, lambda: f.prefill.workers + f.decode.workers, f.metrics.m_failures)
    links = LinkHealth(f.cfg, f.prefill, f.decode, client, f.metrics.m_peer_auth, f.metrics.m_peer_transport)
    leg = PrefillLeg(f.cfg, f.prefill, client, liveness, links, f.metrics, f.kv)
    plan = f.kv.plan(PROMPT, "")
    d = f.kv.pick_decode(plan, set())
    trace = RequestTrace(decode_worker=d.url)
    out = PrefillOutcome()
    res = Reservation((1, 2, 3, 4, 5), "127.0.0.1:2", "decoder", BT)
    toks = [t async for t in leg.run("r1", PROMPT, GenParams(max_tokens=4), res, trace, out, plan=plan)]
    for _ in range(50):                      # the release is sent in the background
        if fw.bodies["release"] or not fw.bodies["lease"]:
            break
        await asyncio.sleep(0.02)
    await f.kv.close()
    await client.close()
    await fw.close()
    return d, toks, out, trace, f


def test_a_third_workers_lease_goes_to_the_prefill_worker_as_src_and_is_released():
    fw = FakeWorkers()
    d, toks, out, trace, f = asyncio.run(_prefill_through(fw, holder_blocks=4, prefill_blocks=1))
    assert d.url.endswith("/d0") and [t.token_id for t in toks] == [5] and out.kv_ok
    [(holder, lease_req)] = fw.bodies["lease"]
    assert holder == "d1" and lease_req["start"] == 1 and lease_req["hashes"] == chain(PROMPT)[1:4]
    assert lease_req["lease_id"] == "r1.lease" and lease_req["ttl_s"] > 0
    [(pw, body)] = fw.bodies["prefill"]
    assert pw == "p0" and body["src"]["lease_id"] == "r1.lease" and body["src"]["start"] == 1
    assert body["src"]["blocks"] == [0, 1, 2] and body["dst"]["blocks"] == [1, 2, 3, 4, 5]
    assert fw.bodies["release"] == [("d1", {"lease_id": "r1.lease"})]
    assert trace.extra["kv_lease_worker"].endswith("/d1")
    assert 'result="ok"} 1' in f.metric("pdkv_kv_leases_total")


def test_no_lease_when_no_third_worker_holds_a_block_more():
    fw = FakeWorkers()
    _d, toks, out, _trace, _f = asyncio.run(_prefill_through(fw, holder_blocks=2, prefill_blocks=2))
    assert [t.token_id for t in toks] == [5] and out.kv_ok
    assert fw.bodies["lease"] == [] and "src" not in fw.bodies["prefill"][0][1]


@pytest.mark.parametrize("status, answer, result", [(500, {"error": "boom"}, "failed"),
                                                    (200, {"lease": {"lease_id": "someone-else"}}, "failed"),
                                                    (200, {"lease": {"lease_id": "r1.lease", "agent": "a", "name": "n",
                                                                     "block_tokens": 4, "start": 1, "blocks": [],
                                                                     "generations": []}}, "empty")])
def test_a_failed_lease_means_no_src_and_the_prefill_runs(status, answer, result):
    fw = FakeWorkers(lease_status=status, lease_answer=answer)
    _d, toks, out, _trace, f = asyncio.run(_prefill_through(fw, holder_blocks=4, prefill_blocks=0))
    assert [t.token_id for t in toks] == [5] and out.kv_ok
    assert len(fw.bodies["lease"]) == 1 and "src" not in fw.bodies["prefill"][0][1]
    assert f'result="{result}"}} 1' in f.metric("pdkv_kv_leases_total")
    # An answered but unusable lease is released at once.
    assert len(fw.bodies["release"]) == (1 if status == 200 else 0)


# ---------------------------------------------------------------- flags and config
def test_proxy_flags_reach_the_config():
    from pdkv.errors import InvalidArgument
    from pdkv.serving.cli import _proxy_config, build_parser
    from pdkv.serving.proxy_config import Routing

    base = ["proxy", "--prefill", P0, "--decode", D0, "--secret", "s"]
    cfg = _proxy_config(build_parser().parse_args(base))
    assert cfg.routing is Routing.ROUND_ROBIN and cfg.kv_events_interval_s == 0.25
    assert cfg.kv_snapshot_interval_s == 10.0 and cfg.kv_load_tokens == 128
    cfg = _proxy_config(build_parser().parse_args(base + ["--routing", "kv", "--kv-events-interval", "0.5",
                                                          "--kv-snapshot-interval", "3", "--kv-load-tokens", "7"]))
    assert (cfg.routing, cfg.kv_events_interval_s, cfg.kv_snapshot_interval_s, cfg.kv_load_tokens) == \
        (Routing.KV, 0.5, 3.0, 7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--routing", "random"])
    for bad in ({"routing": "nope"}, {"kv_events_interval_s": 0}, {"kv_snapshot_interval_s": -1},
                {"kv_load_tokens": -1}):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            ProxyConfig("disagg", prefill=[P0], decode=[D0], **bad)


def test_session_ids_are_validated():
    from pdkv.serving.openai_api import APIError, Endpoint, parse_request, session_id

    assert parse_request({"model": "m", "prompt": [1], "user": "alice"}, Endpoint.COMPLETIONS).user == "alice"
    assert parse_request({"model": "m", "prompt": [1]}, Endpoint.COMPLETIONS).user == ""
    for bad in (7, "x" * 257, ["a"], "\ud800"):
        with pytest.raises(APIError) as e:
            parse_request({"model": "m", "prompt": [1], "user": bad}, Endpoint.COMPLETIONS)
        assert e.value.status == 400 and e.value.param == "user"
    assert session_id(None, "X-Session-Id") == ""
    with pytest.raises(APIError, match="X-Session-Id"):
        session_id("y" * 300, "X-Session-Id")
