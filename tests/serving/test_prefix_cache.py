"""The prefix cache's block manager (pdkv.serving.prefix_cache): reference counts, the
hash index, LRU eviction only when no free block is left, the evict hook for exposed
blocks only, events in order, snapshots, leases and imports, and bad input."""

from __future__ import annotations

import pytest

from pdkv.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from pdkv.serving.engine_types import KVEvent
from pdkv.serving.kv_pool import BlockAllocator
from pdkv.serving.prefix_cache import PrefixCache
from pdkv.serving.prefix_hash import block_hashes, cache_salt

SALT = cache_salt("unit", block_tokens=2, dtype="float32")
H = block_hashes(list(range(3, 3 + 2 * 8)), 2, SALT)  # a chain of 8 block hashes


def make(n: int = 6, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockAllocator(n), enabled=enabled)


def test_disabled_is_the_plain_allocator() -> None:
    c = make(4, enabled=False)
    a = c.alloc(3)
    assert a == [0, 1, 2] and c.num_free == 1
    assert c.insert(a, H[:3]) == 0 and c.snapshot() == () and c.match(H[:3]) == []
    c.free([1, 0])
    assert c.alloc(2) == [3, 1]  # freed ids go to the back of the free list, as BlockAllocator
    with pytest.raises(InvalidArgument, match="not held"):
        c.free([0, 0])
    with pytest.raises(InvalidArgument, match="cache is off"):
        c.import_blocks("l", H[:1])
    assert c.take_events() == []


def test_refcounts_and_sharing() -> None:
    c = make()
    a = c.alloc(2)
    assert c.insert(a, H[:2]) == 2
    assert c.match(H[:3]) == a  # leading run only
    c.acquire(a)  # a second request shares them
    assert [c.refcount(b) for b in a] == [2, 2]
    c.free(a)
    assert [c.refcount(b) for b in a] == [1, 1] and c.num_cached_free == 0
    c.free(a)
    assert c.num_cached_free == 2 and c.num_free == 6  # cached free blocks count as free
    assert c.num_cached == 2 and c.match(H[:2]) == a
    with pytest.raises(InvalidArgument, match="not held"):
        c.free([a[0]])
    with pytest.raises(InvalidArgument, match="neither held nor cached"):
        c.acquire([5])


def test_insert_skips_duplicates_and_needs_held_blocks() -> None:
    c = make()
    a, b = c.alloc(1), c.alloc(1)
    assert c.insert(a, H[:1]) == 1
    assert c.insert(b, H[:1]) == 0  # another block computed the same prefix: not shared
    assert c.match(H[:1]) == a
    c.free(b)
    assert c.num_cached_free == 0 and c.allocator.num_free == 5  # an uncached block goes back to the free list
    with pytest.raises(InvalidArgument, match="not held"):
        c.insert([5], H[3:4])


def test_lru_evicts_oldest_only_when_no_free_block_is_left() -> None:
    c = make(4)
    blocks = c.alloc(3)
    c.insert(blocks, H[:3])
    c.free([blocks[1]])
    c.free([blocks[0]])
    c.free([blocks[2]])
    assert c.lru_order() == [blocks[1], blocks[0], blocks[2]]
    c.take_events()
    assert c.alloc(1) == [3]  # the never-cached block first: nothing evicted
    assert c.evictions == 0 and c.num_cached == 3
    c.acquire([blocks[1]])  # a hit refreshes nothing but takes it off the LRU
    c.free([blocks[1]])     # ...and puts it back as the most recent
    assert c.lru_order() == [blocks[0], blocks[2], blocks[1]]
    got = c.alloc(2)
    assert got == [blocks[0], blocks[2]] and c.evictions == 2
    assert c.match(H[:1]) == [] and c.match(H[1:2]) == [blocks[1]]
    assert c.take_events() == [KVEvent("evicted", (H[0], H[2]))]
    with pytest.raises(ResourceExhausted, match="2 blocks requested, 1 free"):
        c.alloc(2)
    assert c.num_cached == 1  # a failed allocation evicts nothing


def test_evict_hook_runs_for_exposed_blocks_only() -> None:
    c = make(3)
    calls: list[list[int]] = []
    c.set_evict_hook(calls.append)
    blocks = c.alloc(3)
    c.insert(blocks, H[:3])
    c.expose([blocks[1]])
    for b in blocks:
        c.free([b])
    assert c.alloc(1) == [blocks[0]] and calls == []  # never exposed: reused without a bump
    assert c.alloc(1) == [blocks[1]] and calls == [[blocks[1]]]
    c.free([blocks[1]])  # uncached now: back to the free list, taken first
    assert c.alloc(1) == [blocks[1]]
    assert c.alloc(1) == [blocks[2]]
    c.free(blocks)
    assert sorted(c.alloc(3)) == sorted(blocks)
    assert calls == [[blocks[1]]]  # the bump clears the flag: one call per exposure
    assert c.hook_calls == 1


def test_hook_failure_is_logged_and_the_block_reused(caplog) -> None:
    c = make(1)

    def hook(ids: list[int]) -> None:
        raise TimeoutError("a read is still running")

    c.set_evict_hook(hook)
    b = c.alloc(1)
    c.insert(b, H[:1])
    c.expose(b)
    c.free(b)
    assert c.alloc(1) == b
    assert "evict hook failed" in caplog.text


def test_events_in_order_and_snapshot() -> None:
    c = make(3)
    a = c.alloc(2)
    c.insert(a, H[:2])
    c.free(a)
    c.alloc(3)  # one free, two evicted (oldest first)
    assert c.snapshot() == ()
    c2 = make(3)
    x = c2.alloc(1)
    c2.insert(x, H[:1])
    y = c2.alloc(1)
    c2.insert(y, H[1:2])
    assert c2.snapshot() == (H[0], H[1])
    assert c2.clear() == 2
    assert c2.snapshot() == ()
    # One free's blocks enter the LRU tail first: the chain's head is evicted last.
    assert c.take_events() == [KVEvent("stored", (H[0], H[1])), KVEvent("evicted", (H[1], H[0]))]
    assert c2.take_events() == [KVEvent("stored", (H[0],)), KVEvent("stored", (H[1],)), KVEvent("cleared", ())]
    assert c2.take_events() == []
    c2.free(x + y)  # held through the clear, uncached now
    assert c2.allocator.num_free == 3


def test_clear_bumps_exposed_free_blocks() -> None:
    c = make(2)
    calls: list[list[int]] = []
    c.set_evict_hook(calls.append)
    b = c.alloc(2)
    c.insert(b, H[:2])
    c.expose(b)
    c.free([b[0]])
    c.clear()
    assert calls == [[b[0]]]  # the held one keeps its flag: bumped when it is reused
    c.free([b[1]])
    c.alloc(2)
    assert calls == [[b[0]], [b[1]]]


def test_leases_pin_expose_and_release() -> None:
    c = make(3)
    calls: list[list[int]] = []
    c.set_evict_hook(calls.append)
    blocks = c.alloc(2)
    c.insert(blocks, H[:2])
    c.free(blocks)
    assert c.lease("l1", [H[0], H[1], H[2]]) == blocks  # the cached leading run
    assert c.num_free == 1 and c.num_leases == 1
    assert c.lease("l0", [H[5]]) == [] and c.num_leases == 1  # nothing cached: no lease
    with pytest.raises(AlreadyExists):
        c.lease("l1", H[:1])
    with pytest.raises(ResourceExhausted):
        c.alloc(2)  # leased blocks are not evictable
    assert c.unlease("l1") and not c.unlease("l1")
    assert c.alloc(3) and calls == [blocks[::-1]]  # exposed by the lease: bumped on eviction


def test_imports_commit_and_abort() -> None:
    c = make(4)
    got = c.import_blocks("imp", H[:2])
    assert len(got) == 2 and c.match(H[:1]) == []  # not cached before the commit
    assert c.commit_import("imp") == 2
    assert c.match(H[:2]) == got
    with pytest.raises(InvalidArgument, match="committed already"):
        c.commit_import("imp")
    assert c.take_imported(got[:1]) == 1 and c.take_imported(got) == 1  # once each
    assert c.unlease("imp")
    assert c.num_cached_free == 2  # committed: stays cached after the lease ends
    other = c.import_blocks("imp2", H[2:4])
    assert c.unlease("imp2")  # never committed: freed, nothing cached
    assert c.num_cached == 2 and c.allocator.num_free == 2 and set(other).isdisjoint(got)
    with pytest.raises(NotFound):
        c.commit_import("imp2")
    assert c.lease("reader", H[:2]) == got  # pins the two cached blocks: two are left
    with pytest.raises(ResourceExhausted):
        c.import_blocks("big", H[2:5])
    assert c.lease_blocks("big") is None and c.num_free == 2 and c.num_cached == 2


def test_commit_skips_hashes_cached_meanwhile() -> None:
    c = make(4)
    imp = c.import_blocks("imp", H[:2])
    local = c.alloc(1)
    c.insert(local, H[:1])  # computed here while the pull ran
    assert c.commit_import("imp") == 1
    assert c.match(H[:2]) == [local[0], imp[1]]
    c.unlease("imp")
    assert c.allocator.num_free == 2  # the duplicate block went back to the free list


@pytest.mark.parametrize("lease_id, hashes, match", [
    ("", [H[0]], "lease_id"),
    ("x" * 129, [H[0]], "lease_id"),
    (7, [H[0]], "lease_id"),
    ("l", "abc", "sequence"),
    ("l", [H[0].upper()], "malformed"),
    ("l", [H[0][:-1]], "malformed"),
    ("l", [None], "malformed"),
    ("l", [H[0]] * 7, "pool has 6 blocks"),
])
def test_bad_lease_input(lease_id, hashes, match) -> None:
    c = make()
    with pytest.raises(InvalidArgument, match=match):
        c.lease(lease_id, hashes)
    with pytest.raises(InvalidArgument, match=match):
        c.import_blocks(lease_id, hashes)
    assert c.num_leases == 0 and c.num_free == 6


def test_bad_alloc_and_free() -> None:
    c = make()
    with pytest.raises(InvalidArgument):
        c.alloc(-1)
    with pytest.raises(InvalidArgument, match="not held"):
        c.free([99])
    a = c.alloc(1)
    with pytest.raises(InvalidArgument, match="not held"):
        c.free(a + a)  # twice in one call: nothing freed
    assert c.refcount(a[0]) == 1
    with pytest.raises(InvalidArgument, match="at least one"):
        c.import_blocks("l", [])
