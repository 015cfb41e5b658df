"""Who may call a worker: every ``/pd/*`` route of every role needs a proxy's request
signature (``X-PDKV-Auth``, pdkv.serving.auth); a call without one, with another
secret's, a replayed or an expired one is refused with 401 before the body is parsed
and with no side effect (no engine work, no blocks reserved, no role switch, no
outbound connection). The proxy signs all its calls, reports workers that refuse it or
no longer have their pool's role, and its public port serves only the OpenAI API,
health and metrics (optionally behind API keys)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from servers import SECRET, Stack, completion_ids, get, post, sget, signed, spost, tiny  # noqa: E402, F401

from pdkv.credential import Credential  # noqa: E402
from pdkv.serving.auth import AUTH_HEADER, WorkerAuth, sign_headers  # noqa: E402
from pdkv.serving.protocol import GenerateRequest, GenParams, PrefillRequest, Reservation  # noqa: E402

WRONG = "some-other-secret"


class Listener:
    """An "attacker" TCP listener on 127.0.0.1: counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._t.join()
        self.sock.close()


@pytest.fixture(scope="module")
def stack(tiny):
    s = Stack()
    try:
        s.p = s.worker(tiny, "prefill")
        s.d = s.worker(tiny, "decode", mode="chunked", max_batch_tokens=16)
        s.c = s.worker(tiny, "colocated")
        s.attacker = Listener()
        yield s
    finally:
        s.close()
        if hasattr(s, "attacker"):
            s.attacker.close()


def _params() -> GenParams:
    return GenParams(max_tokens=4, temperature=0.0, top_p=1.0, seed=1)


def _bodies(attacker: str) -> dict[str, object]:
    """A body per POST route that, if accepted, would do work, reserve blocks, switch a
    role or dial ``attacker``."""
    gen = GenerateRequest("evil-1", (11, 12, 13, 14, 15), _params(), 30.0).to_json()
    dst = Reservation((1, 2), attacker, "decode-evil", 4)
    return {
        "/pd/prefill": PrefillRequest("evil-2", (11, 12, 13, 14, 15), _params(), dst, 30.0).to_json(),
        "/pd/check_peer": {"agent": attacker, "timeout": 3},
        "/pd/decode": gen,
        "/pd/kv_failed": {"rid": "evil-1", "terminal": True},
        "/pd/generate": {**gen, "rid": "evil-3"},
        "/pd/role": {"role": "flip"},     # replaced per worker: the other role
        "/pd/drain": {},
        "/pd/nonexistent": {},
    }


#: (role, method, path) of every /pd/* route of every role (unknown paths too).
ROUTES = [(role, "GET", path) for role in ("prefill", "decode", "colocated")
          for path in ("/pd/info", "/pd/stats", "/pd/drain", "/pd/nonexistent")] + \
    [(role, "POST", path) for role in ("prefill", "decode")
     for path in ("/pd/prefill", "/pd/check_peer", "/pd/decode", "/pd/kv_failed", "/pd/generate", "/pd/role",
                  "/pd/drain", "/pd/nonexistent")] + \
    [("colocated", "POST", path) for path in ("/pd/generate", "/pd/prefill", "/pd/role", "/pd/nonexistent")]

ATTACKS = ("no_credential", "wrong_secret", "replayed", "expired", "future", "malformed", "body_swapped")


def _url(stack, role: str) -> str:
    return {"prefill": stack.p, "decode": stack.d, "colocated": stack.c}[role]


def _send(method: str, url: str, data: bytes | None, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            try:
                return r.status, json.loads(raw or b"{}")
            except ValueError:
                return r.status, {"raw": raw.decode(errors="replace")}
    except urllib.error.HTTPError as e:
        with e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"raw": raw.decode(errors="replace")}


def _observable(stack, url: str) -> dict:
    """What a call with a side effect would change (read in-process, not over HTTP)."""
    w = stack.workers[url]
    eng = w.engine
    return {"role": w.role.value, "steps": eng.num_steps, "free": eng.num_free_blocks,
            "waiting": eng.num_waiting, "running": eng.num_running, "in_flight": w.in_flight,
            "sender_peers": dict(w.sender._peers) if w.sender is not None else {},
            "links": w.links(), "draining": getattr(w.registration, "state", "serving")}


class TestWorkerRoutesRefuseUnsignedCalls:
    """Every /pd/* route of every role x every way of lacking a valid signature: 401
    naming the problem, and nothing happens."""

    @pytest.mark.parametrize("attack", ATTACKS)
    @pytest.mark.parametrize("role,method,path", ROUTES, ids=[f"{r}-{m}-{p[4:]}" for r, m, p in ROUTES])
    def test_refused_without_side_effect(self, stack, role, method, path, attack) -> None:
        url = _url(stack, role)
        target = url + path
        body = _bodies(stack.attacker.address).get(path, {}) if method == "POST" else None
        if path == "/pd/role":
            body = {"role": "decode" if role == "prefill" else "prefill", "timeout": 5}
        data = json.dumps(body).encode() if body is not None else None
        raw = data or b""
        headers: dict[str, str] = {}
        if attack == "wrong_secret":
            headers = signed(method, target, raw, secret=WRONG)
        elif attack == "expired":
            headers = sign_headers(Credential(SECRET), method, target, raw, ts=int(time.time()) - 3600)
        elif attack == "future":
            headers = sign_headers(Credential(SECRET), method, target, raw, ts=int(time.time()) + 3600)
        elif attack == "malformed":
            headers = {AUTH_HEADER: "v1 ts=1 nonce=zz mac=" + SECRET}
        elif attack == "body_swapped":  # signed for another body than the one sent
            headers = signed(method, target, raw + b" ")
        elif attack == "replayed":
            # A captured call: its original went through (its nonce is in the worker's
            # cache; TestReplayOfAnAcceptedCall replays calls really served first).
            headers = signed(method, target, raw)
            nonce = headers[AUTH_HEADER].split("nonce=")[1].split()[0]
            auth = stack.workers[url].auth
            auth._nonces[nonce] = time.time() + 60
            auth._order.append((time.time() + 60, nonce))
        before = _observable(stack, url)
        accepted0 = stack.attacker.accepted
        status, obj = _send(method, target, data, headers)
        assert status == 401, (status, obj)
        err = obj["error"]
        want = {"no_credential": "auth_missing", "wrong_secret": "auth_failed", "replayed": "replayed",
                "expired": "expired", "future": "expired", "malformed": "auth_malformed",
                "body_swapped": "auth_failed"}[attack]
        assert err["code"] == want, err
        assert err["message"]
        text = json.dumps(obj)
        agent = stack.workers[url].agent
        if agent is not None:
            assert agent.address not in text  # nothing about the agent leaks
        time.sleep(0.3)  # a dial or an engine step would have happened by now
        assert _observable(stack, url) == before
        assert stack.attacker.accepted == accepted0, "an unsigned call made the worker connect out"


class TestReplayOfAnAcceptedCall:
    """A captured call that did its work once is refused the second time."""

    @pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
    def test_replayed_stats_and_generate(self, stack, tiny, role) -> None:
        url = _url(stack, role)
        h = signed("GET", url + "/pd/stats")
        assert _send("GET", url + "/pd/stats", None, h)[0] == 200
        status, obj = _send("GET", url + "/pd/stats", None, h)
        assert status == 401 and obj["error"]["code"] == "replayed"
        if role == "prefill":
            return
        body = json.dumps(GenerateRequest(f"replay-{role}", tuple(tiny.prompts[1]), _params()).to_json()).encode()
        h = signed("POST", url + "/pd/generate", body)
        req = urllib.request.Request(url + "/pd/generate", data=body, headers={**h, "Content-Type":
                                                                                "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            lines = [json.loads(x) for x in r.read().splitlines() if x.strip()]
        assert "done" in lines[-1]
        steps = stack.workers[url].engine.num_steps
        status, obj = _send("POST", url + "/pd/generate", body, h)
        assert status == 401 and obj["error"]["code"] == "replayed"
        assert stack.workers[url].engine.num_steps == steps


def test_signed_check_peer_does_connect(stack) -> None:
    """The control of the no-outbound-connection checks: the listener does see a dial
    when the call is signed (the handshake then fails: it is no agent)."""
    body = {"agent": stack.attacker.address, "timeout": 1}
    n = stack.attacker.accepted
    status, obj = spost(stack.p + "/pd/check_peer", body)
    assert status == 200 and obj["ok"] is False
    deadline = time.monotonic() + 5
    while stack.attacker.accepted == n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.attacker.accepted > n


def test_unsigned_role_switch_leaves_the_role(stack) -> None:
    for attack in ({}, signed("POST", stack.d + "/pd/role", b'{"role": "prefill"}', secret=WRONG)):
        status, obj = _send("POST", stack.d + "/pd/role", b'{"role": "prefill"}', attack)
        assert status == 401
        assert stack.workers[stack.d].role.value == "decode"
    assert json.loads(sget(stack.d + "/pd/info")[1])["role"] == "decode"


def test_info_and_stats_reveal_nothing_unsigned_and_public_routes_hide_the_agent(stack) -> None:
    for url in (stack.p, stack.d):
        addr = stack.workers[url].agent.address
        for path in ("/pd/info", "/pd/stats"):
            status, text = get(url + path)
            assert status == 401 and addr not in text and "free_blocks" not in text
        # Signed, the proxy gets the details.
        status, text = sget(url + "/pd/info")
        assert status == 200 and json.loads(text)["agent"]["address"] == addr
        for path in ("/health", "/metrics"):
            status, text = get(url + path)
            assert status == 200, (path, status)
            assert addr not in text and SECRET not in text, (path, text[:300])
    # The prefill worker's links to decode agents show as opaque ids in public.
    assert spost(stack.p + "/pd/check_peer", {"agent": stack.workers[stack.d].agent.address, "timeout": 5})[0] \
        == 200
    health = json.loads(get(stack.p + "/health")[1])
    assert health["peers"] and all(k.startswith("peer-") for k in health["peers"])
    assert stack.workers[stack.d].agent.address not in get(stack.p + "/health")[1]
    # The colocated worker's OpenAI API stays open without a signature.
    status, obj = post(stack.c + "/v1/completions", {"model": "nope", "prompt": [1], "max_tokens": 1})
    assert status == 404 and obj["error"]["code"] == "model_not_found"


def test_worker_without_a_secret_refuses_all_pd_calls(tiny, monkeypatch) -> None:
    """A colocated worker started without any secret: /pd/* is closed to everyone
    (nothing can sign for it), its OpenAI API is open."""
    from pdkv.serving.aio import ServerThread
    from pdkv.serving.engine import EngineConfig
    from pdkv.serving.worker import Worker, WorkerConfig

    monkeypatch.delenv("PDKV_SECRET", raising=False)
    eng = EngineConfig(num_blocks=32, block_tokens=4, mode="colocated", max_batch_tokens=64, max_num_seqs=4,
                       num_threads=1)
    w = Worker(tiny.model, WorkerConfig(role="colocated", engine=eng, model_name=tiny.name), codec=tiny.codec)
    with ServerThread(w) as t:
        for hdr in ({}, signed("GET", t.url + "/pd/info")):
            status, obj = _send("GET", t.url + "/pd/info", None, hdr)
            assert status == 401 and obj["error"]["code"] == "auth_disabled"
        ids, _ = completion_ids(t.url, tiny.name, tiny.prompts[1])
        assert ids == tiny.refs[1]


def test_nonce_cache_full_refuses_rather_than_forgets() -> None:
    """When the nonce cache is full, signed calls are refused (503) instead of evicting a
    nonce that could then be replayed; unsigned calls never enter it."""
    from aiohttp import ClientSession, web

    cred = Credential(SECRET)

    async def body(request):
        return await request.read()

    auth = WorkerAuth(cred, body, max_nonces=2)

    async def ok(request):
        return web.json_response({"ok": True})

    async def main() -> list[int]:
        app = web.Application(middlewares=[auth.middleware])
        app.router.add_get("/pd/x", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/pd/x"
        out = []
        async with ClientSession() as s:
            for _ in range(3):  # unsigned: refused, and not remembered
                async with s.get(url) as r:
                    out.append(r.status)
            for _ in range(3):
                async with s.get(url, headers=sign_headers(cred, "GET", "/pd/x")) as r:
                    out.append(r.status)
        await runner.cleanup()
        return out

    assert asyncio.run(main()) == [401, 401, 401, 200, 200, 503]
    assert len(auth._nonces) == 2


def test_nonces_are_forgotten_after_twice_the_window() -> None:
    now = [1000.0]

    async def body(request):
        return b""

    auth = WorkerAuth(Credential(SECRET), body, window_s=30, max_nonces=10, clock=lambda: now[0])
    auth._nonces["a" * 32] = now[0] + 60
    auth._order.append((now[0] + 60, "a" * 32))
    now[0] += 59
    auth._purge(now[0])
    assert "a" * 32 in auth._nonces
    now[0] += 2
    auth._purge(now[0])
    assert not auth._nonces


# ---------------------------------------------------------------------------- the proxy


def test_proxy_signs_every_call_and_reports_workers_that_refuse_it(tiny, stack) -> None:
    """A proxy whose secret the workers do not accept cannot serve, and says why in
    /health; one with the right secret serves (all its calls are signed)."""
    s = Stack()
    try:
        bad = s.proxy("disagg", prefill=[stack.p], decode=[stack.d], secret=WRONG, wait=False)
        deadline = time.monotonic() + 20
        health = {}
        while time.monotonic() < deadline:
            status, text = get(bad + "/health")
            health = json.loads(text)
            if len(health.get("misconfigured_workers", [])) == 2:
                break
            time.sleep(0.2)
        assert status == 503 and health["status"] != "ok"
        assert {w["url"] for w in health["misconfigured_workers"]} == {stack.p, stack.d}
        assert all("401" in w["problem"] and "secret" in w["problem"] for w in health["misconfigured_workers"])
        good = s.proxy("disagg", prefill=[stack.p], decode=[stack.d])
        ids, st = completion_ids(good, tiny.name, tiny.prompts[3])
        assert ids == tiny.refs[3] and st["recomputed"] is False, st
        assert json.loads(get(good + "/health")[1])["misconfigured_workers"] == []
    finally:
        s.close()


def test_proxy_health_lists_a_worker_whose_role_changed_under_it(tiny) -> None:
    s = Stack()
    try:
        p = s.worker(tiny, "prefill")
        d1 = s.worker(tiny, "decode")
        d2 = s.worker(tiny, "decode")
        proxy = s.proxy("disagg", prefill=[p], decode=[d1, d2], liveness_s=0.3)
        assert json.loads(get(proxy + "/health")[1])["status"] == "ok"
        # Someone else (another proxy) switches d2 to prefill.
        assert spost(d2 + "/pd/role", {"role": "prefill"})[1]["switched"]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            health = json.loads(get(proxy + "/health")[1])
            if health["misconfigured_workers"]:
                break
            time.sleep(0.2)
        assert health["status"] == "degraded"
        [bad] = health["misconfigured_workers"]
        assert bad["url"] == d2 and "prefill" in bad["problem"], bad
        assert not next(w for w in health["workers"] if w["url"] == d2)["up"]
        for prompt, ref in zip(tiny.prompts[:3], tiny.refs[:3]):  # served by d1 only
            assert completion_ids(proxy, tiny.name, prompt)[0] == ref
    finally:
        s.close()


def test_proxy_without_a_secret_does_not_start(monkeypatch, stack) -> None:
    from pdkv.errors import InvalidArgument
    from pdkv.serving.aio import ServerThread
    from pdkv.serving.proxy import Proxy, ProxyConfig

    monkeypatch.delenv("PDKV_SECRET", raising=False)
    cfg = ProxyConfig("disagg", prefill=[stack.p], decode=[stack.d])
    assert "secret" not in repr(ProxyConfig("disagg", prefill=[stack.p], decode=[stack.d], secret="xyz")) or \
        "xyz" not in repr(ProxyConfig("disagg", prefill=[stack.p], decode=[stack.d], secret="xyz"))
    with pytest.raises(InvalidArgument, match="PDKV_SECRET"):
        ServerThread(Proxy(cfg)).start()


#: Paths a client might try on the proxy's public port.
NON_PUBLIC = ["/pd/info", "/pd/stats", "/pd/prefill", "/pd/decode", "/pd/generate", "/pd/kv_failed",
              "/pd/check_peer", "/pd/role", "/pd/drain", "/admin", "/v1/../pd/info", "/debug", "/v2/completions"]


@pytest.fixture(scope="module")
def proxies(tiny, stack):
    s = Stack()
    try:
        open_ = s.proxy("disagg", prefill=[stack.p], decode=[stack.d])
        keyed = s.proxy("disagg", prefill=[stack.p], decode=[stack.d], api_keys=("key-one", "key-two"))
        yield open_, keyed
    finally:
        s.close()


class TestProxyPublicPort:
    """The proxy's port serves the OpenAI API, /health and /metrics only; with API keys,
    everything but /health needs one."""

    @pytest.mark.parametrize("path", NON_PUBLIC)
    @pytest.mark.parametrize("method", ["GET", "POST"])
    def test_non_public_paths_are_404(self, proxies, path, method) -> None:
        open_, keyed = proxies
        status, obj = _send(method, open_ + path, b"{}" if method == "POST" else None,
                            signed(method, open_ + path, b"{}" if method == "POST" else b""))
        assert status in (404, 405), (status, obj)
        assert "error" in obj
        status, obj = _send(method, keyed + path, b"{}" if method == "POST" else None, {})
        assert status == 401 and obj["error"]["code"] == "invalid_api_key"

    def test_api_keys(self, proxies, tiny) -> None:
        _open, keyed = proxies
        body = {"model": tiny.name, "prompt": tiny.prompts[2], "max_tokens": 3, "temperature": 0,
                "return_token_ids": True}
        data = json.dumps(body).encode()
        for hdr in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"},
                    {"Authorization": "Basic key-one"}, {"Authorization": "Bearer "}):
            status, obj = _send("POST", keyed + "/v1/completions", data, hdr)
            assert status == 401, hdr
            assert set(obj["error"]) == {"message", "type", "param", "code"}
            assert obj["error"]["type"] == "invalid_request_error" and obj["error"]["code"] == "invalid_api_key"
        for key in ("key-one", "key-two"):
            status, obj = _send("POST", keyed + "/v1/completions", data, {"Authorization": f"Bearer {key}"})
            assert status == 200 and obj["choices"][0]["token_ids"] == tiny.refs[2][:3]
        for path in ("/v1/models", "/metrics"):
            assert _send("GET", keyed + path, None, {})[0] == 401
            assert _send("GET", keyed + path, None, {"Authorization": "Bearer key-two"})[0] == 200
        assert get(keyed + "/health")[0] == 200

    def test_api_key_from_env(self, monkeypatch) -> None:
        from pdkv.serving.proxy import ProxyConfig, api_keys

        monkeypatch.setenv("PDKV_API_KEY", "a, b,")
        assert api_keys(ProxyConfig("disagg", prefill=["http://a:1"], decode=["http://b:1"])) == ("a", "b")
        assert api_keys(ProxyConfig("disagg", prefill=["http://a:1"], decode=["http://b:1"], api_keys=("c",))) \
            == ("c",)


def test_drain_needs_a_signature(tiny, etcd) -> None:
    """``/pd/drain`` (registered workers) is an admin call like ``/pd/role``."""
    s = Stack()
    try:
        w = s.worker(tiny, "decode", registry=etcd.url, registry_ttl=5)
        for hdr in ({}, signed("POST", w + "/pd/drain", b"{}", secret=WRONG)):
            status, obj = _send("POST", w + "/pd/drain", b"{}", hdr)
            assert status == 401
        assert s.workers[w].registration.state == "serving"
        status, obj = spost(w + "/pd/drain", {})
        assert status == 200 and obj["state"] == "draining"
    finally:
        s.close()


def test_decode_worker_survives_hostile_notifications(tiny, stack) -> None:
    """A peer with the secret sends notifications no prefill worker would (nested JSON
    past the recursion limit, wrong types, not UTF-8): each is dropped and counted, and
    the decode worker still receives KV afterwards (its notification loop lives)."""
    import pdkv

    d = stack.workers[stack.d]
    before = sum(d.receiver.dropped.values())
    evil = pdkv.Agent("evil-peer", secret=SECRET)
    try:
        peer = evil.connect(d.agent.address, timeout=10)
        payloads = [b"[" * 5000, b'{"rid": 1, "t": 1, "seed": 1}', b"\xff\xfe", b'{"a":' * 3000 + b"1" + b"}" * 3000]
        for payload in payloads:
            evil.notify(peer, payload, timeout=10).wait()
        deadline = time.monotonic() + 10
        while sum(d.receiver.dropped.values()) < before + len(payloads) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(d.receiver.dropped.values()) == before + len(payloads)
        assert "pdkv_notifications_dropped_total" in get(stack.d + "/metrics")[1]
        base = stack.proxy("disagg", prefill=[stack.p], decode=[stack.d])
        ids, st = completion_ids(base, tiny.name, tiny.prompts[3])
        assert ids == tiny.refs[3] and st["recomputed"] is False, st
    finally:
        evil.close()


@pytest.mark.parametrize("kv_timeout", [1e9, 61, "Infinity"])
def test_decode_refuses_a_kv_timeout_past_the_cap(stack, tiny, kv_timeout) -> None:
    """Three idle signed-in sockets with kv_timeout_s=1e9 used to hold the whole decode
    KV pool for 60 s+: now 400, naming the field and the cap, nothing reserved."""
    body = GenerateRequest("big-timeout", tuple(tiny.prompts[4]), _params()).to_json()
    raw = json.dumps(body).replace('"kv_timeout_s": 30.0', f'"kv_timeout_s": {kv_timeout}').encode()
    url = stack.d + "/pd/decode"
    free = stack.workers[stack.d].engine.num_free_blocks
    status, obj = _send("POST", url, raw, signed("POST", url, raw))
    assert status == 400, obj
    assert "kv_timeout_s" in obj["error"]["message"]
    if kv_timeout != "Infinity":
        assert "cap of 60 s" in obj["error"]["message"]
    assert stack.workers[stack.d].engine.num_free_blocks == free
    raw = json.dumps(PrefillRequest("big-timeout", tuple(tiny.prompts[4]), _params(),
                                    Reservation((1,), "127.0.0.1:1", "d", 4), 1e9).to_json()).encode()
    url = stack.p + "/pd/prefill"
    status, obj = _send("POST", url, raw, signed("POST", url, raw))
    assert status == 400 and "kv_timeout_s" in obj["error"]["message"]


def test_cli_flags() -> None:
    from pdkv.serving.cli import build_parser

    a = build_parser().parse_args(["proxy", "--secret", "s", "--api-key", "k1", "--api-key", "k2"])
    assert (a.secret, a.api_key) == ("s", ["k1", "k2"])
    for role in ("prefill", "decode", "colocated"):
        a = build_parser().parse_args([role, "--max-kv-timeout", "5", "--secret", "s"])
        assert (a.max_kv_timeout, a.secret) == (5.0, "s")
