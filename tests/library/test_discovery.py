"""Discovery through etcd (pdkv.discovery): publish, resolve by name, lease expiry,
restart -> StalePeer, etcd down and back. Each test runs its own etcd (Debian's
etcd-server) on a free 127.0.0.1 port; skipped where the binary is absent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import pdkv
from conftest import SECRET, wait_until
from kvpools import Pool, PoolSpec
from pdkv.discovery import Registry, parse_registry_url


SPEC = PoolSpec(layers=2, blocks=16, block_tokens=4, heads=2, head_dim=8, dtype="float16")
TTL = 2


def agent(name, etcd, **kw):
    return pdkv.Agent(name, secret=SECRET, transports=["tcp"], registry=Registry(etcd.url, ttl=TTL), **kw)


def pool_agent(name, etcd, seed, **kw):
    a = agent(name, etcd, **kw)
    pool = Pool(SPEC, seed)
    pool.register(a)
    return a, pool


def write_and_check(src, src_pool, dst_pool, peer):
    x = src.write(peer, pdkv.Blocks("kv", [1, 2]), pdkv.Blocks("kv", [5, 6]), notify=b"ready")
    assert x.wait(20)
    assert np.array_equal(dst_pool.logical([5, 6]), src_pool.logical([1, 2]))


def test_registry_url_is_checked():
    assert parse_registry_url("etcd://10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert parse_registry_url("etcd://h") == ("h", 2379)
    for bad in ("http://h:1", "etcd://:1", "etcd://h:x", "etcd://h:1/path", 5):
        with pytest.raises(pdkv.InvalidArgument, match="etcd://host:port|invalid port"):
            parse_registry_url(bad)
    with pytest.raises(pdkv.InvalidArgument, match="ttl"):
        Registry("etcd://127.0.0.1:1", ttl=1)


def test_publish_resolve_by_name_and_transfer(etcd):
    a, pa = pool_agent("decode-0", etcd, 1)
    b, pb = pool_agent("prefill-0", etcd, 2)
    with a, b:
        rec = b.registry.lookup_agent("decode-0")
        assert rec["name"] == "decode-0" and rec["instance_id"] == a.instance_id and rec["address"] == a.address
        assert b.connect("decode-0") == "decode-0"
        write_and_check(b, pb, pa, "decode-0")
        names, _ = b.registry.list("agents")
        assert set(names) == {"decode-0", "prefill-0"}
        with pytest.raises(pdkv.NotFound, match=rf"no agent named 'nobody'.*etcd at 127.0.0.1:{etcd.port}"):
            b.connect("nobody")
        b.connect(a.address)  # an address still works as before
    # Closing an agent removes its key at once (the lease is revoked).
    assert Registry(etcd.url).list("agents")[0] == {}


def test_without_registry_connect_by_address_only():
    with pdkv.Agent("x", secret=SECRET, transports=["tcp"]) as x, pdkv.Agent("y", secret=SECRET) as y:
        assert x.registry is None
        assert y.connect(x.address) == "x"


def test_registration_follows_new_regions(etcd):
    with agent("late", etcd) as a:
        reg = a.registry
        before = reg.lookup_agent("late")["metadata"]
        Pool(SPEC, 3).register(a)
        assert wait_until(lambda: reg.lookup_agent("late")["metadata"] != before, timeout=TTL * 2)


def test_lease_expires_when_the_publisher_dies(etcd):
    code = ("import pdkv, sys, time; from pdkv.discovery import Registry;"
            f"a = pdkv.Agent('doomed', transports=['tcp'], registry=Registry({etcd.url!r}, ttl={TTL}));"
            "print('up', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        reg = Registry(etcd.url)
        assert reg.lookup_agent("doomed")["name"] == "doomed"
        os.kill(p.pid, signal.SIGKILL)  # no chance to revoke: only the lease removes it
        p.wait(10)
        assert wait_until(lambda: "doomed" not in reg.list("agents")[0], timeout=TTL + 5)
        with pytest.raises(pdkv.NotFound, match="doomed"):
            reg.lookup_agent("doomed")
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_restarted_agent_replaces_its_key_and_old_holders_see_stale_peer(etcd):
    with pdkv.Agent("probe") as probe:
        listen = probe.address  # a free port to reuse across the restart
    old, pold = pool_agent("decode-0", etcd, 1, listen=listen)
    b, pb = pool_agent("prefill-0", etcd, 2)
    with b:
        b.connect("decode-0")
        prepared = b.prepare("write", "decode-0", pdkv.Blocks("kv", [1, 2]), pdkv.Blocks("kv", [5, 6]))
        assert prepared.post(notify=b"one").wait(20)
        old_instance = old.instance_id
        old.close()
        new, pnew = pool_agent("decode-0", etcd, 4, listen=listen)
        with new:
            rec = b.registry.lookup_agent("decode-0")
            assert rec["instance_id"] == new.instance_id != old_instance
            # The peer entry b holds is the old instance's: never a write into the new one.
            x = b.write("decode-0", pdkv.Blocks("kv", [1, 2]), pdkv.Blocks("kv", [5, 6]), notify=b"stale")
            with pytest.raises(pdkv.StalePeer):
                x.wait(20)
            assert not np.array_equal(pnew.logical([5, 6]), pb.logical([1, 2]))
            # Resolving the name again reaches the new instance; old prepared transfers are stale.
            b.connect("decode-0")
            with pytest.raises(pdkv.StalePeer):
                prepared.post(notify=b"old").wait(20)
            write_and_check(b, pb, pnew, "decode-0")


def test_etcd_down_keeps_connections_and_fails_lookups_clearly_then_recovers(etcd):
    a, pa = pool_agent("decode-0", etcd, 1)
    b, pb = pool_agent("prefill-0", etcd, 2)
    with a, b:
        b.connect("decode-0")
        etcd.stop()
        write_and_check(b, pb, pa, "decode-0")  # existing connections need no etcd
        with pytest.raises(pdkv.PeerConnectionError, match=rf"etcd at 127.0.0.1:{etcd.port} is unreachable"):
            b.connect("decode-0")
        with pytest.raises(pdkv.PeerConnectionError, match="etcd at"):
            agent("newcomer", etcd)
        # Down longer than the TTL: the leases expire; the publishers publish again.
        threading.Event().wait(TTL + 1)
        etcd.start()
        assert wait_until(lambda: set(Registry(etcd.url).list("agents")[0]) == {"decode-0", "prefill-0"},
                          timeout=TTL * 4)
        assert b.connect("decode-0") == "decode-0"
        write_and_check(b, pb, pa, "decode-0")


def test_watch_reports_puts_expiry_and_resync(etcd):
    reg = Registry(etcd.url, ttl=TTL)
    seen: dict[str, dict] = {}
    lock = threading.Lock()

    def on_change(name, value):
        with lock:
            if value is None:
                seen.pop(name, None)
            else:
                seen[name] = value

    w = reg.watch("workers", on_change)
    try:
        pub = reg.publish("workers", "w1", lambda: {"url": "http://x:1"})
        assert wait_until(lambda: seen.get("w1") == {"url": "http://x:1"}, timeout=5)
        pub.close(delete=False)  # stops refreshing: the lease removes it
        assert wait_until(lambda: "w1" not in seen, timeout=TTL + 5)
        pub2 = reg.publish("workers", "w2", lambda: {"url": "http://x:2"})
        assert wait_until(lambda: "w2" in seen, timeout=5)
        etcd.stop()
        threading.Event().wait(TTL + 1)
        pub2.close(delete=False)
        etcd.start()  # w2's lease expired while etcd was down: the re-listing drops it
        assert wait_until(lambda: "w2" not in seen, timeout=TTL * 4)
        pub3 = reg.publish("workers", "w3", lambda: {"url": "http://x:3"})
        assert wait_until(lambda: set(seen) == {"w3"}, timeout=5)
        pub3.close()
        assert wait_until(lambda: not seen, timeout=5)
    finally:
        w.close()
    assert json.dumps(seen) == "{}"


def test_name_resolved_to_an_address_another_agent_took_is_not_found(etcd):
    with pdkv.Agent("probe") as probe:
        listen = probe.address
    gone = agent("decode-0", etcd, listen=listen)
    gone._publication.close(delete=False)  # dies without revoking: its key outlives it
    gone._publication = None
    gone.close()
    with pdkv.Agent("imposter", secret=SECRET, transports=["tcp"], listen=listen), agent("prefill-0", etcd) as b:
        assert b.registry.lookup_agent("decode-0")["address"] == listen
        with pytest.raises(pdkv.NotFound, match="'decode-0' is registered at .* another agent answers"):
            b.connect("decode-0")
        assert "decode-0" not in b.peers and "imposter" not in b.peers


def test_watch_of_a_frozen_etcd_is_bounded_and_recovers(etcd):
    """A frozen etcd (SIGSTOP: it accepts nothing, answers nothing, closes nothing) does
    not hold a watch forever: after ``idle_s`` of silence it lists again, which fails
    within the registry's timeout, and the watch says so; once etcd runs again the watch
    reports new entries. A quiet but healthy etcd only makes it list again: nothing
    unchanged is reported twice."""
    reg = Registry(etcd.url, ttl=TTL, timeout=1.0)
    seen: dict[str, dict] = {}
    calls: list[str] = []
    lock = threading.Lock()

    def on_change(name, value):
        with lock:
            calls.append(name)
            if value is None:
                seen.pop(name, None)
            else:
                seen[name] = value

    w = reg.watch("workers", on_change, retry_s=0.2, idle_s=1.0)
    try:
        assert w.synced.wait(10)
        pub = reg.publish("workers", "w1", lambda: {"url": "http://x:1"})
        assert wait_until(lambda: "w1" in seen, timeout=5)
        n = len(calls)
        threading.Event().wait(2.5)  # two idle re-listings
        assert len(calls) == n and w.last_error == ""
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        try:
            # idle_s (1) + one listing's timeout (1) + slack
            assert wait_until(lambda: "etcd at" in w.last_error, timeout=6), w.last_error
        finally:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        pub2 = Registry(etcd.url, ttl=TTL).publish("workers", "w2", lambda: {"url": "http://x:2"})
        assert wait_until(lambda: "w2" in seen and w.last_error == "", timeout=10)
        pub.close()
        pub2.close()
        assert wait_until(lambda: not seen, timeout=5)
    finally:
        w.close()


def test_watch_idle_time_is_checked():
    with pytest.raises(pdkv.InvalidArgument, match="idle_s"):
        Registry("etcd://127.0.0.1:1").watch("workers", lambda *a: None, idle_s=0)


def test_etcd_server_picks_other_ports_when_one_it_picked_was_taken(monkeypatch):
    """A port picked free can be taken before etcd binds it (seen in CI: another test's
    connection got it): the first start picks others; a restart keeps its ports."""
    import socket

    import pdkv.discovery_etcd as de
    from pdkv.errors import PeerConnectionError

    if de.etcd_binary() is None:
        pytest.skip("no etcd binary (apt-get install etcd-server, or set PDKV_ETCD)")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks = iter([busy, busy])
    real = de._free_port
    monkeypatch.setattr(de, "_free_port", lambda host: next(picks, None) or real(host))
    server = de.EtcdServer()
    try:
        assert (server.port, server.peer_port) == (busy, busy)
        server.start()
        assert busy not in (server.port, server.peer_port)
        server.client().put("/k", b"v")
        port = server.port
        server.stop()
        server.start()  # a restart: the same port, which clients know
        assert server.port == port and server.client().get("/k") == b"v"
        server.stop()
        taken2 = socket.socket()
        taken2.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken2.bind(("127.0.0.1", port))
        taken2.listen()
        try:
            with pytest.raises(PeerConnectionError, match=f"a port it was given \\({port} or .*is in use"):
                server.start()
        finally:
            taken2.close()
    finally:
        server.close()
        taken.close()
