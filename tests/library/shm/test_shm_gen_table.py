"""Reads over shm check block generations against the target's shared generation
table (docs/wire-shm.md "Shared generation tables"), before the copy and again after
it, with no lease round trip: a block the owner freed (bumped) before or during the
read fails it with StaleBlock, and the owner's bump no longer waits for readers.

Without the table (leases), a bump during a read waits for the read, which then
succeeds: the mid-copy test below never sees its StaleBlock.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import pdkv
from conftest import SECRET
from kvpools import Pool, PoolSpec

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

SPEC = PoolSpec(layers=2, blocks=8, block_tokens=4, heads=2, head_dim=8)
# 8 MiB blocks (2 layers x K/V x 1024 tokens x 8 heads x 128 x fp16): a 3-block read
# copies 24 MiB on the copy thread, long enough for a bump to land mid-copy.
BIG = PoolSpec(layers=2, blocks=4, block_tokens=1024, heads=8, head_dim=128)


def _agents():
    a = pdkv.Agent("reader", secret=SECRET, transports=["shm"])
    b = pdkv.Agent("owner", secret=SECRET, transports=["shm"])
    return a, b


@contextlib.contextmanager
def _connected(spec):
    """Reader a and owner b over shm, b exporting pool `src` (seed 1), a holding `dst`
    (seed 2) of the same spec: yields (a, b, src, dst, b's peer name at a)."""
    a, b = _agents()
    with a, b:
        src, dst = Pool(spec, 1), Pool(spec, 2)
        src.register(b)
        dst.register(a)
        yield a, b, src, dst, a.add_peer(b.metadata())


def _table_words(layout: str) -> np.ndarray:
    """The owner's own writable mapping of the published table of `layout` that a
    reader in this process mapped (a stand-in for an owner that garbles its own
    table). The file itself is sealed against every later write
    (F_SEAL_FUTURE_WRITE), so only the mapping its owner made before sealing it can
    change the values."""
    import ctypes

    with open("/proc/self/maps") as f:
        maps = [line.split(maxsplit=5) for line in f]
    maps = [m for m in maps if len(m) == 6 and m[5].startswith(f"/memfd:pdkv-gens-{layout} ")]
    read = {m[4] for m in maps if m[1] == "r--s"}  # the reader's mapping of the owner's table
    for m in maps:
        if m[1] == "rw-s" and m[4] in read:
            lo, hi = (int(x, 16) for x in m[0].split("-"))
            return np.ctypeslib.as_array((ctypes.c_uint32 * ((hi - lo) // 4)).from_address(lo))
    raise AssertionError(f"no writable mapping of the generation table of layout {layout!r}")


def test_read_with_generations_is_bit_exact_and_stale_before_the_read_copies_nothing():
    with _connected(SPEC) as (a, b, src, dst, peer):
        gens = b.generations("kv", [1, 2])
        assert a.read(peer, pdkv.Blocks("kv", [5, 6]), pdkv.Blocks("kv", [1, 2], generations=gens),
                      notify=b"ok").wait(10)
        assert np.array_equal(dst.logical([5, 6]), src.logical([1, 2]))
        assert [n.data for n in b.wait_notifications(5)] == [b"ok"]
        # Bumped before the read: StaleBlock, nothing copied, no notification.
        b.bump_generations("kv", [2], timeout=1.0)
        before = dst.logical(range(SPEC.blocks)).copy()
        src.fill(3)
        with pytest.raises(pdkv.StaleBlock, match=r"block 2.*nothing was transferred"):
            a.read(peer, pdkv.Blocks("kv", [5, 6]), pdkv.Blocks("kv", [1, 2], generations=gens), notify=b"no").wait(10)
        assert np.array_equal(dst.logical(range(SPEC.blocks)), before)
        assert b.wait_notifications(0.2) == []
        # The current generations read the new bytes.
        assert a.read(peer, pdkv.Blocks("kv", [5, 6]),
                      pdkv.Blocks("kv", [1, 2], generations=b.generations("kv", [1, 2]))).wait(10)
        assert np.array_equal(dst.logical([5, 6]), src.logical([1, 2]))
        # A block beyond the owner's table is refused before anything moves.
        with pytest.raises((pdkv.OutOfRange, pdkv.InvalidArgument)):
            a.read(peer, pdkv.Blocks("kv", [5]), pdkv.Blocks("kv", [SPEC.blocks], generations=[1])).wait(10)


def test_a_bump_during_the_read_fails_it_and_does_not_wait_for_it():
    """The owner bumps while the 24 MiB copy runs, then writes the new owner's bytes
    into the block at once (a bump no longer waits for readers). The read must fail
    with StaleBlock (the destination bytes are then not valid); a read that finished
    before the bump must hold the old owner's bytes exactly."""
    with _connected(BIG) as (a, b, src, dst, peer):
        assert a.read(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [0])).wait(30)  # connect, confirm, map
        mid_copy = 0
        for attempt in range(5):
            src.fill(10 + attempt)
            want = src.logical([1, 2, 3]).copy()
            gens = b.generations("kv", [1, 2, 3])
            x = a.read(peer, pdkv.Blocks("kv", [1, 2, 3]), pdkv.Blocks("kv", [1, 2, 3], generations=gens), timeout=30)
            b.bump_generations("kv", [2], timeout=30)
            src.fill(100 + attempt)  # the new owner's bytes
            try:
                x.wait(30)
            except pdkv.StaleBlock as e:
                assert "during the read" in str(e) and "not valid" in str(e), e
                mid_copy += 1
                continue
            assert np.array_equal(dst.logical([1, 2, 3]), want)  # finished before the bump
        assert mid_copy >= 1, "no read was still copying when its block was bumped"
        # The agent is unharmed: a verified read with current generations.
        assert a.read(peer, pdkv.Blocks("kv", [1, 2, 3]),
                      pdkv.Blocks("kv", [1, 2, 3], generations=b.generations("kv", [1, 2, 3]))).wait(30)
        assert np.array_equal(dst.logical([1, 2, 3]), src.logical([1, 2, 3]))


def test_a_bump_between_the_checks_of_a_queued_read_fails_it_every_time():
    """Deterministic: the single copy thread takes jobs in order. A 128 MiB read (no
    generations) is posted first and keeps it busy; the read under test, posted next,
    passes its first check at post and waits behind it; the owner bumps one of its
    blocks while the blocker still copies (checked after the bump: then the read's
    copy and second check cannot have happened yet). The read must fail with
    StaleBlock every such time, and no release notification may reach the owner."""
    a = pdkv.Agent("reader", secret=SECRET, transports=["shm"], options=[pdkv.ShmOptions(copy_threads=1)])
    b = pdkv.Agent("owner", secret=SECRET, transports=["shm"])
    with a, b:
        src, dst = Pool(BIG, 1), Pool(BIG, 2)
        src.register(b)
        dst.register(a)
        n = 128 << 20
        big = b.alloc(n)
        local = np.zeros(n, np.uint8)
        lr = a.register(local, remote_access=False)
        peer = a.add_peer(b.metadata())
        blocker = a.prepare_extents("read", peer, [(lr.id, 0, big.id, 0, n)])
        assert blocker.post().wait(60)  # connect, confirm, map
        assert a.read(peer, pdkv.Blocks("kv", [0]),
                      pdkv.Blocks("kv", [0], generations=b.generations("kv", [0]))).wait(30)
        checked = 0
        for attempt in range(6):
            src.fill(20 + attempt)
            gens = b.generations("kv", [1, 2, 3])
            first = blocker.post(timeout=60)
            x = a.read(peer, pdkv.Blocks("kv", [1, 2, 3]), pdkv.Blocks("kv", [1, 2, 3], generations=gens),
                       notify=b"stale", timeout=60)
            b.bump_generations("kv", [3], timeout=30)
            queued = not first.done  # the read's copy has not started: its second check is after the bump
            src.fill(200 + attempt)  # the new owner's bytes
            assert first.wait(60)
            if not queued:  # precondition missed (a very slow bump): either outcome is right
                try:
                    x.wait(60)
                except pdkv.StaleBlock:
                    pass
                b.wait_notifications(0.1)
                continue
            checked += 1
            with pytest.raises(pdkv.StaleBlock, match=r"block 3.*during the read.*not valid"):
                x.wait(60)
            assert b.wait_notifications(0.1) == []
        assert checked >= 3, f"the blocker finished before the bump in {6 - checked} of 6 attempts"
        # The agent is unharmed: a verified read with current generations.
        assert a.read(peer, pdkv.Blocks("kv", [1, 2, 3]),
                      pdkv.Blocks("kv", [1, 2, 3], generations=b.generations("kv", [1, 2, 3]))).wait(30)
        assert np.array_equal(dst.logical([1, 2, 3]), src.logical([1, 2, 3]))


def test_a_garbled_table_fails_reads_and_never_crashes_the_reader():
    with _connected(SPEC) as (a, b, src, dst, peer):
        gens = b.generations("kv", list(range(SPEC.blocks)))
        assert a.read(peer, pdkv.Blocks("kv", [0]),
                      pdkv.Blocks("kv", [0], generations=gens[:1])).wait(10)  # maps the table
        words = _table_words("kv")
        original = words[:SPEC.blocks].copy()
        assert np.array_equal(original, gens)
        rng = np.random.default_rng(7)
        for garbage in (rng.integers(0, 2**32, SPEC.blocks, dtype=np.uint32),
                        np.full(SPEC.blocks, 0xFFFFFFFF, np.uint32), np.zeros(SPEC.blocks, np.uint32)):
            words[:SPEC.blocks] = garbage
            before = dst.logical(range(SPEC.blocks)).copy()
            with pytest.raises(pdkv.StaleBlock, match="block 3"):
                a.read(peer, pdkv.Blocks("kv", [4]), pdkv.Blocks("kv", [3], generations=gens[3:4])).wait(10)
            assert np.array_equal(dst.logical(range(SPEC.blocks)), before)
        words[:SPEC.blocks] = original
        assert a.read(peer, pdkv.Blocks("kv", [4]), pdkv.Blocks("kv", [3], generations=gens[3:4])).wait(10)
        assert np.array_equal(dst.logical([4]), src.logical([3]))


def test_a_re_added_layout_is_read_through_its_new_table():
    """The owner removes and re-adds a layout: the reader's mapped table is all 0 (the
    mark of a removed layout), so it asks for the new one; old claims stay stale."""
    with _connected(SPEC) as (a, b, src, dst, peer):
        old = b.generations("kv", [1])
        assert a.read(peer, pdkv.Blocks("kv", [1]), pdkv.Blocks("kv", [1], generations=old)).wait(10)
        b.remove_layout("kv")
        b.add_layout("kv", src.layout)
        new = b.generations("kv", [1])
        assert new[0] > old[0]
        with pytest.raises(pdkv.StaleBlock):
            a.read(peer, pdkv.Blocks("kv", [1]), pdkv.Blocks("kv", [1], generations=old)).wait(10)
        src.fill(4)
        assert a.read(peer, pdkv.Blocks("kv", [1]), pdkv.Blocks("kv", [1], generations=new)).wait(10)
        assert np.array_equal(dst.logical([1]), src.logical([1]))


def test_a_layout_re_added_with_more_blocks_is_read_through_its_new_table():
    a, b = _agents()
    with a, b:
        small, big = Pool(SPEC, 1), Pool(PoolSpec(layers=2, blocks=16, block_tokens=4, heads=2, head_dim=8), 5)
        small.register(b)
        big.register(b, name="kv-big")  # registers big's arrays; its layout goes in as "kv" below
        dst = Pool(PoolSpec(layers=2, blocks=16, block_tokens=4, heads=2, head_dim=8), 2)
        dst.register(a)
        peer = a.add_peer(b.metadata())
        assert a.read(peer, pdkv.Blocks("kv", [1]),
                      pdkv.Blocks("kv", [1], generations=b.generations("kv", [1]))).wait(10)
        b.remove_layout("kv")
        b.add_layout("kv", big.layout)
        peer = a.add_peer(b.metadata())
        gens = b.generations("kv", [12])
        assert a.read(peer, pdkv.Blocks("kv", [3]), pdkv.Blocks("kv", [12], generations=gens)).wait(10)
        assert np.array_equal(dst.logical([3]), big.logical([12]))
