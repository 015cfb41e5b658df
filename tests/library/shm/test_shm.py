"""shm-specific behaviour: transport choice, mapping lifetime and revocation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pdkv
from conftest import SECRET, post_past_deadline
from kvpools import Pool, PoolSpec

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")


def test_same_host_prefers_shm_and_choice_is_overridable():
    with pdkv.Agent("a", secret=SECRET) as a, pdkv.Agent("b", secret=SECRET) as b:
        assert a.transports[:2] == ["shm", "tcp"]
        assert a.peer_transport(a.connect(b.address)) == "shm"
        assert a.peer_transport(a.connect(b.address, transport="tcp")) == "tcp"
    with pdkv.Agent("a", secret=SECRET, transports=["tcp"]) as a, pdkv.Agent("b", secret=SECRET) as b:
        assert a.peer_transport(a.connect(b.address)) == "tcp"
        with pytest.raises(pdkv.NotFound, match="not enabled"):
            a.connect(b.address, transport="shm")


def test_alloc_views_and_lifetime():
    with pdkv.Agent("a", secret=SECRET) as a:
        r = a.alloc(4096)
        assert r.shareable and r.nbytes == 4096
        v = r.array(np.float32, (32, 32))
        v[:] = 1.5
        assert r.array(np.float32).sum() == 1.5 * 1024
        r.close()
        assert v.sum() == 1.5 * 1024  # views keep the pages alive after deregistration
        with pytest.raises(pdkv.InvalidArgument):
            r.array()
        with pytest.raises(pdkv.InvalidArgument):
            a.alloc(0)


def test_alloc_torch_view():
    torch = pytest.importorskip("torch")
    with pdkv.Agent("a", secret=SECRET) as a:
        r = a.alloc(2 * 4 * 8 * 2)
        t = r.tensor(torch.bfloat16, (2, 4, 8))
        t.fill_(3.0)
        assert t.data_ptr() == r.addr and float(t.float().sum()) == 3.0 * 64


def test_deregistering_mapped_region_revokes_peer_access():
    spec = PoolSpec(blocks=32)
    with pdkv.Agent("a", secret=SECRET) as a, pdkv.Agent("b", secret=SECRET) as b:
        pa = Pool(spec, 1, shared_by=a)
        pa.register(a)
        pb = Pool(spec, None, shared_by=b)
        pb.register(b)
        peer = a.connect(b.address)
        prep = a.prepare("write", peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [2, 3]))  # maps b's regions
        assert prep.post().wait(5)
        t0 = time.monotonic()
        for r in b.regions:
            r.close()  # a is told to stop using them and acknowledges
        assert time.monotonic() - t0 < 8  # acknowledged, not the 10 s revoke timeout (generous: no timing claim)
        with pytest.raises(pdkv.NotFound, match="deregistered"):
            prep.post().wait(5)


def test_deregistration_waits_for_the_peers_inflight_copy():
    spec = PoolSpec(layers=4, blocks=128, block_tokens=16, heads=8, head_dim=128, dtype="float16")  # 64 MiB
    with pdkv.Agent("a", secret=SECRET, options=[pdkv.ShmOptions(inline_bytes=0)]) as a, \
            pdkv.Agent("b", secret=SECRET) as b:
        pa = Pool(spec, 1, shared_by=a)
        pa.register(a)
        pb = Pool(spec, None, shared_by=b)
        pb.register(b)
        peer = a.connect(b.address)
        prep = a.prepare("write", peer, pdkv.Blocks("kv", range(128)), pdkv.Blocks("kv", range(128)))
        xs = [prep.post() for _ in range(8)]  # ~512 MiB of copying queued on a's copy thread
        done_at_dereg = []

        def dereg():
            for r in b.regions:
                r.close()
            done_at_dereg.append(sum(x.done for x in xs))

        th = threading.Thread(target=dereg)
        th.start()
        th.join(30)
        # When b's deregistration returned, a was no longer copying into b's memory:
        # every transfer was either finished or refused.
        assert done_at_dereg == [8]
        results = []
        for x in xs:
            try:
                results.append(x.wait(10))
            except pdkv.NotFound:
                results.append("refused")
        assert all(r is True or r == "refused" for r in results)


@pytest.mark.parametrize("kind", ["alloc", "numpy"])
def test_copies_queued_past_their_deadline_or_cancelled_stop(kind):
    """A copy does not outlive its transfer: copies queued on the copy thread behind
    others fail with TransferTimeout once their deadline passed (checked before and
    every few MiB during the copy), cancelled ones with Cancelled; none hangs, the
    thread goes on, and the next transfer lands bit-exact."""
    spec = PoolSpec(layers=4, blocks=128, block_tokens=16, heads=8, head_dim=128, dtype="float16")  # 64 MiB
    with pdkv.Agent("a", secret=SECRET, options=[pdkv.ShmOptions(inline_bytes=0)]) as a, \
            pdkv.Agent("b", secret=SECRET) as b:
        pa = Pool(spec, 1, shared_by=a)
        pa.register(a)
        pb = Pool(spec, None, shared_by=b if kind == "alloc" else None)
        pb.register(b)
        peer = a.connect(b.address)
        assert a.peer_transport(peer) == "shm"
        prep = a.prepare("write", peer, pdkv.Blocks("kv", range(128)), pdkv.Blocks("kv", range(128)))
        # Regions confirmed first: on a loaded machine the first post's confirmation
        # alone can outlast 20 ms (a TransferTimeout that is not the copy's).
        assert prep.post(timeout=60).wait(60)
        xs, _ = post_past_deadline(prep, 12)  # ~768 MiB queued on one copy thread
        ys = [prep.post(timeout=60) for _ in range(4)]
        for y in ys:
            y.cancel()
        outcomes = []
        for x in xs + ys:
            try:
                outcomes.append(x.wait(30))
            except pdkv.TransferTimeout as e:
                outcomes.append("timeout")
                assert "timed out" in str(e)
            except pdkv.Cancelled:
                outcomes.append("cancelled")
        assert "timeout" in outcomes[:12], outcomes  # 12 copies cannot all finish within 3 copies' time
        assert all(o in (True, "timeout") for o in outcomes[:12]), outcomes
        assert all(o in (True, "cancelled") for o in outcomes[12:]), outcomes
        pa.fill(7)
        assert a.write(peer, pdkv.Blocks("kv", [3, 4]), pdkv.Blocks("kv", [9, 10]), timeout=30).wait(30)
        assert pb.digest([9, 10]) == pa.digest([3, 4])


def test_cross_memory_attach_to_plain_numpy_memory():
    with pdkv.Agent("a", secret=SECRET) as a, pdkv.Agent("b", secret=SECRET) as b:
        src = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
        dst = np.zeros(1 << 17, np.uint8)
        rs, rd = a.register(src), b.register(dst)
        peer = a.connect(b.address)
        assert a.peer_transport(peer) == "shm"
        ext = [(rs.id, i * 4096, rd.id, (31 - i) * 4096, 4096) for i in range(32)]
        assert a.prepare_extents("write", peer, ext).post(notify=b"cma").wait(5)
        for i in range(32):
            assert np.array_equal(dst[(31 - i) * 4096:(32 - i) * 4096], src[i * 4096:(i + 1) * 4096])
        assert [n.data for n in b.wait_notifications(5)] == [b"cma"]
        back = np.zeros_like(src)
        rb = a.register(back)
        assert a.prepare_extents("read", peer, [(rb.id, 0, rd.id, 0, src.nbytes)]).post().wait(5)
        assert np.array_equal(back, dst[: src.nbytes])
