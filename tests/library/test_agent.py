"""Agent semantics in one process: registration, metadata, peers, transfers, notifications."""

from __future__ import annotations

import asyncio
import select
import struct
import threading
import time

import numpy as np
import pytest

import pdkv
from conftest import SECRET, make_pool, wait_until
from kvpools import Pool, PoolSpec


# ---------------------------------------------------------------- registration
def test_register_numpy_and_buffer_and_address():
    with pdkv.Agent("a", secret=SECRET) as a:
        arr = np.zeros(1000, np.float32)
        r = a.register(arr)
        assert (r.addr, r.nbytes, r.kind, r.device) == (arr.ctypes.data, 4000, "host", -1)
        ba = bytearray(64)
        r2 = a.register(ba)
        assert r2.nbytes == 64
        raw = np.zeros(128, np.uint8)
        r3 = a.register_address(raw.ctypes.data, 128, keepalive=raw)
        assert {x.id for x in a.regions} == {r.id, r2.id, r3.id}
        r.close()
        r.close()  # idempotent
        assert r.closed and {x.id for x in a.regions} == {r2.id, r3.id}


def test_register_torch_tensor():
    torch = pytest.importorskip("torch")
    with pdkv.Agent("a", secret=SECRET) as a:
        t = torch.zeros(16, 8, dtype=torch.bfloat16)
        r = a.register(t)
        assert (r.addr, r.nbytes) == (t.data_ptr(), 16 * 8 * 2)


@pytest.mark.parametrize("sl", [slice(0, 10), slice(50, 150), slice(99, 100), slice(0, 200)])
def test_overlapping_registration_is_rejected(sl):
    with pdkv.Agent("a", secret=SECRET) as a:
        buf = np.zeros(200, np.uint8)
        a.register(buf[100:200] if sl.start >= 100 and False else buf[50:100])
        view = buf[sl]
        overlaps = not (sl.stop <= 50 or sl.start >= 100)
        if overlaps:
            with pytest.raises(pdkv.AlreadyExists, match="overlaps registered region"):
                a.register(view)
        else:
            a.register(view)


def test_double_registration_same_range_rejected_and_zero_length():
    with pdkv.Agent("a", secret=SECRET) as a:
        buf = np.zeros(64, np.uint8)
        a.register(buf)
        with pytest.raises(pdkv.AlreadyExists):
            a.register(buf)
        with pytest.raises(pdkv.InvalidArgument, match="empty"):
            a.register_address(buf.ctypes.data + 1000, 0)
        with pytest.raises(pdkv.InvalidArgument):
            a.register_address(12345, 10, kind="gpu")


def test_layout_must_lie_in_registered_memory():
    with pdkv.Agent("a", secret=SECRET) as a:
        pool = Pool(PoolSpec())
        with pytest.raises(pdkv.NotFound, match="register the pool first"):
            a.add_layout("kv", pool.layout)
        pool.register(a)
        with pytest.raises(pdkv.AlreadyExists):
            a.add_layout("kv", pool.layout)
        assert a.layout("kv").geometry == pool.layout.geometry
        a.remove_layout("kv")
        with pytest.raises(pdkv.NotFound):
            a.layout("kv")


def test_deregister_drops_layouts_on_it():
    with pdkv.Agent("a", secret=SECRET) as a:
        buf = np.zeros(PoolSpec().layers * 2 * 16 * 4 * 2 * 8 * 2, np.uint8)
        g = pdkv.KVGeometry(num_layers=2, num_blocks=16, block_tokens=4, kv_heads=2, head_dim=8, dtype="float16")
        r = a.register(buf)
        a.add_layout("kv", pdkv.KVLayout.contiguous(g, buf))
        r.close()
        with pytest.raises(pdkv.NotFound):
            a.layout("kv")


# ---------------------------------------------------------------- metadata
def test_metadata_roundtrip_and_contents(agent_pair):
    a, b = agent_pair
    pool = Pool(PoolSpec())
    pool.register(b)
    hidden = np.zeros(64, np.uint8)
    b.register(hidden, remote_access=False)
    md = pdkv.decode_metadata(b.metadata())
    assert md["name"] == "target" and md["instance_id"] == b.instance_id
    assert ("tcp", b.address) in md["endpoints"]
    assert len(md["regions"]) == len(pool.arrays)  # the local-only region is not exported
    assert "kv" in md["layouts"]
    assert SECRET.encode() not in b.metadata()


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda m: b"XXXX" + m[4:], pdkv.ProtocolError, "magic"),
        (lambda m: m[:8] + struct.pack("<H", 99) + m[10:], pdkv.VersionMismatch, "version 99"),
        (lambda m: m[:-5], pdkv.ProtocolError, "length"),
        (lambda m: m[:20], pdkv.ProtocolError, "truncated|length"),
        (lambda m: m + b"\0", pdkv.ProtocolError, "length|trailing"),
        (lambda m: b"", pdkv.ProtocolError, "magic"),
    ],
)
def test_malformed_metadata_is_rejected(agent_pair, mutate, exc, match):
    a, b = agent_pair
    Pool(PoolSpec()).register(b)
    with pytest.raises(exc, match=match):
        a.add_peer(mutate(b.metadata()))


def test_metadata_fuzz_never_crashes(agent_pair):
    a, b = agent_pair
    Pool(PoolSpec()).register(b)
    md = bytearray(b.metadata())
    rng = np.random.default_rng(1)
    for _ in range(500):
        m = bytearray(md)
        for _ in range(rng.integers(1, 4)):
            m[rng.integers(0, len(m))] = rng.integers(0, 256)
        try:
            a.add_peer(bytes(m))
        except pdkv.PdkvError:
            pass


def test_peers_add_remove_and_self(agent_pair, flavor):
    a, b = agent_pair
    name = a.add_peer(b.metadata())
    assert name == "target" and a.peers == ["target"] and a.peer_transport("target") == flavor.transport
    assert a.add_peer(a.metadata()) == "initiator"  # talking to oneself is allowed
    a.remove_peer("target")
    assert a.peers == ["initiator"]
    with pytest.raises(pdkv.NotFound):
        a.remove_peer("target")
    with pytest.raises(pdkv.NotFound):
        a.peer_transport("nobody")
    with pytest.raises(pdkv.NotFound, match="unknown transport"):
        pdkv.Agent("x", transports=["warp-drive"])
    with pytest.raises(pdkv.InvalidArgument):
        pdkv.Agent("bad name")


def test_fetch_metadata_by_address_and_wrong_secret(agent_pair):
    a, b = agent_pair
    assert a.connect(b.address) == "target"
    with pytest.raises(pdkv.AuthFailed, match="wrong secret"):
        a.fetch_metadata(b.address, secret="nope")
    with pytest.raises(pdkv.PeerConnectionError):
        a.fetch_metadata("127.0.0.1:1", timeout=2)
    with pytest.raises(pdkv.InvalidArgument):
        a.fetch_metadata("no-port-here")


def test_default_secret_is_random_and_env(monkeypatch):
    monkeypatch.delenv("PDKV_SECRET", raising=False)
    with pdkv.Agent("x") as x, pdkv.Agent("y") as y:
        assert x.secret != y.secret and len(x.secret) == 32
        with pytest.raises(pdkv.AuthFailed):
            x.connect(y.address)
        assert x.connect(y.address, secret=y.secret) == "y"
    monkeypatch.setenv("PDKV_SECRET", "from-env")
    with pdkv.Agent("z") as z:
        assert z.secret == b"from-env"


# ---------------------------------------------------------------- transfers
def connected(a, b, spec=PoolSpec(), seeds=(1, None)):
    pa, pb = make_pool(spec, seeds[0], a), make_pool(spec, seeds[1], b)
    pa.register(a)
    pb.register(b)
    return pa, pb, a.connect(b.address)


@pytest.mark.parametrize("style", ["nhd", "hnd", "interleaved", "vllm"])
def test_write_and_read_bit_exact(agent_pair, style):
    a, b = agent_pair
    spec = PoolSpec(style=style, blocks=32)
    pa, pb, peer = connected(a, b, spec)
    lids, rids = [3, 4, 5, 9, 0], [30, 2, 17, 18, 19]
    x = a.write(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), notify=b"w")
    assert x.wait(10) and x.state is pdkv.XferState.DONE
    assert x.bytes_done == x.bytes_total == 5 * 2 * spec.layers * pa.layout.block_bytes
    assert np.array_equal(pb.logical(rids), pa.logical(lids))
    assert [n.data for n in b.wait_notifications(5)] == [b"w"]
    # READ back into different local blocks.
    pb.fill(77)
    x = a.read(peer, pdkv.Blocks("kv", [10, 11]), pdkv.Blocks("kv", [1, 2]), notify="r")
    assert x.wait(10)
    assert np.array_equal(pa.logical([10, 11]), pb.logical([1, 2]))
    assert [(n.peer, n.data) for n in b.wait_notifications(5)] == [("initiator", b"r")]


def test_prepared_transfer_posts_many_times(agent_pair):
    a, b = agent_pair
    pa, pb, peer = connected(a, b)
    prep = a.prepare("write", peer, pdkv.Blocks("kv", range(8)), pdkv.Blocks("kv", range(8, 16)))
    assert prep.num_extents == 2 * 2 and prep.nbytes == 8 * 4 * pa.layout.block_bytes
    for i in range(5):
        pa.fill(i)
        assert prep.post(notify=str(i)).wait(10)
        assert np.array_equal(pb.logical(range(8, 16)), pa.logical(range(8)))
    got = []
    wait_until(lambda: got.extend(b.get_notifications()) or len(got) == 5)
    assert [n.data for n in got] == [b"0", b"1", b"2", b"3", b"4"]


def test_raw_extents(agent_pair):
    a, b = agent_pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(8192, np.uint8)
    rs = a.register(src)
    rd = b.register(dst)
    peer = a.connect(b.address)
    x = a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 100, 1000), (rs.id, 2000, rd.id, 5000, 96)]).post()
    assert x.wait(5)
    assert np.array_equal(dst[100:1100], src[:1000]) and np.array_equal(dst[5000:5096], src[2000:2096])
    assert not dst[:100].any() and not dst[1100:5000].any()
    with pytest.raises(pdkv.OutOfRange, match="outside the peer's region"):
        a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 8000, 1000)])
    with pytest.raises(pdkv.OutOfRange, match="local bytes"):
        a.prepare_extents("write", peer, [(rs.id, 4000, rd.id, 0, 100)])
    with pytest.raises(pdkv.NotFound):
        a.prepare_extents("write", peer, [(rs.id, 0, 999, 0, 10)])
    with pytest.raises(pdkv.InvalidArgument, match="no extents"):
        a.prepare_extents("write", peer, [])


def test_transfer_errors_before_post(agent_pair):
    a, b = agent_pair
    pa, pb, peer = connected(a, b)
    with pytest.raises(pdkv.NotFound, match="no peer"):
        a.write("nobody", pdkv.Blocks("kv", [0]))
    with pytest.raises(pdkv.NotFound, match="exports no layout"):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("other", [0]))
    with pytest.raises(pdkv.OutOfRange):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1000]))
    with pytest.raises(pdkv.InvalidArgument, match="op must be"):
        a.prepare("push", peer, pdkv.Blocks("kv", [0]))
    with pytest.raises(pdkv.InvalidArgument, match="notification"):
        a.write(peer, pdkv.Blocks("kv", [0]), notify=b"x" * (2 << 20))


def test_big_multi_batch_transfer_over_several_connections():
    spec = PoolSpec(layers=2, blocks=64, block_tokens=16, heads=4, head_dim=64, dtype="float16")
    tcp = pdkv.TcpOptions(conns_per_peer=3, progress_threads=2, batch_bytes=64 << 10, batch_extents=7)
    with pdkv.Agent("a", secret=SECRET, options=[tcp], transports=["tcp"]) as a, \
            pdkv.Agent("b", secret=SECRET, options=[tcp], transports=["tcp"]) as b:
        pa, pb, peer = connected(a, b, spec)
        rng = np.random.default_rng(0)
        lids = rng.permutation(64)[:48].tolist()
        rids = rng.permutation(64)[:48].tolist()
        x = a.write(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), notify=b"done")
        assert x.wait(20)
        # The notification goes out only after every batch on every connection was acked.
        assert [n.data for n in b.wait_notifications(5)] == [b"done"]
        assert np.array_equal(pb.logical(rids), pa.logical(lids))
        pb.fill(5)
        x = a.read(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), notify=b"read-done")
        assert x.wait(20)
        assert np.array_equal(pa.logical(lids), pb.logical(rids))
        assert [n.data for n in b.wait_notifications(5)] == [b"read-done"]


def test_concurrent_transfers_from_threads(agent_pair):
    a, b = agent_pair
    spec = PoolSpec(blocks=64)
    pa, pb, peer = connected(a, b, spec)
    errors = []

    def worker(k):
        try:
            for i in range(20):
                ids = [k * 16 + (i % 16)]
                assert a.write(peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids)).wait(10)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert np.array_equal(pb.logical(range(64)), pa.logical(range(64)))


def test_notify_only_and_ordering(agent_pair):
    a, b = agent_pair
    pa, pb, peer = connected(a, b)
    for i in range(10):
        a.notify(peer, f"n{i}")
    got = []
    assert wait_until(lambda: got.extend(b.get_notifications()) or len(got) == 10)
    assert [n.data.decode() for n in got] == [f"n{i}" for i in range(10)]
    with pytest.raises(pdkv.InvalidArgument):
        a.notify(peer, b"")


def test_notification_fd_and_asyncio(agent_pair):
    a, b = agent_pair
    pa, pb, peer = connected(a, b)
    fd = b.notification_fd
    assert select.select([fd], [], [], 0)[0] == []
    a.write(peer, pdkv.Blocks("kv", [1]), notify=b"x").wait(5)
    assert select.select([fd], [], [], 5)[0] == [fd]
    assert [n.data for n in b.get_notifications()] == [b"x"]
    assert select.select([fd], [], [], 0)[0] == []  # readable exactly while non-empty

    async def consume():
        it = b.notifications()
        got = []
        for i in range(3):
            a.write(peer, pdkv.Blocks("kv", [i]), notify=f"a{i}")
        async for n in it:
            got.append(n.data)
            if len(got) == 3:
                break
        await it.aclose()
        return got

    # Sorted: transfers posted without waiting notify in completion order, which nixl
    # (independent NIXL transfers) does not tie to the posting order.
    assert sorted(asyncio.run(asyncio.wait_for(consume(), 10))) == [b"a0", b"a1", b"a2"]


def test_wait_notifications_times_out_without_spinning(agent_pair):
    a, b = agent_pair
    t0 = time.process_time()
    w0 = time.monotonic()
    assert b.wait_notifications(0.3) == []
    assert time.monotonic() - w0 >= 0.29
    assert time.process_time() - t0 < 0.1


def test_transfer_wait_async(agent_pair):
    a, b = agent_pair
    pa, pb, peer = connected(a, b)

    async def go():
        return await a.write(peer, pdkv.Blocks("kv", [0, 1])).wait_async(5)

    assert asyncio.run(go()) is True


def test_deregister_waits_for_inflight_transfer(agent_pair):
    a, b = agent_pair
    spec = PoolSpec(layers=4, blocks=64, block_tokens=16, heads=8, head_dim=128, dtype="float16")  # 32 MiB
    pa, pb, peer = connected(a, b, spec)
    regions = list(a.regions)
    x = a.write(peer, pdkv.Blocks("kv", range(64)), pdkv.Blocks("kv", range(64)))
    for r in regions:
        r.close()  # must block until x no longer touches the memory
    assert x.done
    assert x.wait(0) is True
    assert np.array_equal(pb.logical(range(64)), pa.logical(range(64)))
    with pytest.raises(pdkv.NotFound):
        a.write(peer, pdkv.Blocks("kv", [0]))  # layout was dropped with its regions


def test_post_after_local_region_deregistered(agent_pair):
    a, b = agent_pair
    src = np.ones(1024, np.uint8)
    dst = np.zeros(1024, np.uint8)
    rs, rd = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    prep = a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 1024)])
    rs.close()
    with pytest.raises(pdkv.NotFound, match="not registered"):
        prep.post()


def test_remote_region_deregistered_fails_transfer_not_agent(agent_pair):
    a, b = agent_pair
    src = np.ones(1024, np.uint8)
    dst = np.zeros(1024, np.uint8)
    rs, rd = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    prep = a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 1024)])
    rd.close()
    with pytest.raises(pdkv.NotFound, match="region"):
        prep.post(timeout=5).wait(5)
    assert not dst.any()
    # The agent still serves: a new region works.
    dst2 = np.zeros(1024, np.uint8)
    rd2 = b.register(dst2)
    a.add_peer(b.metadata())
    assert a.prepare_extents("write", peer, [(rs.id, 0, rd2.id, 0, 1024)]).post().wait(5)
    assert dst2.all()


def test_cancel_before_send(agent_pair, flavor):
    a, b = agent_pair
    spec = PoolSpec(layers=4, blocks=64, block_tokens=16, heads=8, head_dim=128, dtype="float16")
    pa, pb, peer = connected(a, b, spec)
    b_regions = b.regions
    # Many small batches so most are still queued when cancel() runs.
    tcp = pdkv.TcpOptions(batch_bytes=64 << 10)
    with flavor.agent("c", options=[tcp]) as c:
        pc = make_pool(spec, 3, c)
        pc.register(c)
        p2 = c.connect(b.address)
        x = c.write(p2, pdkv.Blocks("kv", range(64)), pdkv.Blocks("kv", range(64)), notify=b"never")
        x.cancel()
        try:
            completed = x.wait(10)  # all bytes may already be on the wire: then it completes
        except pdkv.Cancelled:
            completed = False
        assert x.state is (pdkv.XferState.DONE if completed else pdkv.XferState.CANCELLED)
        if not completed:
            assert x.bytes_done < x.bytes_total
            assert b.wait_notifications(0.2) == []
        # The connection is still usable.
        assert c.write(p2, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [0])).wait(5)
    assert b_regions


def test_stale_peer_is_detected(agent_pair):
    a, b = agent_pair
    pa, pb, peer = connected(a, b)
    old_md = b.metadata()
    spec = PoolSpec()
    b.close()
    with pdkv.Agent("target", secret=SECRET, transports=a.transports) as b2:
        make_pool(spec, None, b2).register(b2)
        # Same name, stale metadata pointing at a dead address: connection error.
        a.add_peer(old_md)
        with pytest.raises(pdkv.PeerConnectionError):
            a.write(peer, pdkv.Blocks("kv", [0]), timeout=5).wait(10)
        # Re-fetching the new instance's metadata fixes it.
        assert a.connect(b2.address) == "target"
        assert a.write(peer, pdkv.Blocks("kv", [0])).wait(5)


def test_prepared_transfer_rejects_restarted_peer(agent_pair):
    a, b = agent_pair
    pa, pb, peer = connected(a, b)
    prep = a.prepare("write", peer, pdkv.Blocks("kv", [0]))
    with pdkv.Agent("target", secret=SECRET, transports=a.transports) as b2:
        make_pool(PoolSpec(), None, b2).register(b2)
        a.connect(b2.address)
        x = prep.post()  # a peer fault: the transfer fails, wait() raises (docs/faults.md)
        with pytest.raises(pdkv.StalePeer, match="prepare it again"):
            x.wait(5)


def test_hello_to_wrong_instance_is_refused(agent_pair):
    """Metadata naming the right agent name but another instance id is refused by the target."""
    a, b = agent_pair
    pa, pb, peer = connected(a, b)
    md = bytearray(b.metadata())
    info = pdkv.decode_metadata(bytes(md))
    inst = struct.pack("<Q", info["instance_id"])
    i = md.find(inst)
    md[i:i + 8] = struct.pack("<Q", info["instance_id"] ^ 1)
    a.add_peer(bytes(md))
    with pytest.raises(pdkv.StalePeer, match="restarted"):
        a.write(peer, pdkv.Blocks("kv", [0]), timeout=5).wait(10)  # shm connects (and fails) at prepare


def test_closed_agent_raises_clearly():
    a = pdkv.Agent("a", secret=SECRET)
    a.close()
    with pytest.raises(pdkv.InvalidArgument, match="closed"):
        a.metadata()


def _pdkv_thread_ticks():
    """utime + stime (clock ticks) of each of this process's threads that pdkv started
    (their names start with "pdkv-": util/thread_name.h), by thread id."""
    import os

    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between listdir and open
        if comm.startswith("pdkv-"):
            fields = rest.split()
            ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def test_idle_agent_uses_no_cpu():
    # Only pdkv's own threads are measured: a sanitizer's background thread, a thread
    # an earlier test left behind or the interpreter are not the agent's idle cost.
    with pdkv.Agent("idle", secret=SECRET) as a:
        Pool(PoolSpec()).register(a)
        time.sleep(0.3)  # let any startup spinning end
        t0 = _pdkv_thread_ticks()
        assert t0, "no thread named pdkv-* in this process: the agent's threads are unnamed"
        time.sleep(1.0)
        t1 = _pdkv_thread_ticks()
        used = sum(t1.get(tid, 0) - t0.get(tid, 0) for tid in t1)
        assert used <= 2, f"pdkv's threads used {used * 10} ms of CPU in one idle second: {t1}"


def test_repr_names_the_address_or_its_absence():
    with pdkv.Agent("with-tcp", transports=["tcp"]) as a:
        assert repr(a) == f"Agent('with-tcp', transports=['tcp'], address={a.address!r})"
    assert repr(a) == "Agent(closed)"
    with pdkv.Agent("no-tcp", transports=["loopback"]) as b:  # repr must not raise
        assert repr(b) == "Agent('no-tcp', transports=['loopback'], no tcp endpoint)"



def test_readding_a_peer_at_other_addresses_reconnects_there():
    """The same instance's metadata added again with other addresses (a wrong address
    corrected): the next transfer connects to the new address instead of the transport
    keeping the peer it knew at the old one."""
    with pdkv.Agent("a", secret=SECRET, transports=["tcp"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["tcp"]) as b:
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, np.uint8)
        rs, rd = a.register(src), b.register(dst)
        md = b.metadata()
        good = b.address.encode()
        assert good.startswith(b"127.0.0.1:") and md.count(good) == 1
        wrong = md.replace(good, good.replace(b"127.0.0.1", b"127.0.0.2"))  # nobody listens there
        peer = a.add_peer(wrong)
        with pytest.raises(pdkv.PeerConnectionError):
            a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 2048)]).post(timeout=5).wait(5)
        assert a.add_peer(md) == peer
        assert a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post(timeout=10).wait(10)
        assert (dst == src).all()
        assert a.add_peer(md) == peer  # the same addresses again: the connection stays usable
        dst[:] = 0
        assert a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post(timeout=10).wait(10)
        assert (dst == src).all()
