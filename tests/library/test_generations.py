"""Block generations (docs/generations.md): a transfer naming blocks that were freed or
reused since their ids were handed out never lands in them.

The target (owner of the blocks) hands out ids with generations; whoever writes into
(or reads from) them gives them with the remote side's ``pdkv.Blocks(layout, ids,
generations=...)``; the owner bumps the generations
when it frees or reuses blocks. Every test here fails without the feature: the stale
transfers below land (or read reused bytes) and report DONE on a pdkv without it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

import pdkv
from conftest import SECRET, make_pool
from kvpools import Pool, PoolSpec

SPEC = PoolSpec(layers=2, blocks=8, block_tokens=4, heads=2, head_dim=8)
QUIET = 0.3  # seconds to listen for a notification that must not come
_OPEN: list[socket.socket] = []  # raw sockets, closed after each test


@pytest.fixture(autouse=True)
def _close_raw_sockets():
    yield
    while _OPEN:
        _OPEN.pop().close()


@pytest.fixture
def pools(agent_pair, flavor):
    """(initiator, target, src pool, dst pool, peer name): the target's pool is the
    canary (seed 2); the initiator's pool holds other bytes (seed 1)."""
    a, b = agent_pair
    src = make_pool(SPEC, 1, a)
    dst = make_pool(SPEC, 2, b)
    src.register(a)
    dst.register(b)
    peer = a.add_peer(b.metadata())
    return a, b, src, dst, peer


def no_notification(agent: pdkv.Agent) -> bool:
    return agent.wait_notifications(timeout=QUIET) == []


def skip_nixl(flavor):
    flavor.skip_if("nixl", reason="generations are NotSupported over nixl (test_nixl_refuses_generations)")


# ---------------------------------------------------------------- the owner's table
def test_generations_start_at_one_and_bump_returns_the_new_values(agent_pair):
    _, b = agent_pair
    Pool(SPEC, 0).register(b)
    assert b.generations("kv", [0, 3, 7]) == [1, 1, 1]
    assert b.bump_generations("kv", [3, 7]) == [2, 2]
    assert b.bump_generations("kv", np.array([3], np.int64)) == [3]
    assert b.generations("kv", [0, 3, 7]) == [1, 3, 2]


def test_owner_arguments_are_validated(agent_pair):
    _, b = agent_pair
    Pool(SPEC, 0).register(b)
    with pytest.raises(pdkv.InvalidArgument, match="named twice"):
        b.bump_generations("kv", [1, 1])
    with pytest.raises(pdkv.OutOfRange, match="block 8 is beyond layout 'kv'"):
        b.bump_generations("kv", [8])
    with pytest.raises(pdkv.OutOfRange):
        b.generations("kv", [99])
    with pytest.raises(pdkv.NotFound, match="no layout named 'nope'"):
        b.generations("nope", [0])
    with pytest.raises(pdkv.InvalidArgument):
        b.bump_generations("kv", [1.0])
    with pytest.raises(pdkv.InvalidArgument):
        b.bump_generations("kv", [1], timeout=-1)
    assert b.generations("kv", [1]) == [1]  # nothing was bumped by the failed calls


def test_a_re_added_layout_never_matches_an_old_claim(agent_pair):
    """Removing a layout and adding one of the same name starts above every old
    generation, so a claim handed out for the old layout cannot pass."""
    _, b = agent_pair
    pool = Pool(SPEC, 0)
    pool.register(b)
    b.bump_generations("kv", [2])
    b.remove_layout("kv")
    b.add_layout("kv", pool.layout)
    assert b.generations("kv", [0, 2]) == [3, 3]


# ---------------------------------------------------------------- stale writes and reads
def test_correct_generations_transfer_bit_exact(pools, flavor):
    skip_nixl(flavor)
    a, b, src, dst, peer = pools
    gens = b.generations("kv", [4, 5])
    assert a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [4, 5], generations=gens), notify="w").wait(10)
    assert dst.digest([4, 5]) == src.digest([0, 1])
    assert [n.data for n in b.wait_notifications(timeout=5)] == [b"w"]
    # After a bump the new generations work (the blocks were handed out again).
    gens = b.bump_generations("kv", [6, 7])
    assert a.read(peer, pdkv.Blocks("kv", [2, 3]), pdkv.Blocks("kv", [6, 7], generations=gens)).wait(10)
    assert src.digest([2, 3]) == dst.digest([6, 7])


def test_stale_write_lands_nowhere_and_delivers_no_notification(pools, flavor):
    skip_nixl(flavor)
    a, b, src, dst, peer = pools
    gens = b.generations("kv", [3, 4])
    b.bump_generations("kv", [4])  # the owner freed block 4 (3 is still live)
    canary = dst.logical(range(SPEC.blocks)).copy()
    x = a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [3, 4], generations=gens), notify="late")
    with pytest.raises(pdkv.StaleBlock) as e:
        x.wait(10)
    msg = str(e.value)
    assert "layout 'kv' block 4" in msg and "expects generation 1" in msg and "at generation 2" in msg
    assert x.state == pdkv.XferState.FAILED
    assert np.array_equal(dst.logical(range(SPEC.blocks)), canary)
    assert no_notification(b)


def test_stale_read_leaves_the_local_buffer_untouched(pools, flavor):
    skip_nixl(flavor)
    a, b, src, dst, peer = pools
    gens = b.generations("kv", [2])
    b.bump_generations("kv", [2])
    before = src.logical(range(SPEC.blocks)).copy()
    with pytest.raises(pdkv.StaleBlock, match="block 2"):
        a.read(peer, pdkv.Blocks("kv", [5]), pdkv.Blocks("kv", [2], generations=gens), notify="r").wait(10)
    assert np.array_equal(src.logical(range(SPEC.blocks)), before)
    assert no_notification(b)


def test_late_write_after_timeout_and_reuse_never_lands(pools, flavor):
    """The real-world race: decode hands block 6 to prefill, gives up waiting, bumps and
    reuses the block at once for another request; prefill's retry (or late write)
    arrives afterwards and must not overwrite the new request's KV."""
    skip_nixl(flavor)
    a, b, src, dst, peer = pools
    gens = b.generations("kv", [6])           # handed to prefill with the id
    b.bump_generations("kv", [6], timeout=5)  # decode gives up on the request
    dst.fill(7)                               # ...and reuses block 6 for another one
    reused = dst.logical([6]).copy()
    late = a.prepare("write", peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [6], generations=gens))
    assert late.checked
    with pytest.raises(pdkv.StaleBlock):
        late.post(notify="prefill-done").wait(10)
    assert np.array_equal(dst.logical([6]), reused)
    assert no_notification(b)


def test_prepared_transfer_checks_at_every_post(pools, flavor):
    skip_nixl(flavor)
    a, b, src, dst, peer = pools
    prep = a.prepare("write", peer, pdkv.Blocks("kv", [0, 1]),
                     pdkv.Blocks("kv", [2, 3], generations=b.generations("kv", [2, 3])))
    assert prep.post().wait(10)
    assert dst.digest([2, 3]) == src.digest([0, 1])
    b.bump_generations("kv", [3])
    dst.fill(9)
    before = dst.logical([2, 3]).copy()
    with pytest.raises(pdkv.StaleBlock, match="block 3"):
        prep.post(notify="again").wait(10)
    assert np.array_equal(dst.logical([2, 3]), before)
    assert no_notification(b)


def test_transfers_without_generations_are_unchanged(pools, flavor):
    a, b, src, dst, peer = pools
    b.bump_generations("kv", [1])
    assert a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1])).wait(10)  # unchecked: the caller did not ask
    assert dst.digest([1]) == src.digest([0])
    assert not a.prepare("write", peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1])).checked


def test_initiator_arguments_are_validated(pools, flavor):
    skip_nixl(flavor)
    a, b, src, dst, peer = pools
    with pytest.raises(pdkv.InvalidArgument, match="Blocks.generations has 2 entries for 1 blocks"):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1], generations=[1, 1]))
    with pytest.raises(pdkv.InvalidArgument, match="Blocks.generations must be a sequence of integer block gen"):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1], generations=[1.0]))
    with pytest.raises(pdkv.InvalidArgument, match="generation 0"):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1], generations=[0]))
    with pytest.raises(pdkv.InvalidArgument, match="empty"):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1], generations=[]))
    with pytest.raises(pdkv.OutOfRange):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1], generations=[-1]))
    with pytest.raises(pdkv.InvalidArgument):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1], generations="1"))
    # Generations are the remote side's: on the local side (or with remote=None) they are refused.
    with pytest.raises(pdkv.InvalidArgument, match="give the peer's generations with the remote blocks"):
        a.write(peer, pdkv.Blocks("kv", [1], generations=[1]))
    with pytest.raises(pdkv.InvalidArgument, match="local blocks carry generations"):
        a.read(peer, pdkv.Blocks("kv", [0], generations=[1]), pdkv.Blocks("kv", [1]))
    assert no_notification(b)


def test_nixl_refuses_generations(pools, flavor):
    if flavor.name != "nixl":
        pytest.skip("nixl only")
    a, b, src, dst, peer = pools
    with pytest.raises(pdkv.NotSupported, match="cannot check block generations"):
        a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1], generations=b.generations("kv", [1])))


# ---------------------------------------------------------------- bump vs. transfers in flight
def _raw_tcp(target: pdkv.Agent) -> socket.socket:
    from test_bad_input import T_HELLO_ACK, authenticate

    host, port = target.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    _OPEN.append(s)
    h, _ = authenticate(s, target="target")
    assert h[1] == T_HELLO_ACK
    return s


def _claim(layout: str, blocks, gens) -> bytes:
    body = struct.pack("<I", len(layout)) + layout.encode() + struct.pack("<I", len(blocks))
    body += b"".join(struct.pack("<II", b_, g) for b_, g in zip(blocks, gens))
    return struct.pack("<I", len(body)) + body


def _k0_block(pool: Pool, agent: pdkv.Agent, block: int) -> tuple[int, int, int]:
    """(region id, offset, nbytes) of layer 0's K bytes of `block` in an "nhd" pool."""
    k0 = pool.k[0]
    region = next(r for r in agent.regions if r.addr == k0.ctypes.data)
    nbytes = k0[block].nbytes
    return region.id, block * nbytes, nbytes


def test_bump_waits_for_a_write_in_flight_over_tcp():
    """A raw sender has a write accepted (claim checked) and stalls mid-payload: bump
    must not return while it may still land; with a short timeout it says so; once the
    payload is complete bump returns, and the same claim is refused afterwards."""
    from test_bad_input import EXT, HDR, MAGIC, T_ACK, T_WRITE, recv_frame

    codes = pdkv._native.module().status_code_names()

    with pdkv.Agent("target", secret=SECRET, transports=["tcp"]) as b:
        pool = Pool(SPEC, 2)
        pool.register(b)
        region, off, n = _k0_block(pool, b, 5)
        gens = b.generations("kv", [5])
        claim = _claim("kv", [5], gens)
        payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
        s = _raw_tcp(b)
        s.sendall(HDR.pack(MAGIC, T_WRITE, 4, 7, 0, 1, n, len(claim), 0) + EXT.pack(region, off, n) + claim
                  + payload[: n // 2])
        time.sleep(0.2)  # the target has read the claim and pinned block 5
        with pytest.raises(pdkv.TransferTimeout, match="block 5 still in use"):
            b.bump_generations("kv", [5], timeout=0.3)
        assert b.generations("kv", [5]) == [gens[0] + 1]  # in force despite the timeout
        done = threading.Event()
        result = {}

        def bump():
            result["gens"] = b.bump_generations("kv", [5], timeout=10)
            done.set()

        t = threading.Thread(target=bump)
        t.start()
        assert not done.wait(0.3), "bump returned while an accepted write was still landing"
        s.sendall(payload[n // 2:])
        h, aux = recv_frame(s)
        assert h[1] == T_ACK and h[8] == 0
        assert done.wait(10)
        t.join()
        assert result["gens"] == [gens[0] + 2]
        assert pool.k[0][5].tobytes() == payload  # accepted before the bump: it landed
        # The same claim now: refused before the payload lands, the connection stays usable.
        canary = pool.logical(range(SPEC.blocks)).copy()
        s.sendall(HDR.pack(MAGIC, T_WRITE, 4, 8, 0, 1, n, len(claim), 0) + EXT.pack(region, off, n) + claim
                  + bytes(n))
        h, aux = recv_frame(s)
        assert h[1] == T_ACK and codes[h[8]] == "StaleBlock" and b"block 5" in aux
        assert np.array_equal(pool.logical(range(SPEC.blocks)), canary)
        s.close()


def test_malformed_claims_close_the_connection_before_the_payload():
    from test_bad_input import EXT, HDR, MAGIC, T_WRITE, T_READ_REQ, expect_error_and_close

    with pdkv.Agent("target", secret=SECRET, transports=["tcp"]) as b:
        pool = Pool(SPEC, 2)
        pool.register(b)
        region, off, n = _k0_block(pool, b, 1)
        canary = pool.logical(range(SPEC.blocks)).copy()
        bad = {
            "count beyond the aux": struct.pack("<I", 12) + struct.pack("<I", 2) + b"kv" + struct.pack("<I", 1 << 30),
            "length beyond the aux": struct.pack("<I", 1 << 20) + b"\0" * 8,
            "generation 0": _claim("kv", [1], [0]),
            "trailing bytes": _claim("kv", [1], [1]) + b"x",
        }
        for why, aux in bad.items():
            s = _raw_tcp(b)
            s.sendall(HDR.pack(MAGIC, T_WRITE, 4, 1, 0, 1, n, len(aux), 0) + EXT.pack(region, off, n) + aux
                      + b"\xff" * n)
            expect_error_and_close(s, "ProtocolError", "")
            s.close()
        # A read request's claim section is bounded by the frame rules (before allocation).
        s = _raw_tcp(b)
        s.sendall(HDR.pack(MAGIC, T_READ_REQ, 4, 1, 0, 1, 0, 64 << 20, 0) + EXT.pack(region, off, n))
        expect_error_and_close(s, "ProtocolError", "aux bytes")
        s.close()
        assert np.array_equal(pool.logical(range(SPEC.blocks)), canary)


SHM_MAGIC = 0x534B4450
LEASE_REQ, LEASE_RESP, LEASE_END = 10, 11, 12


def _shm_raw(target: pdkv.Agent) -> socket.socket:
    from test_shm_trust import HELLO_ACK, authenticate, recv_ctl, shm_path

    s = socket.socket(socket.AF_UNIX)
    _OPEN.append(s)
    s.settimeout(5)
    s.connect(shm_path(target))
    authenticate(s, SECRET, "target")
    assert recv_ctl(s)[0] == HELLO_ACK
    return s


def _shm_frame(type_: int, ident: int, aux: bytes = b"") -> bytes:
    return struct.pack("<IHHQII", SHM_MAGIC, type_, 0, ident, len(aux), 0) + aux


def _shm_recv(s: socket.socket):
    h = b""
    while len(h) < 24:
        c = s.recv(24 - len(h))
        if not c:
            return None
        h += c
    hdr = struct.unpack("<IHHQII", h)
    aux = b""
    while len(aux) < hdr[4]:
        aux += s.recv(hdr[4] - len(aux))
    return hdr, aux


def test_bump_waits_for_a_held_shm_lease():
    """An shm initiator copies directly: it leases the blocks first. While a lease is
    held the owner's bump waits; ending the lease lets it return; a stale lease
    request is refused with StaleBlock; a closed connection releases its leases."""
    if "shm" not in pdkv.available_transports():
        pytest.skip("no shm transport")
    with pdkv.Agent("target", secret=SECRET, transports=["shm"]) as b:
        Pool(SPEC, 2).register(b)
        gens = b.generations("kv", [2, 3])
        s = _shm_raw(b)
        s.sendall(_shm_frame(LEASE_REQ, 1, struct.pack("<I", 60000) + _claim("kv", [2, 3], gens)[4:]))
        hdr, aux = _shm_recv(s)
        assert hdr[1] == LEASE_RESP and hdr[3] == 1 and hdr[5] == 0
        with pytest.raises(pdkv.TransferTimeout, match="block 2"):
            b.bump_generations("kv", [2], timeout=0.3)
        done = threading.Event()
        threading.Thread(target=lambda: (b.bump_generations("kv", [3], timeout=10), done.set())).start()
        assert not done.wait(0.3), "bump returned while a lease on the block was held"
        s.sendall(_shm_frame(LEASE_END, 1))
        assert done.wait(10)
        # The old claim is now refused, without closing the connection.
        s.sendall(_shm_frame(LEASE_REQ, 2, struct.pack("<I", 60000) + _claim("kv", [2, 3], gens)[4:]))
        hdr, aux = _shm_recv(s)
        assert hdr[1] == LEASE_RESP and hdr[5] != 0 and b"layout 'kv' block 2" in aux
        # A lease held by a connection that dies is released with it.
        cur = b.generations("kv", [4])
        s.sendall(_shm_frame(LEASE_REQ, 3, struct.pack("<I", 60000) + _claim("kv", [4], cur)[4:]))
        hdr, _ = _shm_recv(s)
        assert hdr[5] == 0
        s.close()
        assert b.bump_generations("kv", [4], timeout=10) == [cur[0] + 1]


def test_an_shm_lease_held_too_long_is_broken():
    """A peer that never ends its lease (frozen) loses its connection after the hold
    time plus a margin; the bump waiting on it then returns."""
    if "shm" not in pdkv.available_transports():
        pytest.skip("no shm transport")
    with pdkv.Agent("target", secret=SECRET, transports=["shm"]) as b:
        Pool(SPEC, 2).register(b)
        s = _shm_raw(b)
        s.sendall(_shm_frame(LEASE_REQ, 1, struct.pack("<I", 1) + _claim("kv", [0], b.generations("kv", [0]))[4:]))
        hdr, _ = _shm_recv(s)
        assert hdr[5] == 0
        t0 = time.monotonic()
        assert b.bump_generations("kv", [0], timeout=30) == [2]
        assert time.monotonic() - t0 < 20
        assert _shm_recv(s) is None  # the target closed the connection
        s.close()


# ---------------------------------------------------------------- two processes
def test_two_processes_stale_write_is_refused_by_the_decode_process(spawn_peer):
    """Decode (another process) hands out blocks with generations, gives up and bumps;
    prefill's late write fails with StaleBlock there and its KV stays intact."""
    decode = spawn_peer("decode", SPEC, 2)
    with pdkv.Agent("prefill", secret=SECRET, transports=["tcp"]) as a:
        src = Pool(SPEC, 1)
        src.register(a)
        peer = a.connect(decode.address)
        handed = decode.call(cmd="gens", blocks=[1, 2])["gens"]
        assert a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [1, 2], generations=handed),
                       notify="ok").wait(10)
        assert decode.call(cmd="digest", blocks=[1, 2])["digest"] == src.digest([0, 1])
        assert decode.call(cmd="bump", blocks=[2])["gens"] == [handed[1] + 1]
        before = decode.call(cmd="digest", blocks=list(range(SPEC.blocks)))["digest"]
        src.fill(3)
        with pytest.raises(pdkv.StaleBlock, match="block 2"):
            a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [1, 2], generations=handed),
                    notify="late").wait(10)
        assert decode.call(cmd="digest", blocks=list(range(SPEC.blocks)))["digest"] == before
        # And the other way: the decode process reads with generations it was given.
        gens = a.generations("kv", [5])
        a.bump_generations("kv", [5])
        r = decode.call(cmd="xfer", op="read", address=a.address, lblocks=[0], rblocks=[5], rgens=gens)
        assert not r["ok"] and r["error"].startswith("StaleBlock")
