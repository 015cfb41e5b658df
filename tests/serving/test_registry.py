"""Serving pools from etcd: workers register, proxies route to what is registered,
a worker added under load enters rotation, one drained under load leaves it, and no
request is lost or changed (greedy outputs equal ``generate``). Each test runs its own
etcd; skipped without the etcd binary."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.discovery import Registry  # noqa: E402
from pdkv.errors import InvalidArgument  # noqa: E402
from pdkv.serving.proxy import ProxyConfig  # noqa: E402
from servers import Stack, completion_ids, get, post, sget, spost, tiny  # noqa: E402, F401 (tiny: a fixture)


TTL = 2


def rotation(proxy: str) -> dict[str, dict]:
    """The proxy's workers by URL (from /health)."""
    return {w["url"]: w for w in json.loads(get(proxy + "/health")[1])["workers"]}


def wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting until {what}"
        time.sleep(0.1)


class Load:
    """Clients sending the tiny prompts through ``proxies`` in turn until stopped;
    records every request's output (or failure) once."""

    def __init__(self, tiny, proxies: list[str], clients: int = 3) -> None:
        self.tiny, self.proxies = tiny, proxies
        self.results: list[tuple[int, list[int] | str]] = []  # (prompt index, output or error)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(c,)) for c in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, c: int) -> None:
        n = c
        while not self._stop.is_set():
            i = n % len(self.tiny.prompts)
            proxy = self.proxies[n % len(self.proxies)]
            try:
                out: list[int] | str = completion_ids(proxy, self.tiny.name, self.tiny.prompts[i])[0]
            except AssertionError as e:
                out = f"failed: {e}"
            with self._lock:
                self.results.append((i, out))
            n += 1

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> list[tuple[int, list[int] | str]]:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        return self.results


def test_proxy_config_takes_a_registry_instead_of_urls():
    cfg = ProxyConfig(mode="disagg", registry="etcd://127.0.0.1:2379")
    assert cfg.prefill == () and cfg.decode == ()
    with pytest.raises(InvalidArgument, match="etcd://host:port"):
        ProxyConfig(mode="disagg", registry="http://127.0.0.1:2379")
    with pytest.raises(InvalidArgument, match="decode"):
        ProxyConfig(mode="disagg")


def test_worker_config_checks_its_registry_before_anything_loads():
    from pdkv.serving.engine import EngineConfig
    from pdkv.serving.worker import WorkerConfig

    eng = EngineConfig(num_blocks=8)
    with pytest.raises(InvalidArgument, match="etcd://host:port"):
        WorkerConfig(role="decode", engine=eng, model_name="m", registry="127.0.0.1:2379")
    with pytest.raises(InvalidArgument, match="ttl must be an integer >= 2"):
        WorkerConfig(role="decode", engine=eng, model_name="m", registry="etcd://127.0.0.1:2379", registry_ttl=1)


def test_registrations_enter_and_leave_rotation_by_id():
    """The proxy's reaction to registry changes, without etcd: URLs follow the newest
    id (a worker restarted at the same URL), drained or removed ids leave, other roles
    and bad URLs are ignored, configured URLs are never removed by the registry."""
    from pdkv.serving.metrics import Registry as Metrics
    from pdkv.serving.proxy import ProxyBackend

    b = ProxyBackend(ProxyConfig(mode="disagg", decode=["http://fixed:1"], registry="etcd://127.0.0.1:1"),
                     Metrics())
    urls = lambda pool: [(w.url, w.registered_as) for w in pool.workers]  # noqa: E731
    b.discovery.apply_registration("d-1", {"url": "http://h:2", "role": "decode", "state": "serving"})
    b.discovery.apply_registration("p-1", {"url": "http://h:3/", "role": "prefill", "state": "serving"})
    b.discovery.apply_registration("c-1", {"url": "http://h:4", "role": "colocated", "state": "serving"})
    b.discovery.apply_registration("x-1", {"url": "ftp://h:5", "role": "decode", "state": "serving"})
    b.discovery.apply_registration("f-1", {"url": "http://fixed:1", "role": "decode", "state": "serving"})
    assert urls(b.decode) == [("http://fixed:1", ""), ("http://h:2", "d-1")]
    assert urls(b.prefill) == [("http://h:3", "p-1")]
    b.discovery.apply_registration("d-2", {"url": "http://h:2", "role": "decode", "state": "serving"})  # restarted
    b.discovery.apply_registration("d-1", None)  # the old instance's lease expires
    assert urls(b.decode) == [("http://fixed:1", ""), ("http://h:2", "d-2")]
    b.discovery.apply_registration("d-2", {"url": "http://h:2", "role": "decode", "state": "draining"})
    b.discovery.apply_registration("p-1", None)
    b.discovery.apply_registration("f-1", None)
    assert urls(b.decode) == [("http://fixed:1", "")] and urls(b.prefill) == []


def test_two_proxies_route_the_same_registered_pool(tiny, etcd):
    s = Stack()
    try:
        reg = dict(registry=etcd.url, registry_ttl=TTL)
        pre = s.worker(tiny, "prefill", **reg)
        dec = s.worker(tiny, "decode", **reg)
        workers = Registry(etcd.url).list("workers")[0]
        assert sorted((w["role"], w["url"], w["model"], w["state"]) for w in workers.values()) == \
            [("decode", dec, tiny.name, "serving"), ("prefill", pre, tiny.name, "serving")]
        assert all(w["capacity_tokens"] > 0 and "in_flight" in w["load"] for w in workers.values())
        p1 = s.proxy("disagg", decode=[], registry=etcd.url)
        p2 = s.proxy("disagg", decode=[], registry=etcd.url)
        proxies = Registry(etcd.url).list("proxies")[0].values()
        assert sorted((p["url"], p["mode"]) for p in proxies) == sorted([(p1, "disagg"), (p2, "disagg")])
        for proxy in (p1, p2):
            assert set(rotation(proxy)) == {pre, dec}
            for prompt, ref in zip(tiny.prompts, tiny.refs):
                ids, stats = completion_ids(proxy, tiny.name, prompt)
                assert ids == ref
        assert all(w["served"] > 0 for p in (p1, p2) for w in rotation(p).values())
    finally:
        s.close()


def test_worker_that_stops_refreshing_leaves_rotation(tiny, etcd):
    s = Stack()
    try:
        a = s.worker(tiny, "colocated", registry=etcd.url, registry_ttl=TTL)
        b = s.worker(tiny, "colocated", registry=etcd.url, registry_ttl=TTL)
        proxy = s.proxy("colocated", decode=[], registry=etcd.url)
        wait_for(lambda: set(rotation(proxy)) == {a, b}, 10, "both workers are in rotation")
        # b's lease is no longer kept alive (a frozen or partitioned worker): it expires.
        s.workers[b].registration._publication.close(delete=False)
        wait_for(lambda: set(rotation(proxy)) == {a}, TTL + 5, "the expired worker left rotation")
        for prompt, ref in zip(tiny.prompts, tiny.refs):
            assert completion_ids(proxy, tiny.name, prompt)[0] == ref
    finally:
        s.close()


def drain(worker: str, proxies: list[str], etcd) -> None:
    """Drains ``worker`` and waits until it left every proxy's rotation and the registry."""
    status, state = spost(worker + "/pd/drain", {})
    assert status == 200 and state["state"] == "draining"
    wait_for(lambda: all(worker not in rotation(p) for p in proxies), 10, f"{worker} left rotation")
    wait_for(lambda: json.loads(sget(worker + "/pd/drain")[1])["state"] == "drained", 60, f"{worker} drained")
    assert worker not in {w["url"] for w in Registry(etcd.url).list("workers")[0].values()}


def test_workers_added_and_drained_under_load_lose_nothing(tiny, etcd):
    """Scale-up and scale-down of both roles under load from two proxies: a prefill and a
    decode worker are added (both proxies route to them), then the first ones are
    drained and stopped. Every request is answered once with the reference output."""
    s = Stack()
    load = None
    try:
        reg = dict(registry=etcd.url, registry_ttl=TTL)
        pre1 = s.worker(tiny, "prefill", **reg)
        d1 = s.worker(tiny, "decode", **reg)
        proxies = [s.proxy("disagg", decode=[], registry=etcd.url) for _ in range(2)]
        load = Load(tiny, proxies)
        wait_for(lambda: load.count() >= 5, 60, "the load runs")
        # Scale up: a second worker of each role registers; both proxies route to them.
        pre2 = s.worker(tiny, "prefill", **reg)
        d2 = s.worker(tiny, "decode", **reg)
        for new in (pre2, d2):
            wait_for(lambda: all(rotation(p).get(new, {}).get("served", 0) > 0 for p in proxies), 60,
                     f"both proxies routed requests to {new}")
        assert all(rotation(p)[w]["served"] > 0 for p in proxies for w in (pre1, d1))
        # Scale down under load: drain the first worker of each role, then stop it.
        for old in (d1, pre1):
            drain(old, proxies, etcd)
            s.stop(old)
        before = load.count()
        wait_for(lambda: load.count() >= before + 5, 60, "the load continues on the added workers")
        results = load.stop()
        load = None
        print(f"add+drain under load: {len(results)} requests through 2 proxies")
        failed = [r for r in results if isinstance(r[1], str)]
        assert not failed, failed[:3]
        wrong = [(i, out) for i, out in results if out != tiny.refs[i]]
        assert not wrong, wrong[:3]
        assert set(rotation(proxies[0])) == set(rotation(proxies[1])) == {pre2, d2}
    finally:
        if load is not None:
            load.stop()
        s.close()


# ---------------------------------------------------------------------------- re-roling

def info_role(worker: str) -> str:
    return json.loads(sget(worker + "/pd/info")[1])["role"]


def test_worker_switches_role_and_serves_the_new_one(tiny):
    """``POST /pd/role`` switches an idle decode worker to prefill and back; the other
    role's routes answer 404 in each; outputs through a proxy stay the reference."""
    s = Stack()
    try:
        pre = s.worker(tiny, "prefill")
        d1 = s.worker(tiny, "decode")
        d2 = s.worker(tiny, "decode")
        assert spost(d2 + "/pd/role", {"role": "colocated"})[0] == 400
        assert spost(d2 + "/pd/role", {"rol": "prefill"})[0] == 400
        assert spost(d2 + "/pd/role", {"role": "decode"}) == (200, {"role": "decode", "switched": False})
        assert spost(d2 + "/pd/role", {"role": "prefill"}) == (200, {"role": "prefill", "switched": True,
                                                                   "from": "decode"})
        assert info_role(d2) == "prefill"
        status, body = spost(d2 + "/pd/decode", {})
        assert status == 404 and body["error"]["code"] == "wrong_role"
        proxy = s.proxy("disagg", prefill=[pre, d2], decode=[d1])
        for _ in range(2):  # both prefill workers get requests (least loaded, round-robin ties)
            for prompt, ref in zip(tiny.prompts, tiny.refs):
                assert completion_ids(proxy, tiny.name, prompt)[0] == ref
        assert rotation(proxy)[d2]["served"] > 0
        assert spost(d2 + "/pd/role", {"role": "decode"})[1]["switched"]
        assert spost(d2 + "/pd/prefill", {})[0] == 404
        back = s.proxy("hybrid", prefill=[pre], decode=[d2], hybrid_threshold=10)
        for prompt, ref in zip(tiny.prompts, tiny.refs):
            assert completion_ids(back, tiny.name, prompt)[0] == ref
    finally:
        s.close()


def rerole_policy(**kw):
    from pdkv.serving.rerole import RerolePolicy

    # Prefill made to look 1000x dearer than decode: the measured ratio wants every
    # worker but one in the prefill pool.
    return RerolePolicy(prefill_fixed_s=0.0, prefill_s_per_token=1.0, decode_tok_s=1000.0, interval_s=0.3,
                        window_s=60.0, min_requests=3, drain_timeout_s=30.0, **kw)


def _check_no_loss(load: Load, tiny) -> None:
    results = load.stop()
    failed = [r for r in results if isinstance(r[1], str)]
    assert not failed, failed[:3]
    wrong = [(i, out) for i, out in results if out != tiny.refs[i]]
    assert not wrong, wrong[:3]
    assert len(results) >= 10
    return results


def test_proxy_reroles_a_decode_worker_to_prefill_under_load(tiny):
    """The measured ratio moves towards prefill: the proxy drains one of two decode
    workers under load (its requests finish), switches it to prefill and routes
    prompts to it. Every request is answered once with the reference output."""
    s = Stack()
    load = None
    try:
        pre = s.worker(tiny, "prefill")
        d1 = s.worker(tiny, "decode")
        d2 = s.worker(tiny, "decode")
        proxy = s.proxy("disagg", prefill=[pre], decode=[d1, d2], rerole=rerole_policy())
        load = Load(tiny, [proxy])
        wait_for(lambda: sum(w["role"] == "prefill" for w in rotation(proxy).values()) == 2, 60,
                 "a decode worker moved to the prefill pool")
        moved = next(u for u, w in rotation(proxy).items() if w["role"] == "prefill" and u != pre)
        assert moved in (d1, d2) and info_role(moved) == "prefill"
        wait_for(lambda: rotation(proxy)[moved]["served"] > 0, 60, "the moved worker served prefills")
        results = _check_no_loss(load, tiny)
        load = None
        print(f"re-role under load: {len(results)} requests, 0 lost")
        # One decode worker is left: the pool never goes below one.
        assert sorted(w["role"] for w in rotation(proxy).values()) == ["decode", "prefill", "prefill"]
        metric = 'pdkv_worker_reroles_total{from="decode",result="ok",to="prefill"} 1.0\n'
        assert metric in get(proxy + "/metrics")[1]
    finally:
        if load is not None:
            load.stop()
        s.close()


def test_registered_worker_reroled_under_load_is_republished(tiny, etcd):
    """The same with workers from etcd and two proxies (one re-roles): the switched
    worker publishes itself in its new role, and the other proxy follows."""
    s = Stack()
    load = None
    try:
        reg = dict(registry=etcd.url, registry_ttl=TTL)
        s.worker(tiny, "prefill", **reg)
        d1 = s.worker(tiny, "decode", **reg)
        d2 = s.worker(tiny, "decode", **reg)
        p1 = s.proxy("disagg", decode=[], registry=etcd.url, rerole=rerole_policy())
        p2 = s.proxy("disagg", decode=[], registry=etcd.url)
        load = Load(tiny, [p1, p2])

        def roles() -> list[str]:
            return sorted(w["role"] for w in Registry(etcd.url).list("workers")[0].values())

        wait_for(lambda: roles() == ["decode", "prefill", "prefill"], 60, "the registry shows the new role")
        for p in (p1, p2):
            wait_for(lambda: sorted(w["role"] for w in rotation(p).values()) == ["decode", "prefill", "prefill"],
                     30, "both proxies route the new split")
        moved = d1 if info_role(d1) == "prefill" else d2
        wait_for(lambda: rotation(p2)[moved]["served"] > 0, 60, "the other proxy sent prefills to the moved worker")
        _check_no_loss(load, tiny)
        load = None
    finally:
        if load is not None:
            load.stop()
        s.close()


def test_proxy_started_while_etcd_is_down_is_listed_when_it_returns(etcd):
    s = Stack()
    try:
        etcd.stop()
        proxy = s.proxy("disagg", decode=[], registry=etcd.url, wait=False)
        assert json.loads(get(proxy + "/health")[1])["workers"] == []  # serving, with no worker yet
        etcd.start()
        wait_for(lambda: [p["url"] for p in Registry(etcd.url).list("proxies")[0].values()] == [proxy], 15,
                 "the proxy listed itself")
    finally:
        s.close()
