"""One contract, every transport: the same tests against tcp, shm, the in-tree examples
(``inproc`` in C++, cpp/src/transport/example/; ``loopback`` in Python,
python/pdkv/backends/example.py) and nixl (when NIXL is installed).

Each test makes two agents that enable only the transport under test (plus what it
exchanges metadata through) and forces it for the peer, so a pass says that
transport keeps the contract: bytes land bit-exact both ways, a notification arrives
only after its data, bad extents are refused before anything moves, a dead peer fails
its transfers (never hangs them), deregistration waits for transfers in flight, and an
unknown peer is NotFound. The registry part checks priorities, run-time registration
and the single XferState.
"""

from __future__ import annotations

import importlib.util
import threading
import time
import weakref

import numpy as np
import pytest

import pdkv
import pdkv.transport
from pdkv import _native
from pdkv.transport import Transport, register_transport

from conftest import SECRET

TRANSPORTS = ["tcp", "shm", "inproc", "loopback", pytest.param("nixl", marks=pytest.mark.nixl)]
N = 1 << 20


def make_agent(name: str, transport: str, **kw) -> pdkv.Agent:
    return pdkv.Agent(name, secret=SECRET, transports=[transport], **kw)


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    """Agents a and b over one transport, with a registered 1 MiB pool each (a's
    random, b's zero); yields ``(a, b, ra, rb, src, dst, peer)``."""
    t = request.param
    with make_agent("a", t) as a, make_agent("b", t) as b:
        src = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
        dst = np.zeros(N, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata(), transport=t)
        assert a.peer_transport(peer) == t
        yield a, b, ra, rb, src, dst, peer


def test_write_and_read_are_bit_exact(pair):
    a, b, ra, rb, src, dst, peer = pair
    extents = [(ra.id, 0, rb.id, 4096, 65536), (ra.id, 65536, rb.id, 200000, 1000), (ra.id, 500000, rb.id, 0, 7)]
    x = a.prepare_extents("write", peer, extents).post()
    assert x.wait(20) and x.state is pdkv.XferState.DONE and x.bytes_done == 65536 + 1000 + 7
    assert np.array_equal(dst[4096:4096 + 65536], src[:65536])
    assert np.array_equal(dst[200000:201000], src[65536:66536])
    assert np.array_equal(dst[:7], src[500000:500007])
    assert not dst[7:4096].any() and not dst[4096 + 65536:200000].any()  # nothing else touched
    back = np.zeros(N, np.uint8)
    rback = a.register(back)
    assert a.prepare_extents("read", peer, [(rback.id, 0, rb.id, 0, N)]).post().wait(20)
    assert np.array_equal(back, dst)


def test_notification_arrives_after_its_data(pair):
    a, b, ra, rb, src, dst, peer = pair
    x = a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, N)]).post(notify=b"landed")
    got = b.wait_notifications(20)
    assert [(n.peer, n.data) for n in got] == [("a", b"landed")]
    assert np.array_equal(dst, src)  # every byte was there when it arrived
    assert x.wait(20)
    assert a.notify(peer, b"alone").wait(20)
    assert [n.data for n in b.wait_notifications(20)] == [b"alone"]


def test_bad_extents_are_refused_before_anything_moves(pair):
    a, b, ra, rb, src, dst, peer = pair
    with pytest.raises(pdkv.OutOfRange, match="outside the peer's region"):
        a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, 4096), (ra.id, 0, rb.id, N - 10, 11)])
    with pytest.raises(pdkv.OutOfRange, match="outside region"):
        a.prepare_extents("write", peer, [(ra.id, N - 1, rb.id, 0, 2)])
    with pytest.raises(pdkv.NotFound, match="exports no region"):
        a.prepare_extents("write", peer, [(ra.id, 0, rb.id + 99, 0, 1)])
    with pytest.raises(pdkv.InvalidArgument, match="length 0"):
        a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, 0)])
    assert not dst.any()


def test_dead_peer_fails_its_transfers(pair):
    a, b, ra, rb, src, dst, peer = pair
    prep = a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, 4096)])
    assert prep.post().wait(20)
    b.close()
    x = prep.post(timeout=10)
    with pytest.raises((pdkv.PeerConnectionError, pdkv.StalePeer, pdkv.TransferTimeout, pdkv.NotFound)):
        x.wait(30)
    assert x.state is pdkv.XferState.FAILED and x.bytes_done == 0


def test_deregistration_waits_for_transfers_in_flight(pair):
    a, b, ra, rb, src, dst, peer = pair
    x = a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, N)]).post()
    ra.close()  # returns only once no transfer uses the memory
    assert x.done
    assert x.wait(0) and np.array_equal(dst, src)
    with pytest.raises(pdkv.NotFound):
        a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, 1)])


def test_unknown_peer_is_not_found(pair):
    a, b, ra, rb, src, dst, peer = pair
    with pytest.raises(pdkv.NotFound, match="no peer named 'nobody'"):
        a.prepare_extents("write", "nobody", [(ra.id, 0, rb.id, 0, 1)])
    with pytest.raises(pdkv.NotFound):
        a.notify("nobody", b"x")


# ---------------------------------------------------------------- registry
# Transports these tests register stay in the process-wide registry (there is no
# unregistering): they are viable only while their test runs, so that later tests
# creating agents with every available transport never meet them.
_TEST_TRANSPORTS_ON = {"on": False}


def _only_during_test() -> str | None:
    return None if _TEST_TRANSPORTS_ON["on"] else "a test double, viable only during its test"


@pytest.fixture
def test_transports_on():
    _TEST_TRANSPORTS_ON["on"] = True
    yield
    _TEST_TRANSPORTS_ON["on"] = False


def test_default_order_comes_from_priorities():
    order = _native.module().default_transports()
    native = [t for t in ("cuda_ipc", "shm", "tcp") if t in pdkv.available_transports()]
    assert [t for t in order if t in native] == native  # 300, 200, 100
    assert "loopback" not in order and "inproc" not in order  # priority 0: only when named
    from pdkv import backends

    assert ("nixl" in order) == (backends.rdma_device_present() and importlib.util.find_spec("nixl") is not None)
    with pdkv.Agent("x", secret=SECRET) as x:
        assert x.transports == order


def test_a_transport_is_one_class_and_one_registration_line(test_transports_on):
    class Null(Transport):
        """Reaches nobody: enough to be enabled, listed and refused by name."""

        name = "null-test"

        def caps(self):
            return _native.module().TransportCaps()

        def start(self, hooks):
            self.started = hooks.agent_name

        def shutdown(self):
            pass

        def can_reach(self, peer_md):
            return False

        def drop_peer(self, name):
            pass

    register_transport("null-test", lambda config, options: Null(), description="test", metadata_via="tcp",
                       viable=_only_during_test)
    with pytest.raises(pdkv.AlreadyExists):
        register_transport("null-test", lambda config, options: Null())
    assert "null-test" in pdkv.available_transports()
    assert "null-test" not in _native.module().default_transports()
    with pdkv.Agent("a", secret=SECRET, transports=["null-test"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["tcp"]) as b:
        assert a.transports == ["null-test", "tcp"]  # tcp: its metadata channel
        with pytest.raises(pdkv.NotSupported, match="cannot reach"):
            a.connect(b.address, transport="null-test")
        assert a.peer_transport(a.connect(b.address)) == "tcp"


def test_python_transport_errors_become_pdkv_errors(test_transports_on):
    class Broken(Transport):
        name = "broken-test"

        def caps(self):
            return _native.module().TransportCaps()

        def start(self, hooks):
            raise RuntimeError("no hardware")

    register_transport("broken-test", lambda config, options: Broken(), viable=_only_during_test)
    register_transport("unviable-test", lambda config, options: Broken(), viable=lambda: "no such device")
    with pytest.raises(pdkv.PdkvError, match="starting transport 'broken-test'.*RuntimeError: no hardware"):
        pdkv.Agent("a", secret=SECRET, transports=["broken-test"])
    with pytest.raises(pdkv.NotSupported, match="cannot run on this host: no such device"):
        pdkv.Agent("a", secret=SECRET, transports=["unviable-test"])
    assert "unviable-test" not in pdkv.available_transports()


def test_one_xfer_state():
    native = _native.module().XferState.__members__
    assert [m.name for m in pdkv.XferState] == list(native)
    assert [m.value for m in pdkv.XferState] == ["pending", "done", "failed", "cancelled"]


def test_many_extents_reach_a_python_transport_as_one_array():
    """100k extents: one [n, 7] array crosses into Python, not an object per extent."""
    seen = {}

    from pdkv.backends.example import LoopbackTransport

    orig = LoopbackTransport.prepare

    def spy(self, peer, op, extents):
        seen["shape"], seen["dtype"] = extents.shape, extents.dtype
        return orig(self, peer, op, extents)

    LoopbackTransport.prepare = spy
    try:
        with make_agent("a", "loopback") as a, make_agent("b", "loopback") as b:
            src = np.arange(N, dtype=np.uint8)
            dst = np.zeros(N, np.uint8)
            ra, rb = a.register(src), b.register(dst)
            peer = a.add_peer(b.metadata())
            n = 100_000
            # every other 8-byte piece, so that no two extents coalesce
            ext = [(ra.id, 8 * i, rb.id, 8 * i, 4) for i in range(n)]
            assert a.prepare_extents("write", peer, ext).post().wait(60)
            assert seen["shape"] == (n, 7) and seen["dtype"] == np.int64
            assert pdkv.transport.EXTENT_COLUMNS == _native.module().EXTENT_COLUMNS
            idx = (np.arange(n)[:, None] * 8 + np.arange(4)).ravel()
            assert np.array_equal(dst[idx], src[idx]) and not dst[4:8].any()
    finally:
        LoopbackTransport.prepare = orig


def test_removing_a_peer_or_closing_ends_its_transfers(pair):
    """In flight or not, a transfer to a removed peer (or of a closed agent) ends:
    done if it finished first, else failed; never pending forever."""
    a, b, ra, rb, src, dst, peer = pair
    prep = a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, N)])
    x = prep.post()
    a.remove_peer(peer)
    try:
        assert x.wait(30)
    except (pdkv.PeerConnectionError, pdkv.Cancelled):
        assert x.state in (pdkv.XferState.FAILED, pdkv.XferState.CANCELLED)
    peer = a.add_peer(b.metadata(), transport=a.transports[0])
    y = a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, N)]).post()
    a.close()
    assert y.done


# ---------------------------------------------------------------- completion paths of a Python transport
# A Python transport's post runs with the GIL the caller already holds, and a transfer
# that ended inside post is returned without a GIL hand-off; one still pending is
# waited on through the core (cancel hook, driver, deadline). Every path must hand
# the caller the same values: True, False, or the transfer's own error class.
class _Held(Transport):
    """Keeps every posted transfer pending; the test resolves, fails or cancels it.
    ``drive``: give waiters a driver that fails the transfer with TransferTimeout once
    its deadline passed (what a polling transport such as nixl does)."""

    name = "held-test"
    drive = False

    def __init__(self) -> None:
        self.posted: list = []

    def caps(self):
        return _native.module().TransportCaps(cross_host=False)

    def start(self, hooks):
        pass

    def shutdown(self):
        pass

    def metadata_extra(self) -> bytes:
        return b"held"

    def can_reach(self, peer_md):
        return peer_md.extra(self.name) == b"held"

    def drop_peer(self, name):
        pass

    def prepare(self, peer, op, extents):
        return int(extents[:, 1].sum())

    def post(self, nbytes, transfer, notif):
        transfer.set_parts(1)
        transfer.set_cancel_hook(lambda: transfer.resolve_part(0, pdkv.Cancelled("cancelled by the test")))
        if self.drive:
            def drive(timeout_s):
                while not transfer.terminal and transfer.remaining_s > 0:
                    time.sleep(0.001)
                if not transfer.terminal:
                    transfer.resolve_part(0, pdkv.TransferTimeout("held past its deadline"))
            transfer.set_driver(drive)
            self.driver = weakref.ref(drive)
        self.posted.append((transfer, nbytes))


_HELD: dict = {}  # agent name -> its held-test transport (the latest one)


def _held_for(config, options) -> _Held:
    _HELD[config.name] = _Held()
    return _HELD[config.name]


@pytest.fixture
def held(test_transports_on):
    """Agents a -> b over the held-test transport; yields (a, prepared 4 KiB write, a's transport)."""
    if "held-test" not in _native.module().registered_transports():
        register_transport("held-test", _held_for, viable=_only_during_test, metadata_via="tcp")
    with make_agent("a", "held-test") as a, make_agent("b", "held-test") as b:
        src, dst = np.zeros(N, np.uint8), np.zeros(N, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata(), transport="held-test")
        yield a, a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, 4096)]), _HELD["a"]


def test_python_transfer_ended_inside_post_is_waited_without_a_hand_off():
    """loopback completes in post: wait() gives the XferState members themselves."""
    with make_agent("a", "loopback") as a, make_agent("b", "loopback") as b:
        src = np.arange(N, dtype=np.uint8)
        dst = np.zeros(N, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        x = a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 8, 32768)]).post()
        assert x._n.wait(0.0) is _native.module().XferState.DONE
        assert x.wait(0) and x.bytes_done == 32768 and np.array_equal(dst[8:32776], src[:32768])
        x.cancel()  # after the end: nothing changes
        assert x.wait() and x.state is pdkv.XferState.DONE and x.error is None


def test_pending_python_transfer_gives_true_false_or_its_error(held):
    a, prep, t = held
    x = prep.post()
    assert x._n.wait(0.0) is _native.module().XferState.PENDING
    assert x.wait(0) is False and x.wait(0.01) is False and x.state is pdkv.XferState.PENDING
    threading.Timer(0.05, lambda: t.posted[-1][0].resolve_part(4096)).start()
    assert x.wait(10) is True and x.bytes_done == 4096 and x.error is None

    y = prep.post()
    t.posted[-1][0].resolve_part(0, pdkv.PeerConnectionError("link down (test)"))
    with pytest.raises(pdkv.PeerConnectionError, match=r"link down \(test\)"):
        y.wait(10)
    assert y.state is pdkv.XferState.FAILED and isinstance(y.error, pdkv.PeerConnectionError)

    z = prep.post()
    threading.Timer(0.05, z.cancel).start()
    with pytest.raises(pdkv.Cancelled):
        z.wait(10)
    assert z.state is pdkv.XferState.CANCELLED


def test_driven_python_transfer_times_out_and_drops_its_driver(held):
    a, prep, t = held
    t.drive = True
    x = prep.post(timeout=0.05)
    waiters = [threading.Thread(target=lambda: pytest.raises(pdkv.TransferTimeout, x.wait, 10)) for _ in range(2)]
    for w in waiters:
        w.start()
    with pytest.raises(pdkv.TransferTimeout, match="held past its deadline"):
        x.wait(10)
    for w in waiters:
        w.join(10)
        assert not w.is_alive()
    assert x.state is pdkv.XferState.FAILED
    assert t.driver() is None  # released once the transfer ended: nothing keeps the Python callable


def test_python_transport_posts_while_other_threads_call_into_it():
    """Posts keep the GIL through the core; registration (region_added/removed into
    Python from C++) and peer re-adds run meanwhile on other threads: nothing deadlocks."""
    with make_agent("a", "loopback") as a, make_agent("b", "loopback") as b:
        src = np.arange(N, dtype=np.uint8)
        dst = np.zeros(N, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        prep = a.prepare_extents("write", peer, [(ra.id, 0, rb.id, 0, 4096)])
        results: list = []

        def post_many():
            results.append(all(prep.post().wait(10) for _ in range(300)))

        def churn_regions():
            for _ in range(40):
                a.register(np.zeros(4096, np.uint8)).close()
            results.append(True)

        def readd_peer():
            for _ in range(40):
                a.add_peer(b.metadata())
            results.append(True)

        threads = [threading.Thread(target=f) for f in (post_many, post_many, churn_regions, readd_peer)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads) and results == [True] * 4
        assert np.array_equal(dst[:4096], src[:4096])
